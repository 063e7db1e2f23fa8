"""A connector and a small LM trained on precomputed tower features, the recipe the scenes-QA
studies share (token_budget, native): stage 0 pretrains the LM on the questions' text, stage 1
trains the connector alone, then both train together; scoring is teacher-forced exact match per
question kind. A mid-run snapshot lets a stopped study resume a run where it was."""

from __future__ import annotations

import os
import pathlib
import pickle
import time
from typing import TypedDict

import jax
import jax.numpy as jnp
import numpy as np

from vitmm import decode, losses
from vitmm.data import scenes
from vitmm.models import lm, vlm
from vitmm.study import store
from vitmm.train import optim
from vitmm.train import step as step_lib

BLIND = "blind"  # the baseline whose visual token carries no image
KINDS = scenes.QUESTION_KINDS
EVAL_BATCH = 500  # questions a scoring call takes (the last batch padded): one compiled shape


class JobContext(TypedDict, total=False):
    """What a study hands every job of its worker processes (pickled once per pool), beside the
    arrays: the models' settings, the training plan (``train_and_eval``'s ``plan``), the seeds,
    each seed's stage-0 LM, the jobs' connectors and views, the chosen rates, and where finished
    seeds and mid-run snapshots are kept."""

    tower_cfg: dict  # the frozen tower's ViT settings
    lm_cfg: dict  # the LM's settings (vocabulary included)
    in_dim: int  # the features' width
    max_len: int  # question + answer tokens
    plan: dict  # max_steps, batch_size, eval_every, patience, min_delta, curve_questions, min_steps, ...
    seeds: list  # the seeds every job trains
    stage0: dict  # {seed: the LM's parameters after stage 0}
    stage1_steps: int  # connector-only steps before the joint phase
    jobs: dict  # {job key: {"connector": cfg, "view": name}} (and "signed": a departure from a study's default plan)
    views: dict  # {view name: {"grid": ...}}
    tune_seeds: list  # the seeds tuning runs at
    tune_done: dict  # {tuning key: {seed: result}} already kept: not trained again
    chosen: dict  # {family: (lr, warmup)}
    snapshots: tuple  # (folder, signature): where a run's mid-run snapshot lives
    seed_log: tuple  # (path, signature): each finished seed is appended there
    tune_log: tuple  # (path, signature): each finished tuning seed is appended there
    seeds_done: dict  # {job key: {seed: result}} already kept: not trained again


class FeatureTrainer:
    """Connector + LM on precomputed features: the optimizer and the compiled train step and
    scoring are built once per setting and shared by its seeds."""

    def __init__(self, tower_cfg: dict, connector_cfg: dict, lm_cfg: dict, grid, in_dim: int, max_len: int,
                 steps: int, lr: float, blind: bool = False, stage0: dict | None = None, stage1_steps: int = 0,
                 warmup: int | None = None, schedule: str = "constant"):
        self.model = self.make_model(tower_cfg, connector_cfg, lm_cfg)
        self.grid, self.blind, self.stage0 = tuple(grid), blind, stage0 or {}
        self._example = self.example(in_dim, max_len)
        shapes = jax.eval_shape(self._init, jax.random.key(0))
        # The joint phase: linear warmup, then a constant rate for at most `steps` (early stopping
        # ends it), or a cosine decay to zero at `steps` (a fixed horizon).
        if schedule not in ("constant", "cosine"):
            raise ValueError(f"schedule={schedule!r}: choose 'constant' or 'cosine'.")
        warmup = max(steps // 20, 1) if warmup is None else warmup
        self.tx, _ = optim.make_optimizer(_adamw(lr, steps, warmup, end_factor=1.0 if schedule == "constant" else 0.0),
                                          shapes)
        self._init_jit = jax.jit(self._init)
        self.step = jax.jit(step_lib.update_step(self._loss, self.tx), donate_argnums=(0, 1))
        # Stage 1 (LLaVA's): the connector alone for stage1_steps, the LM frozen, before joint training.
        self.stage1_steps, self.stage1_tx, self.stage1_step = stage1_steps, None, None
        if stage1_steps > 0:
            self.stage1_tx, _ = optim.make_optimizer(
                _adamw(lr, stage1_steps, max(stage1_steps // 20, 1), freeze=(r"language/.*",)), shapes)
            self.stage1_step = jax.jit(step_lib.update_step(self._loss, self.stage1_tx), donate_argnums=(0, 1))
        self.score = jax.jit(lambda params, *batch: self._scores(params, *batch)[2])

    def make_model(self, tower_cfg: dict, connector_cfg: dict, lm_cfg: dict) -> vlm.VLM:
        return vlm.VLM(tower_cfg, connector_cfg, lm_cfg)

    def example(self, in_dim: int, max_len: int) -> tuple:
        """One batch of what ``_batch`` hands the step (the answer mask left out): the shapes ``init`` traces."""
        return jnp.zeros((1, self.grid[0] * self.grid[1], in_dim), jnp.float32), jnp.zeros((1, max_len), jnp.int32)

    def _init(self, key):
        *features, ids = self._example
        return self.model.init(key, None, ids, features=self._features(*features))["params"]

    def init(self, seed: int):
        params = self._init_jit(jax.random.key(seed))
        if seed in self.stage0:  # the LM starts from its stage-0 pretraining on the questions' text
            params = {**params, "language": jax.tree.map(jnp.asarray, self.stage0[seed])}
        return params, self.tx.init(params)

    def _features(self, patches):
        if self.blind:  # the image never reaches the LM: its visual token is the same for all
            patches = jnp.zeros_like(patches)
        return patches, None, self.grid

    def _scores(self, params, patches, ids, mask):
        return decode.answer_scores(self.model, {"params": params}, ids, mask, features=self._features(patches))

    def _loss(self, params, *batch):
        nll, _, _ = self._scores(params, *batch)
        return losses.masked_mean(nll, batch[-1][:, 1:])


def _adamw(lr: float, steps: int, warmup: int, freeze=(), end_factor: float = 0.0):
    """The library's AdamW (``vitmm.train.optim.config``), no weight decay: these runs are short."""
    return optim.config(lr=lr, warmup_steps=warmup, total_steps=steps, end_factor=end_factor, freeze=freeze)


def pretrain_lm(lm_cfg: dict, ids: np.ndarray, pad_id: int, steps: int, batch_size: int, lr: float,
                seed: int) -> tuple[dict, float]:
    """Stage 0: the LM alone on the training questions' text (``[BOS] question answer [EOS]``, no
    image), next-token loss on every text token; ``(params as numpy, mean loss of the last 20 steps)``."""
    model = lm.LM(**lm_cfg)
    params = jax.jit(model.init)(jax.random.key(seed), jnp.zeros((1, ids.shape[1]), jnp.int32))["params"]
    tx, _ = optim.make_optimizer(_adamw(lr, steps, max(steps // 20, 1)), params)

    def loss_fn(p, batch):
        logits = model.apply({"params": p}, batch[:, :-1])
        return losses.masked_mean(losses.token_nll(logits, batch[:, 1:]), batch[:, 1:] != pad_id)

    step = jax.jit(step_lib.update_step(loss_fn, tx), donate_argnums=(0, 1))
    opt_state, rng, history = tx.init(params), np.random.default_rng(seed), []
    for _ in range(steps):
        params, opt_state, loss = step(params, opt_state, jnp.asarray(ids[rng.integers(len(ids), size=batch_size)]))
        history.append(float(loss))
    return jax.tree.map(np.asarray, params), float(np.mean(history[-20:]))


IMAGE_KEYS = ("patches", "newline", "visual_mask")  # per-image arrays of a batch (the last two if a split has them)


def _batch(split: dict, index: np.ndarray, view: str = ""):
    """``(patches, [newline, visual_mask,] ids, answer_mask)`` of the questions ``index``."""
    images = split["image"][index]
    per_image = [jnp.asarray(split[k + view][images]) for k in IMAGE_KEYS if k + view in split]
    return (*per_image, jnp.asarray(split["ids"][index]), jnp.asarray(split["answer_mask"][index]))


def evaluate(run: FeatureTrainer, params, split: dict, view: str = "", limit: int | None = None,
             eval_batch: int = EVAL_BATCH) -> dict:
    """Exact match on the first ``limit`` questions of ``split`` (all by default): overall, per
    kind and on each subset a boolean per-question array ``split["in_NAME"]`` marks (``acc_NAME``)."""
    n = len(split["ids"]) if limit is None else min(limit, len(split["ids"]))
    exact = []
    for start in range(0, n, eval_batch):
        index = np.arange(start, min(start + eval_batch, n))
        pad = eval_batch - len(index)  # one compiled shape: pad the last batch, drop its padding
        hits = np.asarray(run.score(params, *_batch(split, np.concatenate([index, np.zeros(pad, index.dtype)]), view)))
        exact.append(hits[: len(index)])
    exact = np.concatenate(exact)
    result = {"accuracy": float(exact.mean())}
    for k, name in enumerate(KINDS):
        chosen = split["kind"][:n] == k
        result[f"acc_{name}"] = float(exact[chosen].mean()) if chosen.any() else float("nan")
    for key in sorted(k for k in split if k.startswith("in_")):
        chosen = np.asarray(split[key][:n], bool)
        result["acc_" + key[3:]] = float(exact[chosen].mean()) if chosen.any() else float("nan")
    return result


def train_and_eval(run: FeatureTrainer, seed: int, train: dict, val: dict, final: dict, plan: dict, view: str = "",
                   progress=None, snapshot: pathlib.Path | None = None, snapshot_every_s: float = 120.0,
                   keep_snapshot: bool = False) -> dict:
    """Stage 1, then joint steps until validation accuracy plateaus; the result on ``final``.

    ``plan``: ``max_steps``, ``batch_size``, ``eval_every``, ``patience``, ``min_delta``,
    ``curve_questions`` and optionally ``min_steps`` and ``eval_batch`` (questions per scoring call: a
    setting of speed, not of the result). Every ``eval_every`` joint steps (and before the first) the
    model is scored on the first ``curve_questions`` of ``val``; training stops when the best score
    has not risen by ``min_delta`` for ``patience`` evaluations (0: never), but not before
    ``min_steps`` (a run sitting on an early plateau is not a run that has converged), or at
    ``max_steps``. The parameters of the last evaluation that beat the best before it by ``min_delta``
    (so within ``min_delta`` of the highest, and possibly earlier) are scored on ``final`` (the test
    split; the full validation split when tuning). Returns accuracy per kind, the learning curve
    ``[[step, accuracy], ...]``, the tested step (``best_step``), the steps trained, the mean training
    loss of the last 20 steps and ``wall_s``, the run's seconds (across sittings when it resumed; the
    machine shared by the sweep's workers).

    With ``snapshot`` (a file path) the whole state of the run (parameters, optimizer moments,
    the best parameters so far, the curve, the losses and the data order's generator) is written
    there at an evaluation when ``snapshot_every_s`` seconds have passed since the last write, and
    a run that finds the file continues from it: a run killed mid-way (a stopped sweep) resumes
    where its last snapshot was taken, with the result an uninterrupted run gives. The file is
    removed when the run ends, or with ``keep_snapshot`` left for the caller to remove once the
    run's row is kept (``run_seeds``), so that a stop in between loses no run.
    """
    started = time.monotonic()
    rng = np.random.default_rng(seed)
    batch_size, every = plan["batch_size"], plan["eval_every"]
    state = _load_snapshot(snapshot)
    earlier_s = 0.0 if state is None else state.get("wall_s", 0.0)  # the sittings before this one

    def draw():
        return _batch(train, rng.integers(len(train["ids"]), size=batch_size), view)

    if state is not None:
        rng.bit_generator.state = state["rng"]
        params, opt_state = jax.tree.map(jnp.asarray, (state["params"], state["opt_state"]))
        if progress is not None:
            progress.update(run.stage1_steps + state["step"])
    else:
        params, opt_state = run.init(seed)
    if run.stage1_steps and state is None:  # connector only; the joint phase then starts with fresh optimizer moments
        stage1_state = run.stage1_tx.init(params)
        for _ in range(run.stage1_steps):
            params, stage1_state, _ = run.stage1_step(params, stage1_state, *draw())
            if progress is not None:
                progress.update(1)
        opt_state = run.tx.init(params)

    eval_batch = plan.get("eval_batch", EVAL_BATCH)

    def curve_point():
        return evaluate(run, params, val, view, plan["curve_questions"], eval_batch)["accuracy"]

    curve, losses, pending = ([[0, curve_point()]], [], []) if state is None else (state["curve"], state["losses"], [])

    def fetch_losses():  # one host transfer per evaluation, not a sync per step
        new = np.asarray(jax.device_get(pending), np.float64)
        pending.clear()
        bad = np.flatnonzero(~np.isfinite(new))
        if bad.size:
            raise FloatingPointError(f"loss became {new[bad[0]]} at step {len(losses) + bad[0] + 1} "
                                     f"({run.model.connector}, seed {seed}).")
        losses.extend(new.tolist())

    if state is None:
        best_acc, best_step, best_params, step = curve[0][1], 0, jax.tree.map(jnp.copy, params), 0
    else:
        best_acc, best_step, step = state["best_acc"], state["best_step"], state["step"]
        best_params = jax.tree.map(jnp.asarray, state["best_params"])
    saved_at = time.monotonic()
    while step < plan["max_steps"]:
        params, opt_state, loss = run.step(params, opt_state, *draw())
        step += 1
        pending.append(loss)
        if progress is not None:
            progress.update(1)
        if step % every == 0 or step == plan["max_steps"]:
            fetch_losses()
            curve.append([step, curve_point()])
            if curve[-1][1] >= best_acc + plan["min_delta"]:
                best_acc, best_step, best_params = curve[-1][1], step, jax.tree.map(jnp.copy, params)
            elif (0 < plan["patience"] and step - best_step >= plan["patience"] * every
                  and step >= plan.get("min_steps", 0)):
                break
            if snapshot is not None and time.monotonic() - saved_at >= snapshot_every_s:
                _save_snapshot(snapshot, dict(step=step, params=params, opt_state=opt_state, best_params=best_params,
                                              best_acc=best_acc, best_step=best_step, curve=curve, losses=losses,
                                              rng=rng.bit_generator.state,
                                              wall_s=earlier_s + time.monotonic() - started))
                saved_at = time.monotonic()
    if progress is not None:
        progress.update(plan["max_steps"] - step)  # the bar counts every run at its longest
    result = evaluate(run, best_params, final, view, eval_batch=eval_batch)
    if snapshot is not None and not keep_snapshot:
        snapshot.unlink(missing_ok=True)
    return {**result, "best_step": best_step, "steps_trained": step, "min_steps": plan.get("min_steps", 0),
            "final_loss": float(np.mean(losses[-20:])), "curve": curve,
            "wall_s": round(earlier_s + time.monotonic() - started, 1)}


def holds_under_min_steps(min_steps: int | None):
    """Whether a stored result stands for a sweep whose runs stop no sooner than ``min_steps``:
    one run with that floor, or with a lower one and at least ``min_steps`` steps trained (its
    stop rule never fired before then, so the stricter rule fires at the same evaluation and the
    run is the same). Results from before the floor existed count as floor 0. ``None``: runs never
    stop early (patience 0, which the sweep's signature holds), so the floor is never read."""
    def holds(result: dict) -> bool:
        floor = result.get("min_steps", 0)
        return min_steps is None or floor == min_steps or (floor < min_steps and result["steps_trained"] >= min_steps)
    return holds


def snapshot_path(context: JobContext, *identity) -> pathlib.Path | None:
    """Where one run's mid-run snapshot lives: ``context["snapshots"] = (folder, signature of the
    sweep's settings)`` and the run's ``identity`` (key, seed, lr, warmup) name the file; None
    without ``context["snapshots"]``."""
    if not context.get("snapshots"):
        return None
    folder, signature = context["snapshots"]
    return pathlib.Path(folder) / f"{store.signature([signature, *identity])}.pkl"


def stage0(context: JobContext, lm_cfg: dict, ids: np.ndarray, pad_id: int, steps: int, batch_size: int, lr: float,
           seed: int) -> tuple[dict, float]:
    """``pretrain_lm``, kept beside the runs' mid-run snapshots (``context["snapshots"]``, whose
    signature covers stage 0's settings): a restarted sweep reads it instead of training it again
    (on one machine the same numbers: XLA:CPU is deterministic)."""
    path = snapshot_path(context, "stage0", seed)
    saved = _load_snapshot(path)
    if saved is not None:
        return saved["params"], saved["loss"]
    params, loss = pretrain_lm(lm_cfg, ids, pad_id, steps, batch_size, lr, seed)
    if path is not None:
        _save_snapshot(path, {"params": params, "loss": loss})
    return params, loss


def _save_snapshot(path: pathlib.Path, state: dict) -> None:
    """Written whole or not at all: to a temporary file, synced, then renamed over the old one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    with tmp.open("wb") as f:
        pickle.dump(jax.device_get(state), f, protocol=pickle.HIGHEST_PROTOCOL)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _load_snapshot(path: pathlib.Path | None) -> dict | None:
    if path is None or not path.is_file():
        return None
    with path.open("rb") as f:
        return pickle.load(f)


def time_steps(run: FeatureTrainer, train: dict, test: dict, batch_size: int, view: str = "", steps: int = 20,
               eval_batch: int = EVAL_BATCH) -> dict:
    """Seconds per training step and per scoring batch after compilation (medians of ``steps``
    and of 5 batches), from fresh parameters: the cost, not the result, of a run."""
    params, opt_state = run.init(0)
    rng = np.random.default_rng(0)
    train_times, eval_times = [], []
    for i in range(steps + 2):  # the first two steps compile (the second: donated buffers)
        batch = _batch(train, rng.integers(len(train["ids"]), size=batch_size), view)
        t0 = time.perf_counter()
        params, opt_state, loss = run.step(params, opt_state, *batch)
        loss.block_until_ready()
        if i >= 2:
            train_times.append(time.perf_counter() - t0)
    for i in range(6):
        batch = _batch(test, rng.integers(len(test["ids"]), size=eval_batch), view)
        t0 = time.perf_counter()
        run.score(params, *batch).block_until_ready()
        if i:
            eval_times.append(time.perf_counter() - t0)
    return {"train_ms": 1e3 * float(np.median(train_times)) / batch_size,
            "infer_ms": 1e3 * float(np.median(eval_times)) / eval_batch}


def run_seeds(key, context: JobContext, progress, one, snapshot_of=None, tuning: bool = False) -> dict:
    """``{seed: one(seed)}`` over ``context["seeds"]``, each finished seed appended to
    ``context["seed_log"] = (path, signature)`` when given; seeds already in
    ``context["seeds_done"][key]`` are taken from there, not trained again. ``tuning``: the same
    over ``tune_seeds``, ``tune_log`` and ``tune_done``. ``snapshot_of(seed)``: the run's mid-run
    snapshot, removed once its row is kept (at once without a log)."""
    seeds, kept, log = ("tune_seeds", "tune_done", "tune_log") if tuning else ("seeds", "seeds_done", "seed_log")
    done = context.get(kept, {}).get(tuple(key), {})
    out = {}
    for seed in context[seeds]:
        if seed in done:
            out[seed] = done[seed]
            if progress is not None:
                progress.update(context.get("stage1_steps", 0) + context["plan"]["max_steps"])
            continue
        out[seed] = one(seed)
        if context.get(log):
            store.save_cell(pathlib.Path(context[log][0]), context[log][1], key, {seed: out[seed]})
        if snapshot_of is not None and snapshot_of(seed) is not None:
            snapshot_of(seed).unlink(missing_ok=True)
    return out
