"""One run of the token-budget sweep: a connector and the small LM on precomputed tower features
(stage 0 pretraining of the LM on text, stage 1 of the connector alone, then both), its scoring on
a split, and the jobs the worker processes run (``token_budget.py`` is the sweep around them)."""

from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import token_budget_report as report  # a sibling module: experiments/ is on sys.path (token_budget.py)

from vitmm import decode, losses
from vitmm.models import connectors, lm, vlm
from vitmm.train import optim
from vitmm.train import step as step_lib

BLIND, KINDS = report.BLIND, report.KINDS


class Run:
    """Connector + LM on precomputed features: the optimizer and the compiled train step and
    scoring are built once per setting and shared by its seeds."""

    def __init__(self, tower_cfg: dict, connector_cfg: dict, lm_cfg: dict, grid, in_dim: int, max_len: int,
                 steps: int, lr: float, blind: bool = False, stage0: dict | None = None, stage1_steps: int = 0):
        self.model = vlm.VLM(tower_cfg, connector_cfg, lm_cfg)
        self.grid, self.blind, self.stage0 = tuple(grid), blind, stage0 or {}
        self._example = (jnp.zeros((1, grid[0] * grid[1], in_dim), jnp.float32), jnp.zeros((1, max_len), jnp.int32))
        shapes = jax.eval_shape(self._init, jax.random.key(0))
        self.tx, _ = optim.make_optimizer(_adamw(lr, steps), shapes)
        self._init_jit = jax.jit(self._init)
        self.step = jax.jit(step_lib.update_step(self._loss, self.tx), donate_argnums=(0, 1))
        # Stage 1 (LLaVA's): the connector alone for stage1_steps, the LM frozen, before joint training.
        self.stage1_steps, self.stage1_tx, self.stage1_step = stage1_steps, None, None
        if stage1_steps > 0:
            self.stage1_tx, _ = optim.make_optimizer(_adamw(lr, stage1_steps, freeze=(r"language/.*",)), shapes)
            self.stage1_step = jax.jit(step_lib.update_step(self._loss, self.stage1_tx), donate_argnums=(0, 1))
        self.score = jax.jit(lambda params, patches, ids, mask: self._scores(params, patches, ids, mask)[2])

    def _init(self, key):
        patches, ids = self._example
        return self.model.init(key, None, ids, features=(patches, None, self.grid))["params"]

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

    def _loss(self, params, patches, ids, mask):
        nll, _, _ = self._scores(params, patches, ids, mask)
        return losses.masked_mean(nll, mask[:, 1:])


def _adamw(lr: float, steps: int, freeze=()):
    return ml_collections.ConfigDict(dict(lr=lr, total_steps=steps, warmup_steps=max(steps // 20, 1), end_factor=0.0,
                                          weight_decay=0.0, b1=0.9, b2=0.98, eps=1e-6, clip_norm=1.0,
                                          freeze=tuple(freeze)))


def pretrain_lm(lm_cfg: dict, ids: np.ndarray, pad_id: int, steps: int, batch_size: int, lr: float,
                seed: int) -> tuple[dict, float]:
    """Stage 0: the LM alone on the training questions' text (``[BOS] question answer [EOS]``, no
    image), next-token loss on every text token; ``(params as numpy, mean loss of the last 20 steps)``."""
    model = lm.LM(**lm_cfg)
    params = jax.jit(model.init)(jax.random.key(seed), jnp.zeros((1, ids.shape[1]), jnp.int32))["params"]
    tx, _ = optim.make_optimizer(_adamw(lr, steps), params)

    def loss_fn(p, batch):
        logits = model.apply({"params": p}, batch[:, :-1])
        return losses.masked_mean(losses.token_nll(logits, batch[:, 1:]), batch[:, 1:] != pad_id)

    step = jax.jit(step_lib.update_step(loss_fn, tx), donate_argnums=(0, 1))
    opt_state, rng, history = tx.init(params), np.random.default_rng(seed), []
    for _ in range(steps):
        params, opt_state, loss = step(params, opt_state, jnp.asarray(ids[rng.integers(len(ids), size=batch_size)]))
        history.append(float(loss))
    return jax.tree.map(np.asarray, params), float(np.mean(history[-20:]))


def _batch(split: dict, index: np.ndarray):
    return (jnp.asarray(split["patches"][split["image"][index]]), jnp.asarray(split["ids"][index]),
            jnp.asarray(split["answer_mask"][index]))


def train_and_eval(run: Run, seed: int, train: dict, val: dict, steps: int, batch_size: int,
                   eval_batch: int = 500, progress=None) -> dict:
    params, opt_state = run.init(seed)
    step, score = run.step, run.score
    rng = np.random.default_rng(seed)
    times, losses = [], []
    if run.stage1_steps:  # connector only; the joint phase then starts with fresh optimizer moments
        stage1_state = run.stage1_tx.init(params)
        for _ in range(run.stage1_steps):
            params, stage1_state, _ = run.stage1_step(params, stage1_state, *_batch(train, rng.integers(
                len(train["ids"]), size=batch_size)))
            if progress is not None:
                progress.update(1)
        opt_state = run.tx.init(params)
    for i in range(steps):
        batch = _batch(train, rng.integers(len(train["ids"]), size=batch_size))
        start = time.perf_counter()
        params, opt_state, loss = step(params, opt_state, *batch)
        loss = float(loss)  # blocks: the step time below is the step's own
        times.append(time.perf_counter() - start)
        losses.append(loss)
        if not math.isfinite(loss):
            raise FloatingPointError(f"loss became {loss} at step {i} ({run.model.connector}, seed {seed}).")
        if progress is not None:
            progress.update(1)
    exact, eval_times = [], []
    for start in range(0, len(val["ids"]), eval_batch):
        index = np.arange(start, min(start + eval_batch, len(val["ids"])))
        pad = eval_batch - len(index)  # one compiled shape: pad the last batch, drop its padding
        batch = _batch(val, np.concatenate([index, np.zeros(pad, index.dtype)]))
        t0 = time.perf_counter()
        hits = np.asarray(score(params, *batch))
        eval_times.append(time.perf_counter() - t0)
        exact.append(hits[: len(index)])
    exact = np.concatenate(exact)
    result = {"accuracy": float(exact.mean()), "final_loss": float(np.mean(losses[-20:]))}
    for k, name in enumerate(KINDS):
        chosen = val["kind"] == k
        result[f"acc_{name}"] = float(exact[chosen].mean()) if chosen.any() else float("nan")
    warm = times[min(5, len(times) - 1):]  # the first steps compile
    result["train_ex_s"] = batch_size / float(np.median(warm))
    warm_eval = eval_times[1:] or eval_times
    result["infer_ex_s"] = eval_batch / float(np.median(warm_eval))
    return result


def _run(c: dict, family: str, tokens: int, lr: float) -> Run:
    return Run(c["tower_cfg"], c["jobs"][(family, tokens)], c["lm_cfg"], c["grid"], c["in_dim"], c["max_len"],
               c["steps"], lr, blind=family == BLIND, stage0=c.get("stage0"), stage1_steps=c.get("stage1_steps", 0))


def job(key, arrays: dict, context: dict, progress) -> dict:
    """``{seed: result}`` on the test questions for one (connector, tokens) setting at its family's
    chosen learning rate: compiled once, trained per seed."""
    (family, tokens), c = key, context
    run = _run(c, family, tokens, c["lrs"][family])
    return {seed: train_and_eval(run, seed, arrays["train"], arrays["test"], c["steps"], c["batch_size"],
                                 progress=progress) for seed in c["seeds"]}


def tune_job(key, arrays: dict, context: dict, progress) -> dict:
    """``{seed: result}`` on the validation questions for one (family, tokens, lr) of the tuning
    grid, at the tuning seed."""
    (family, tokens, lr), c = key, context
    seed = c["tune_seed"]
    return {seed: train_and_eval(_run(c, family, tokens, lr), seed, arrays["train"], arrays["val"], c["steps"],
                                 c["batch_size"], progress=progress)}


def costs(connector_cfg: dict | None, lm_cfg: dict, in_dim: int, grid, tokens: int, seq_text: int) -> dict:
    """Connector parameters and FLOPs (XLA's count) and LM forward FLOPs per example."""
    out = {"connector_params": 0, "connector_mflops": 0.0}
    if connector_cfg is not None:
        c = connectors.cost(connector_cfg, in_dim, lm_cfg["width"], grid)
        out = {"connector_params": c["params"], "connector_mflops": c["flops"] / 1e6}
    out["lm_mflops"] = lm.forward_flops(lm_cfg, 1 + tokens + seq_text) / 1e6
    return out


