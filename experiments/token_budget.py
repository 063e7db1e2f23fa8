"""The token-budget experiment: connectors × visual-token budgets × seeds on scenes questions.

    python experiments/token_budget.py                        # the default sweep (see README)
    python experiments/token_budget.py --smoke --out /tmp/tb  # about a minute; the tests run it
    python experiments/token_budget.py --families pool,perceiver --budgets 4,16 --seeds 0,1,2

One frozen CLIP image tower (a ``python -m vitmm.train`` workdir; default
``workdirs/clip_scenes``, which ``make demo`` writes and this script trains first when it is
missing) encodes every image once; all runs of the sweep read those features. Each run trains a
connector and a small Llama-style LM (random init, word tokens) together on (image, question, answer)
triples — LLaVA's stage 2 with the tower frozen; a stage 1 would be meaningless with an untrained
LM — and scores exact-match accuracy per question kind on validation questions. Exact match is
computed teacher-forced in one forward pass, which equals greedy decoding's exact match
(``vitmm.decode.answer_scores``).

Budgets are visual tokens handed to the LM. A family whose knob cannot hit a budget exactly runs
at its nearest reachable count (within a factor ``--max_ratio``) and the tables record the
actual count; a budget it cannot approach is listed as unreachable, with what it can reach. A
``blind`` baseline (the same LM, its visual token carrying no image) measures what the questions
alone give away. The two families with a hidden width of their own (``qformer`` 256,
``c_abstractor`` 256 by default) run at the tower's width instead, so that no connector is wider
than what it reads: at 256 their training step cost 6–11× the others' and would take the sweep past its hour
(``--native_widths`` keeps the defaults).

Writes to ``--out``: ``runs.csv`` (one row per run and seed), ``token_budget.md`` (mean ± std
over seeds per family and budget: accuracy per question kind, parameters, connector and LM
FLOPs per example, training and inference examples/s), ``accuracy_vs_budget.png``,
``accuracy_vs_cost.png`` and ``setup.json`` (tower, data, model and training settings).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import csv
import json
import math
import multiprocessing
import os
import pathlib
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from vitmm import checkpoint as ckpt_lib
from vitmm import decode, losses, xla_flags
from vitmm.data import pipeline, preprocess, scenes
from vitmm.data.tokenizer import ByteTokenizer, WordTokenizer
from vitmm.models import connectors, lm, vlm
from vitmm.models.vit import ViT
from vitmm.train import optim
from vitmm.train import step as step_lib

ROOT = pathlib.Path(__file__).resolve().parents[1]
FAMILIES = ("linear", "mlp", "pool", "pixel_shuffle", "patch_merger", "c_abstractor", "ldp",
            "qwen_resampler", "perceiver", "qformer")
BUDGETS = ("4", "16", "all")
BLIND = "blind"
KINDS = scenes.QUESTION_KINDS

# The LM, training steps and batch (questions), images encoded per split, and seeds of a preset.
PRESETS = {
    "default": dict(lm=dict(width=64, depth=2, num_heads=2), steps=500, batch_size=32, lr=3e-3, workers=2,
                    train_images=10_000, val_images=1_000, seeds="0,1,2", families=",".join(FAMILIES),
                    budgets=",".join(BUDGETS)),
    "smoke": dict(lm=dict(width=32, depth=1, num_heads=2), steps=12, batch_size=16, lr=3e-3, workers=1,
                  train_images=128, val_images=32, seeds="0,1", families="linear,pool,patch_merger",
                  budgets="4,9,all"),
}


# ------------------------------------------------------------------------------------ data
def ensure_tower(workdir: pathlib.Path, smoke: bool, data_dir=None) -> None:
    """Trains the CLIP tower with ``configs/clip_scenes.py`` when ``workdir`` has no checkpoint."""
    if (workdir / "checkpoints").is_dir() and any((workdir / "checkpoints").iterdir()):
        return
    from vitmm.config_args import load
    from vitmm.train import trainer

    arg = "smoke" if smoke else None
    print(f"No CLIP checkpoint in {workdir}: training configs/clip_scenes.py{':' + arg if arg else ''} first.")
    trainer.train(load(ROOT / "configs/clip_scenes.py", arg, **({"input.data_dir": data_dir} if data_dir else {})),
                  workdir)


def encode_split(tower: ViT, params, data: str, split: str, limit: int, image_size: int, tokenizer,
                 max_len: int, data_dir=None, batch_size: int = 250) -> dict:
    """Tower features of the first ``limit`` images of ``split`` and all their questions.

    Returns ``patches [I, N, C]`` (float32), ``grid``, and per question ``image`` (index into
    ``patches``), ``ids``, ``answer_mask``, ``prompt_len``, ``kind``.
    """
    source = pipeline.get_source(data, split, data_dir, keys=("image", "questions", "answers", "question_kinds"))
    decode = preprocess.parse(f"decode|resize({image_size})|value_range(-1, 1)")
    tokens = preprocess.parse(f"qa_tokens({max_len})", tokenizer)
    encode = jax.jit(lambda p, x: tower.apply({"params": p}, x)[1]["patch_tokens"])
    n = min(limit, len(source))
    rng = np.random.default_rng(0)  # the ops used here draw nothing; parse's signature wants one
    patches, qa = [], {k: [] for k in ("image", "ids", "answer_mask", "prompt_len", "kind")}
    for start in range(0, n, batch_size):
        examples = [decode(source[i], rng) for i in range(start, min(n, start + batch_size))]
        images = np.stack([ex["image"] for ex in examples])
        patches.append(np.asarray(encode(params, jnp.asarray(images))))
        for offset, ex in enumerate(examples):
            for q, a, kind in zip(ex["questions"], ex["answers"], ex["question_kinds"], strict=True):
                t = tokens({"question": _text(q), "answer": _text(a)}, rng)
                qa["image"].append(start + offset)
                qa["ids"].append(t["ids"])
                qa["answer_mask"].append(t["answer_mask"])
                qa["prompt_len"].append(t["prompt_len"])
                qa["kind"].append(int(kind))
    grid = tower.grid((image_size, image_size))
    return {"patches": np.concatenate(patches), "grid": tuple(grid),
            **{k: np.asarray(v) for k, v in qa.items()}}


def _text(x) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def make_tokenizer(kind: str, data: str, data_dir=None, sample: int = 2000):
    """The tokenizer and a ``max_len`` that fits BOS + the longest question + answer + EOS in the
    first ``sample`` training images (``words``: the vocabulary of those questions and answers)."""
    source = pipeline.get_source(data, "train", data_dir, keys=("questions", "answers"))
    pairs = [(_text(q), _text(a)) for i in range(min(sample, len(source)))
             for q, a in zip(source[i]["questions"], source[i]["answers"], strict=True)]
    if kind == "words":
        tokenizer = WordTokenizer.from_texts(t for pair in pairs for t in pair)
    elif kind == "bytes":
        tokenizer = ByteTokenizer()
    else:
        raise SystemExit(f"--tokenizer must be 'words' or 'bytes', got {kind!r}.")
    longest = max(len(tokenizer.encode(q + " ")) + len(tokenizer.encode(a)) for q, a in pairs)
    return tokenizer, longest + 2


# ------------------------------------------------------------------------------------ one run
class Run:
    """Connector + LM on precomputed features: the optimizer and the compiled train step and
    scoring are built once per setting and shared by its seeds."""

    def __init__(self, tower_cfg: dict, connector_cfg: dict, lm_cfg: dict, grid, in_dim: int, max_len: int,
                 steps: int, lr: float, blind: bool = False):
        self.model = vlm.VLM(tower_cfg, connector_cfg, lm_cfg)
        self.grid, self.blind = tuple(grid), blind
        self._example = (jnp.zeros((1, grid[0] * grid[1], in_dim), jnp.float32), jnp.zeros((1, max_len), jnp.int32))
        opt_cfg = ml_collections.ConfigDict(dict(
            lr=lr, total_steps=steps, warmup_steps=max(steps // 20, 1), end_factor=0.0, weight_decay=0.0,
            b1=0.9, b2=0.98, eps=1e-6, clip_norm=1.0))
        self.tx, _ = optim.make_optimizer(opt_cfg, jax.eval_shape(self._init, jax.random.key(0)))
        self._init_jit = jax.jit(self._init)
        self.step = jax.jit(step_lib.update_step(self._loss, self.tx), donate_argnums=(0, 1))
        self.score = jax.jit(lambda params, patches, ids, mask: self._scores(params, patches, ids, mask)[2])

    def _init(self, key):
        patches, ids = self._example
        return self.model.init(key, None, ids, features=(patches, None, self.grid))["params"]

    def init(self, seed: int):
        params = self._init_jit(jax.random.key(seed))
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


def _batch(split: dict, index: np.ndarray):
    return (jnp.asarray(split["patches"][split["image"][index]]), jnp.asarray(split["ids"][index]),
            jnp.asarray(split["answer_mask"][index]))


def train_and_eval(run: Run, seed: int, train: dict, val: dict, steps: int, batch_size: int,
                   eval_batch: int = 500, progress=None) -> dict:
    params, opt_state = run.init(seed)
    step, score = run.step, run.score
    rng = np.random.default_rng(seed)
    times, losses = [], []
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


_WORKER: dict = {}  # a worker process's context and data (set by _init_worker)


def _init_worker(context: dict, arrays: str, queue, cores: list[int]) -> None:
    # One core per worker: two single-core runs side by side beat one run on two cores for models
    # this small (measured ~1.5x). XLA sizes its CPU thread pool from the process's affinity when
    # the backend starts (first computation), so pinning here is what makes a worker single-core;
    # XLA flags do not (--xla_cpu_multi_thread_eigen=false still ran two busy pool threads per
    # worker, four on two cores, at half the throughput).
    index = multiprocessing.current_process()._identity[0]  # consecutive numbers for the pool's workers
    os.sched_setaffinity(0, {cores[index % len(cores)]})
    data = np.load(arrays, mmap_mode="r", allow_pickle=False)
    split = lambda name: {k.split("/", 1)[1]: data[k] for k in data.files if k.startswith(name + "/")}  # noqa: E731
    _WORKER.update(context=context, train=split("train"), val=split("val"), queue=queue)


class _QueueProgress:
    def __init__(self, queue, every: int = 25):
        self.queue, self.every, self.pending = queue, every, 0

    def update(self, n: int) -> None:
        self.pending += n
        if self.pending >= self.every:
            self.queue.put(self.pending)
            self.pending = 0

    def flush(self) -> None:
        if self.pending:
            self.queue.put(self.pending)
            self.pending = 0


def run_job(family: str, connector_cfg: dict, context: dict, train: dict, val: dict, progress) -> dict:
    """``{seed: result}`` for one (connector, tokens) setting: compiled once, trained per seed."""
    c = context
    run = Run(c["tower_cfg"], connector_cfg, c["lm_cfg"], c["grid"], c["in_dim"], c["max_len"], c["steps"], c["lr"],
              blind=family == BLIND)
    return {seed: train_and_eval(run, seed, train, val, c["steps"], c["batch_size"], progress=progress)
            for seed in c["seeds"]}


def _worker_job(family: str, connector_cfg: dict) -> dict:
    progress = _QueueProgress(_WORKER["queue"])
    out = run_job(family, connector_cfg, _WORKER["context"], _WORKER["train"], _WORKER["val"], progress)
    progress.flush()
    return out


def run_jobs(jobs: dict, context: dict, train: dict, val: dict, workers: int) -> dict:
    """Runs every job, in this process (``workers=1``) or in a pool of single-threaded worker
    processes that read the features from one memory-mapped file; a progress bar counts steps."""
    from tqdm import tqdm

    total = len(jobs) * len(context["seeds"]) * context["steps"]
    results = {}
    with tqdm(total=total, desc="token budget", unit="step", file=sys.stdout, mininterval=5) as bar:
        if workers <= 1:
            for (family, tokens), cfg in jobs.items():
                results[(family, tokens)] = run_job(family, cfg, context, train, val, bar)
                bar.set_postfix(done=f"{family}@{tokens}")
            return results
        ctx = multiprocessing.get_context("spawn")
        with tempfile.TemporaryDirectory() as tmp, ctx.Manager() as manager:
            arrays = os.path.join(tmp, "features.npz")
            np.savez(arrays, **{f"train/{k}": v for k, v in train.items() if k != "grid"},
                     **{f"val/{k}": v for k, v in val.items() if k != "grid"})
            queue = manager.Queue()
            cores = sorted(os.sched_getaffinity(0))
            with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker,
                                                        initargs=(context, arrays, queue, cores)) as pool:
                # The most expensive settings (most tokens) first, so the pool ends evenly.
                order = sorted(jobs, key=lambda key: -key[1])
                futures = {pool.submit(_worker_job, key[0], jobs[key]): key for key in order}
                pending = set(futures)
                while pending:
                    finished, pending = concurrent.futures.wait(pending, timeout=2)
                    while not queue.empty():
                        bar.update(queue.get())
                    for f in finished:
                        results[futures[f]] = f.result()
                        bar.set_postfix(done=f"{futures[f][0]}@{futures[f][1]}")
    return results


def costs(connector_cfg: dict | None, lm_cfg: dict, in_dim: int, grid, tokens: int, seq_text: int) -> dict:
    """Connector parameters and FLOPs (XLA's count) and LM forward FLOPs per example."""
    out = {"connector_params": 0, "connector_mflops": 0.0}
    if connector_cfg is not None:
        c = connectors.cost(connector_cfg, in_dim, lm_cfg["width"], grid)
        out = {"connector_params": c["params"], "connector_mflops": c["flops"] / 1e6}
    out["lm_mflops"] = lm.forward_flops(lm_cfg, 1 + tokens + seq_text) / 1e6
    return out


# ------------------------------------------------------------------------------------ outputs
def summarise(rows: list[dict]) -> list[dict]:
    """Mean ± std over seeds per (family, requested budget)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["family"], r["budget"]), []).append(r)
    out = []
    for rs in groups.values():
        first = rs[0]
        s = {k: first.get(k) for k in ("family", "budget", "tokens", "note", "connector_params",
                                       "connector_mflops", "lm_mflops")}
        s["seeds"] = sum(r["status"] == "ok" for r in rs)
        ok = [r for r in rs if r["status"] == "ok"]
        for key in ("accuracy", *(f"acc_{k}" for k in KINDS), "train_ex_s", "infer_ex_s"):
            values = np.array([r[key] for r in ok], float)
            s[key] = float(values.mean()) if len(values) else float("nan")
            s[key + "_std"] = float(values.std(ddof=1)) if len(values) > 1 else 0.0
        s["status"] = first["status"]
        out.append(s)
    return out


def _pm(s: dict, key: str) -> str:
    return f"{100 * s[key]:.1f} ± {100 * s[key + '_std']:.1f}"


def _threads(workers: int) -> str:
    return ("one process on all cores" if workers <= 1
            else f"one thread per run, {workers} runs side by side (compare rows with each other, not across "
                 "machines)")


def to_markdown(summary: list[dict], setup: dict) -> str:
    kinds = " | ".join(KINDS)
    lines = [f"Exact-match accuracy on {setup['val_questions']:,} validation questions of `{setup['data']}` "
             f"(mean ± std over {len(setup['seeds'])} seeds; {setup['steps']} steps × {setup['batch_size']} "
             f"questions per run; tower `{setup['tower']}` grid {setup['grid'][0]}×{setup['grid'][1]}, LM "
             f"{setup['lm']}). FLOPs per example (XLA count, forward); LM FLOPs at BOS + visual tokens + "
             f"{setup['max_len'] - 1} text positions ({setup['tokenizer']} tokens). Examples/s: connector + LM on "
             f"precomputed features, median step, {_threads(setup['workers'])}.",
             "",
             f"| connector | budget | tokens | all | {kinds} | params | conn. MFLOP | LM MFLOP | train ex/s | "
             "infer ex/s |",
             "|---|---|---:|---:|" + "---:|" * len(KINDS) + "---:|---:|---:|---:|---:|"]
    for s in summary:
        if s["status"] != "ok":
            lines.append(f"| {s['family']} | {s['budget']} | {s['note']} |" + " |" * (len(KINDS) + 6))
            continue
        tokens = f"{s['tokens']}" + (f" ({s['note']})" if s["note"] else "")
        lines.append(
            f"| {s['family']} | {s['budget']} | {tokens} | {_pm(s, 'accuracy')} | "
            + " | ".join(_pm(s, f"acc_{k}") for k in KINDS)
            + f" | {s['connector_params']:,} | {s['connector_mflops']:.2f} | {s['lm_mflops']:.1f} | "
            f"{s['train_ex_s']:,.0f} | {s['infer_ex_s']:,.0f} |")
    return "\n".join(lines + [""] + spread_lines(summary)) + "\n"


def spread_lines(summary: list[dict]) -> list[str]:
    """Connector vs token count at a glance: at each token count, how far apart the families are
    (MM1 / TokenPacker's question), and per family, what going from its fewest to its most tokens
    gains. Rows at the same actual count are compared whatever budget was requested."""
    ok = [s for s in summary if s["status"] == "ok" and s["family"] != "blind"]
    at: dict[int, dict[str, float]] = {}
    for s in ok:
        at.setdefault(int(s["tokens"]), {})[s["family"]] = 100 * s["accuracy"]
    lines = ["Spread across connectors at equal token counts (points of exact-match accuracy):", "",
             "| tokens | families | best | worst | spread | mean |", "|---:|---:|---|---|---:|---:|"]
    for tokens in sorted(at):
        acc = at[tokens]
        if len(acc) < 2:
            continue
        best, worst = max(acc, key=acc.get), min(acc, key=acc.get)
        lines.append(f"| {tokens} | {len(acc)} | {best} {acc[best]:.1f} | {worst} {acc[worst]:.1f} | "
                     f"{acc[best] - acc[worst]:.1f} | {np.mean(list(acc.values())):.1f} |")
    lines += ["", "Gain from the family's fewest to its most tokens (points):", "",
              "| connector | fewest | most | gain |", "|---|---|---|---:|"]
    for family in dict.fromkeys(s["family"] for s in ok):
        counts = {t: acc[family] for t, acc in at.items() if family in acc}
        if len(counts) > 1:
            lo, hi = min(counts), max(counts)
            gain = counts[hi] - counts[lo]
            lines.append(f"| {family} | {lo}: {counts[lo]:.1f} | {hi}: {counts[hi]:.1f} | {gain:+.1f} |")
    blind = [s for s in summary if s["family"] == "blind" and s["status"] == "ok"]
    if blind:
        lines += ["", f"No image (`blind`, the questions' prior): {100 * blind[0]['accuracy']:.1f}."]
    return lines


def plot(summary: list[dict], out: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [s for s in summary if s["status"] == "ok"]
    blind = next((s for s in ok if s["family"] == BLIND), None)
    families = [f for f in dict.fromkeys(s["family"] for s in ok) if f != BLIND]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for family in families:
        pts = sorted({s["tokens"]: s for s in ok if s["family"] == family}.values(), key=lambda s: s["tokens"])
        ax.errorbar([s["tokens"] for s in pts], [100 * s["accuracy"] for s in pts],
                    yerr=[100 * s["accuracy_std"] for s in pts], marker="o", capsize=3, label=family)
    ax.set_xscale("log", base=2)
    _finish(plt, fig, ax, blind, "visual tokens handed to the LM", "Accuracy vs. token budget (mean ± std over seeds)",
            out / "accuracy_vs_budget.png")

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for family in families:
        pts = [s for s in ok if s["family"] == family]
        ax.scatter([s["connector_mflops"] + s["lm_mflops"] for s in pts], [100 * s["accuracy"] for s in pts],
                   label=family)
        for s in pts:
            ax.annotate(str(s["tokens"]), (s["connector_mflops"] + s["lm_mflops"], 100 * s["accuracy"]),
                        fontsize=6, xytext=(3, 3), textcoords="offset points")
    ax.set_xscale("log")
    _finish(plt, fig, ax, blind, "connector + LM forward MFLOP per example (labels: visual tokens)",
            "Accuracy vs. cost", out / "accuracy_vs_cost.png")


def _finish(plt, fig, ax, blind, xlabel: str, title: str, path: pathlib.Path) -> None:
    if blind:
        ax.axhline(100 * blind["accuracy"], color="grey", linestyle="--", label="blind (no image)")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("exact-match accuracy (%)")
    ax.set_title(title)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_csv(rows: list[dict], path: pathlib.Path) -> None:
    columns = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


# ------------------------------------------------------------------------------------ sweep
def main(argv=None) -> pathlib.Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/token_budget", help="output folder")
    parser.add_argument("--tower", default=None, help="CLIP workdir (default workdirs/clip_scenes; "
                        "smoke: OUT/tower); trained first when it holds no checkpoint")
    parser.add_argument("--data", default=None, help="scenes config (default: the tower's training data)")
    parser.add_argument("--data_dir", default=None, help="TFDS data_dir (default ~/tensorflow_datasets)")
    parser.add_argument("--families", default=None, help="comma-separated connector names (default: all)")
    parser.add_argument("--budgets", default=None, help="visual tokens, or 'all' (default: 4,16,all)")
    parser.add_argument("--seeds", default=None, help="comma-separated seeds (default: the preset's)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--batch_size", type=int, default=None)
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--lm_width", type=int, default=None)
    parser.add_argument("--lm_depth", type=int, default=None)
    parser.add_argument("--tokenizer", default="words", help="words (the questions' vocabulary) or bytes")
    parser.add_argument("--train_images", type=int, default=None)
    parser.add_argument("--val_images", type=int, default=None)
    parser.add_argument("--max_ratio", type=float, default=2.0,
                        help="run at the nearest reachable count when within this factor of the budget")
    parser.add_argument("--workers", type=int, default=None,
                        help="single-threaded worker processes (default: the preset's; 1 = in this process)")
    parser.add_argument("--no_blind", action="store_true", help="skip the no-image baseline")
    parser.add_argument("--native_widths", action="store_true",
                        help="qformer / c_abstractor at their own hidden widths (256), not the tower's")
    parser.add_argument("--smoke", action="store_true", help="a tiny sweep that runs in about a minute")
    args = parser.parse_args(argv)
    preset = PRESETS["smoke" if args.smoke else "default"]
    steps = args.steps or preset["steps"]
    batch_size = args.batch_size or preset["batch_size"]
    lr = args.lr or preset["lr"]
    lm_preset = dict(preset["lm"], **({"width": args.lm_width} if args.lm_width else {}),
                     **({"depth": args.lm_depth} if args.lm_depth else {}))
    seeds = [int(s) for s in (args.seeds or preset["seeds"]).split(",")]
    families = [f for f in (args.families or preset["families"]).split(",") if f]
    unknown = [f for f in families if f not in connectors.REGISTRY]
    if unknown:
        raise SystemExit(f"Unknown connector(s) {unknown}; choose from {sorted(connectors.REGISTRY)}.")
    budgets = [b if b == "all" else int(b) for b in (args.budgets or preset["budgets"]).split(",") if b]
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    tower_dir = pathlib.Path(args.tower or (out / "tower" if args.smoke else ROOT / "workdirs/clip_scenes"))
    ensure_tower(tower_dir, args.smoke, args.data_dir)
    clip_config = ckpt_lib.load_config(tower_dir)
    tower_cfg = clip_config["model"]["image"]
    image_size = clip_config["input"]["image_size"]
    data = args.data or clip_config["input"].get("data", {}).get("name")
    if data is None:  # e.g. a tower converted with python -m vitmm.interop
        raise SystemExit(f"{tower_dir} does not say what data it was trained on; pass --data (e.g. scenes/easy_224).")
    tower = ViT(**tower_cfg)
    tower_params = ckpt_lib.load_params(tower_dir)["img"]

    t0 = time.perf_counter()
    tokenizer, max_len = make_tokenizer(args.tokenizer, data, args.data_dir)
    train = encode_split(tower, tower_params, data, "train", args.train_images or preset["train_images"],
                         image_size, tokenizer, max_len, args.data_dir)
    val = encode_split(tower, tower_params, data, "validation", args.val_images or preset["val_images"],
                       image_size, tokenizer, max_len, args.data_dir)
    grid, in_dim = train["grid"], train["patches"].shape[-1]
    print(f"tower features: {len(train['patches'])} train / {len(val['patches'])} validation images, grid "
          f"{grid}, {in_dim} channels; {len(train['ids'])} / {len(val['ids'])} questions "
          f"({time.perf_counter() - t0:.0f} s)")

    lm_cfg = dict(vocab_size=tokenizer.vocab_size, **lm_preset)
    plan = []  # (family, requested budget, setting, tokens, note)
    if not args.no_blind:
        plan.append((BLIND, 0, 1, 1, "no image"))
    for family in families:
        for b in budgets:
            setting, tokens, note = connectors.resolve(family, b, grid, args.max_ratio)
            plan.append((family, b, setting, tokens, note))
    runnable = {(f, t) for f, _, s, t, _ in plan if s is not None}
    print(f"{len(runnable)} distinct (connector, tokens) settings × {len(seeds)} seeds × {steps} steps; "
          f"unreachable: {[(f, b) for f, b, s, _, _ in plan if s is None]}")

    jobs = {}  # (family, tokens) -> connector config; two budgets at one reachable count share a job
    widths = {} if args.native_widths else {"qformer": {"width": in_dim}, "c_abstractor": {"hidden": in_dim}}
    for family, _, setting, tokens, _ in plan:
        if setting is not None:
            jobs.setdefault((family, tokens), {"name": "pool" if family == BLIND else family, "budget": setting,
                                               **widths.get(family, {})})
    context = dict(tower_cfg=tower_cfg, lm_cfg=lm_cfg, grid=grid, in_dim=in_dim, max_len=max_len, steps=steps,
                   lr=lr, batch_size=batch_size, seeds=seeds)
    results = run_jobs(jobs, context, train, val, args.workers or preset["workers"])

    rows = []
    for family, requested, setting, tokens, note in plan:
        base = {"family": family, "budget": requested, "tokens": tokens, "note": note}
        if setting is None:
            rows.append({**base, "seed": "", "status": "unreachable"})
            continue
        connector_cfg = jobs[(family, tokens)]
        cost = costs(None if family == BLIND else connector_cfg, lm_cfg, in_dim, grid, tokens, max_len - 1)
        for seed in seeds:
            rows.append({**base, "seed": seed, "status": "ok", **cost, **results[(family, tokens)][seed]})

    shown = tower_dir.resolve()
    shown = shown.relative_to(ROOT) if shown.is_relative_to(ROOT) else shown  # no machine paths in results
    setup = {"tower": str(shown), "tower_config": tower_cfg, "data": data, "image_size": image_size,
             "grid": list(grid), "lm": lm_preset, "steps": steps, "batch_size": batch_size, "lr": lr,
             "seeds": seeds, "connector_widths": widths, "tokenizer": args.tokenizer,
             "vocab_size": tokenizer.vocab_size, "max_len": max_len,
             "train_images": len(train["patches"]),
             "train_questions": len(train["ids"]), "val_questions": len(val["ids"]),
             "workers": args.workers or preset["workers"], "backend": jax.default_backend(),
             "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv)}
    summary = summarise(rows)
    write_csv(rows, out / "runs.csv")
    (out / "token_budget.md").write_text(to_markdown(summary, setup))
    (out / "setup.json").write_text(json.dumps(setup, indent=1, default=str) + "\n")
    plot(summary, out)
    print((out / "token_budget.md").read_text())
    print(f"wrote {out}/runs.csv, token_budget.md, accuracy_vs_budget.png, accuracy_vs_cost.png, setup.json")
    return out


if __name__ == "__main__":
    xla_flags.use_vitmm_defaults()  # before JAX opens a backend
    main()
