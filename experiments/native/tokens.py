"""Square resize, NaFlex and AnyRes at equal LM tokens, on scenes at their own sizes.

    python -m experiments.native --tower results/native/cosine/tower   # results/native/cosine/ (its pinned tower)
    python -m experiments.native --schedule constant --patience 4 --tune_extend 0 --steps 6000 \
        --seeds 0,1,2,3,4,5,6,7,8,9 --out results/native/tokens_6000  # the first protocol (trains it again)
    python -m experiments.native --smoke --out /tmp/nt  # a minute or two; the tests run it
    python -m experiments.native --out results/native/heldout --difficulty easy-heldout --interim  # while it runs

Scenes drawn at random sizes and aspect ratios (``data.packing.SceneSource``: longer side
``--min_side``–``--max_side`` px, aspect up to ``--max_aspect``; a shape's radius is a share of
the shorter side, so a wide image holds small shapes) are encoded once by the frozen CLIP image
tower (``--tower``, else the one pinned in ``OUT/tower``; its sin-cos positions read any grid)
along three paths, each handing the LM at most about ``M`` visual tokens (``--budgets``, each
``4·k²``):

- ``square``: the image resized to a square of ``M`` patches, its aspect ratio lost: ``M`` tokens;
- ``naflex``: resized with its aspect ratio kept to the largest size whose patch grid fits ``M``
  patches (SigLIP 2's NaFlex, ``data.packing.naflex_size``): at most ``M``;
- ``anyres``: LLaVA-NeXT's AnyRes (``models.anyres``) with tiles of ``M/4`` patches and candidate
  resolutions of two or three tiles in a row or a column: a base view of ``M/4`` tokens, then the
  tiles' tokens cut to the image, a newline after each row: at most ``M + 3·√(M/4)`` (a tall
  image), fewer for a near-square one (the base view and a tile's worth: ``M/2 + √(M/4)``).

The paths' caps are equal, their mean counts are not (NaFlex rounds down to its grid, AnyRes
shows a near-square image as one tile's worth), so every path runs at several budgets and the
plot compares them at equal mean tokens.

Every path uses the same connector, ``mlp`` (LLaVA's; it acts on each token alone, so the tower's
features can be laid out in the LM's order before it, newline slots marked: ``anyres.assemble``),
and the token-budget sweep's small LM and recipe (``experiments/common/feature_vlm.py``: stage 0 on the questions'
text once per seed, stage 1 the connector alone, then both with the rate decayed to zero at
``--steps`` (``--schedule cosine``, the token-budget study's protocol; ``constant`` with
``--patience``: until validation accuracy plateaus, the first protocol), each path's learning rate
chosen from ``--tune_lrs`` on validation at the largest budget and the first seed, the grid
continued past an edge that wins (``--tune_extend`` more rates at most; one rate given: no
tuning). In a
batch, an image with fewer tokens is left-padded and masked (``VLM(visual_mask=…)``), so each
example reads exactly its own tokens. ``blind`` (constant visual tokens) is what the questions
alone give away. Accuracy is reported per question kind and on the questions of wide images
(``wide``: longer/shorter side ≥ ``--wide``) and of near-square ones (``squarish``: < 1.5).

Writes to ``--out``: ``cells.jsonl`` and ``tuning.jsonl`` (each finished job as it finishes; a
rerun with the same settings skips it), ``seeds.jsonl`` (each finished seed of a cell, which a
rerun does not train again; a rerun with more ``--seeds`` trains only the new ones), ``runs.csv``
(one row per run), ``native_tokens.md`` (means ± 95% CIs, tests paired by seed),
``native_tokens.png`` and ``setup.json``; ``feature_cache/`` (git-ignored) keeps each view's encoded features, so
that a later sitting on the same tower and data reads them instead of encoding them again. ``--interim``
trains nothing and writes the same files to ``OUT/interim/`` from the seeds finished so far (a sitting may
be running; give its flags again: ``setup.json`` is written when it ends), once the tuning has finished.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.common import feature_vlm as run_lib
from experiments.common import tower as tower_lib
from experiments.native import features as features_lib
from experiments.native.tokens_report import plot, to_markdown, write_report
from experiments.token_budget import tune
from vitmm import checkpoint as ckpt_lib
from vitmm import decode, xla_flags
from vitmm.models import lm, vlm
from vitmm.models.vit import ViT
from vitmm.study import outputs, store

ROOT = pathlib.Path(__file__).resolve().parents[2]

PATHS = features_lib.PATHS
BLIND, KINDS = run_lib.BLIND, run_lib.KINDS
SPATIAL = ("color_at", "shape_at", "relative")
PRESETS = {
    "default": dict(lm=dict(width=64, depth=2, num_heads=2), steps=6000, batch_size=32, eval_every=250, patience=0,
                    min_delta=0.005, curve_questions=2000, stage0_steps=1000, stage1_steps=200, stage0_lr=3e-3,
                    warmup=25, schedule="cosine", tune_lrs="3e-4,1e-3,3e-3", tune_extend=2, budgets="16,36,64",
                    seeds="0,1,2,3,4,5,6,7,8,9",
                    workers=2, train_images=10_000, val_images=1_000, test_images=1_000, difficulty="easy", min_side=32,
                    max_side=160, max_aspect=3.0, wide=2.0, eval_batch=run_lib.EVAL_BATCH),
    "smoke": dict(lm=dict(width=32, depth=1, num_heads=2), steps=16, batch_size=16, eval_every=8, patience=2,
                  min_delta=0.005, curve_questions=64, stage0_steps=40, stage1_steps=4, stage0_lr=3e-3, warmup=2,
                  schedule="constant", tune_lrs="1e-2", tune_extend=0, budgets="16", seeds="0,1", workers=1,
                  train_images=64, val_images=24,
                  test_images=24, difficulty="easy", min_side=16, max_side=64, max_aspect=3.0, wide=2.0, eval_batch=64),
}


# ------------------------------------------------------------------------------------ model
class FeatureVLM(vlm.VLM):
    """The VLM on precomputed tower features already in the LM's order (``features = (patches
    [B, N, C], newline [B, N], grid)``): a per-token connector, then AnyRes's learned newline
    where flagged. Its parameters are ``VLM``'s (tested: equal logits to ``VLM(anyres=…)`` on images)."""

    def visual_tokens(self, images, features=None, layout=None):
        del layout  # the features are laid out already
        patches, newline, grid = features
        tokens = self.project(patches, grid)
        if self.anyres is not None:
            tokens = jnp.where(newline[..., None], self.image_newline.astype(tokens.dtype), tokens)
        return tokens


class NativeTrainer(run_lib.FeatureTrainer):
    """``FeatureTrainer`` (``experiments/common/feature_vlm.py``) on one view's padded features:
    batches are ``(patches, newline, visual_mask, ids, answer_mask)``."""

    def __init__(self, *args, length: int, anyres_cfg: dict | None = None, **kwargs):
        self.length, self.anyres_cfg = length, anyres_cfg
        super().__init__(*args, **kwargs)

    def make_model(self, tower_cfg, connector_cfg, lm_cfg):
        return FeatureVLM(tower_cfg, connector_cfg, lm_cfg, anyres=self.anyres_cfg)

    def example(self, in_dim, max_len):
        n = self.length
        return (jnp.zeros((1, n, in_dim), jnp.float32), jnp.zeros((1, n), bool), jnp.ones((1, n), bool),
                jnp.zeros((1, max_len), jnp.int32))

    def _init(self, key):
        patches, newline, mask, ids = self._example
        return self.model.init(key, None, ids, features=self._features(patches, newline), visual_mask=mask)["params"]

    def _features(self, patches, newline):
        if self.blind:  # constant visual tokens: the image never reaches the LM
            patches = jnp.zeros_like(patches)
        return patches, newline, (1, self.length)

    def _scores(self, params, patches, newline, mask, ids, answer_mask):
        return decode.answer_scores(self.model, {"params": params}, ids, answer_mask,
                                    features=self._features(patches, newline), visual_mask=mask)


def _run(c: dict, path: str, budget: int, lr: float) -> NativeTrainer:
    view = c["views"]["@" + view_name(path, budget)]
    return NativeTrainer(c["tower_cfg"], {"name": "mlp", "budget": "all"}, c["lm_cfg"], (1, view["length"]),
                         c["in_dim"], c["max_len"], c["plan"]["max_steps"], lr, blind=path == BLIND, stage0=c["stage0"],
                         stage1_steps=c["stage1_steps"], warmup=c["warmup"], length=view["length"],
                         anyres_cfg=view["anyres"], schedule=c["plan"].get("schedule", "constant"))


def tune_job(key, arrays, context, progress) -> dict:
    """One (path, budget, lr) of the tuning grid at the first seed, scored on all of validation."""
    path, budget, lr = key
    c, seed = context, context["seeds"][0]
    view = "@" + view_name(path, budget)
    return {seed: run_lib.train_and_eval(_run(c, path, budget, lr), seed, arrays["train"], arrays["val"],
                                         arrays["val"], c["plan"], view, progress=progress,
                                         snapshot=run_lib.snapshot_path(c, "tuning", key, seed), keep_snapshot=True)}


def kept_runs(path: pathlib.Path, signature: str, keys: list, desc: str, seeds: list, context: dict) -> dict:
    """``--interim``'s ``run_cells``: the tuning runs, all of them finished (else it stops, naming
    one to go), or each cell's seeds finished so far (``cells.jsonl`` and ``seeds.jsonl``)."""
    if desc == "tuning":
        found = store.finished(path, signature, keys, seeds)
        missing = [k for k in keys if k not in found]
        if missing:
            raise SystemExit(f"--interim: the tuning has {len(missing)} of its {len(keys)} runs to go (e.g. "
                             f"{missing[0]}), so no cell has trained yet; the finished ones are in {path}.")
        return found
    return {k: {s: r for s, r in context["seeds_done"][k].items() if s in seeds}
            for k in keys if k in context["seeds_done"]}


def forget_snapshots(context, kind: str, results: dict) -> None:
    """Removes the mid-run snapshots of ``results`` (``{key: {seed: result}}``, their rows kept):
    ``kind`` ``"tuning"`` names a tuning point's, whose job leaves it for the sweep's process."""
    for key, by_seed in results.items():
        for seed in by_seed:
            path = run_lib.snapshot_path(context, kind, key, seed)
            if path is not None:
                path.unlink(missing_ok=True)


def cell_job(key, arrays, context, progress) -> dict:
    """``{seed: result on test}`` for one (path, budget) at the path's chosen learning rate."""
    path, budget = key
    c = context
    run, view = _run(c, path, budget, c["chosen"][path]), "@" + view_name(path, budget)

    def snapshot_of(seed):
        return run_lib.snapshot_path(c, key, seed, c["chosen"][path])

    def one(seed):  # the snapshot kept until run_seeds has kept the row
        result = run_lib.train_and_eval(run, seed, arrays["train"], arrays["val"], arrays["test"], c["plan"], view,
                                        progress=progress, snapshot=snapshot_of(seed), keep_snapshot=True)
        return {**result, **run_lib.time_steps(run, arrays["train"], arrays["test"], c["plan"]["batch_size"], view,
                                               eval_batch=c["plan"].get("eval_batch", run_lib.EVAL_BATCH))}

    return run_lib.run_seeds(key, c, progress, one, snapshot_of)


def view_name(path: str, budget: int) -> str:
    return f"square{budget}" if path == BLIND else f"{path}{budget}"


# ------------------------------------------------------------------------------------ main
def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--out", default=str(ROOT / "results/native/cosine"))
    add("--tower", default=None, help="CLIP workdir (default OUT/tower, pinned from workdirs/clip_scenes at first)")
    add("--data_dir", default=None, help="TFDS data_dir for training the tower when it is missing")
    add("--smoke", action="store_true", help="a tiny run of every cell (the tests run it)")
    add("--report", action="store_true", help="train nothing: OUT/native_tokens.md again from runs.csv and setup.json")
    add("--interim", action="store_true", help="train nothing: the tables and plot of the seeds finished so far (a "
        "sitting may be running; give its flags again) in OUT/interim/")
    add("--verbose", action="store_true", help="the libraries' routine warnings and INFO lines too")
    for key, value in PRESETS["default"].items():
        if key != "lm":
            add(f"--{key}", type=type(value) if not isinstance(value, str) else str, default=None,
                help=f"default {value} (smoke: {PRESETS['smoke'][key]})")
    args = parser.parse_args(argv)
    for key, value in PRESETS["smoke" if args.smoke else "default"].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.budgets = sorted(int(b) for b in str(args.budgets).split(","))
    for b in args.budgets:
        features_lib.check_budget(b)
    args.seeds = [int(x) for x in str(args.seeds).split(",")]
    args.tune_lrs = [float(x) for x in str(args.tune_lrs).split(",")]
    return args


def run_settings(args, tower_id: str, lm_cfg: dict, max_len: int) -> tuple[dict, dict]:
    """``(plan, settings)``: each run's training plan, and the settings that sign its stored result:
    a finished run is reused by a sweep with the same settings. The seed list is not one of them
    (tuning runs at the first seed), so a rerun with more seeds trains only the new ones."""
    plan = dict(max_steps=args.steps, batch_size=args.batch_size, eval_every=args.eval_every, patience=args.patience,
                min_delta=args.min_delta, curve_questions=args.curve_questions)
    if args.schedule != "constant":  # a run before the option kept its settings' signature
        plan["schedule"] = args.schedule
    settings = dict(tower=tower_id, lm=lm_cfg, plan=plan, tune_seed=args.seeds[0], stage0=args.stage0_steps,
                    stage0_lr=args.stage0_lr, stage1=args.stage1_steps, warmup=args.warmup, data=[
                        args.difficulty, args.train_images, args.val_images, args.test_images, args.min_side,
                        args.max_side, args.max_aspect], max_len=max_len)
    if args.wide != 2.0:  # every stored run's acc_wide is at this threshold (runs at 2.0 kept their signature)
        settings["wide"] = args.wide
    return plan, settings


def main(argv=None) -> pathlib.Path:
    args = parse_args(argv)
    out = pathlib.Path(args.out)
    if args.report:
        return write_report(out)
    if args.interim and not (args.tower or (out / "tower" / "checkpoints").is_dir()):
        raise SystemExit(f"--interim: {out} has no pinned tower yet (OUT/tower), so no run has finished there; "
                         "check --out.")
    out.mkdir(parents=True, exist_ok=True)
    tower_dir = tower_lib.tower_dir(args.tower, out, args.smoke, args.data_dir)  # OUT/tower once pinned
    tower_cfg = ckpt_lib.load_config(tower_dir)["model"]["image"]
    if tower_cfg.get("posemb", "learn") == "learn":
        tower_cfg = {**tower_cfg, "dynamic_img_size": True}  # the learned table resampled to each grid
    tower, params = ViT(**tower_cfg), ckpt_lib.load_params(tower_dir)["img"]
    tower_id = store.check_tower(out, tower_dir, params)  # what the runs' signatures name: the tower, not its path

    splits, tokenizer, max_len = features_lib.make_splits(args, tower, params, out / "feature_cache", tower_id)
    train, val, test = splits["train"], splits["validation"], splits["test"]
    patch = tower.arch().patch_size[0]
    views = {}
    for budget in args.budgets:
        for path in PATHS:
            settings = features_lib.anyres_settings(budget, patch) if path == "anyres" else None
            views[f"@{path}{budget}"] = {"length": int(train[f"patches@{path}{budget}"].shape[1]), "anyres": settings}
    lm_cfg = dict(vocab_size=tokenizer.vocab_size, **args.lm)
    plan, settings = run_settings(args, tower_id, lm_cfg, max_len)
    context = dict(tower_cfg=tower_cfg, lm_cfg=lm_cfg, in_dim=int(train[f"patches@square{args.budgets[0]}"].shape[-1]),
                   max_len=max_len, plan={**plan, "eval_batch": args.eval_batch}, seeds=args.seeds, stage0={},
                   stage1_steps=args.stage1_steps, warmup=args.warmup, views=views)  # eval_batch: speed, not settings
    arrays = {"train": train, "val": val, "test": test}
    context["snapshots"] = (str(out / "snapshots"), store.signature(settings))  # a killed run resumes mid-way

    def ensure_stage0():
        for seed in args.seeds if args.stage0_steps > 0 and not context["stage0"] else ():
            context["stage0"][seed], loss = run_lib.stage0(context, lm_cfg, train["ids"], tokenizer.pad_id,
                                                           args.stage0_steps, args.batch_size, args.stage0_lr, seed)
            print(f"stage 0, seed {seed}: final loss {loss:.3f}")

    def run_cells(fn, keys, name, desc, seeds):
        if args.interim:  # nothing trained: the tuning must have finished, the cells show the seeds they hold
            return kept_runs(out / name, store.signature(settings), keys, desc, seeds, context)
        return store.run_cells(out / name, store.signature(settings), keys, fn, arrays, context, args.workers, desc,
                               len(seeds) * (args.stage1_steps + args.steps), seeds, before=ensure_stage0)

    top, seed0 = args.budgets[-1], args.seeds[0]
    lrs = {(p, top): list(args.tune_lrs) for p in (*PATHS, BLIND)}
    tuned = {}
    while len(args.tune_lrs) > 1:  # the grid, then one more rate past an edge that wins, until none does
        tuned = run_cells(tune_job, [(p, b, lr) for (p, b), grid in lrs.items() for lr in grid], "tuning.jsonl",
                          "tuning", [seed0])
        if not args.interim:  # (a running sitting's snapshots are its own)
            forget_snapshots(context, "tuning", tuned)  # their rows are in tuning.jsonl now
        extra = tune.extend_grid({(p, b, lr, 0): r for (p, b, lr), r in tuned.items()}, lrs, args.tune_lrs,
                                 args.tune_extend, args.min_delta)
        if not extra:
            break
        print(f"best rate at an edge of the grid: trying { {p: lr for (p, _), lr in extra.items()} }")
        for point, lr in extra.items():
            lrs[point].append(lr)
    # each path's best validation accuracy (ties: the smaller rate)
    context["chosen"] = chosen = {p: max(lrs[(p, top)], key=lambda lr, p=p: (
        tuned[(p, top, lr)][seed0]["accuracy"] if tuned else 0.0, -lr)) for p in (*PATHS, BLIND)}
    settings["chosen"] = chosen
    keys = [(p, b) for b in reversed(args.budgets) for p in PATHS] + [(BLIND, top)]
    signature = store.signature(settings)  # each finished seed of a cell too: a stop loses one seed's run
    context["seed_log"] = (str(out / "seeds.jsonl"), signature)
    context["seeds_done"] = store.seed_results([out / "cells.jsonl", out / "seeds.jsonl"], signature)
    results = run_cells(cell_job, keys, "cells.jsonl", "cells", args.seeds)
    interim = {}  # setup.json's record of what an --interim report's tables hold of the planned runs
    if args.interim:
        interim["interim"] = dict(runs=sum(len(set(v) & set(args.seeds)) for v in results.values()),
                                  of=len(keys) * len(args.seeds),
                                  pending=[f"{p}@{b}" for p, b in keys if not results.get((p, b))])
        out = out / "interim"
        out.mkdir(exist_ok=True)

    rows = []
    seq_text = max_len - 1
    for (path, budget), by_seed in results.items():
        mask = test[f"visual_mask@{view_name(path, budget)}"]
        counts = mask.sum(1) if path != BLIND else np.full(len(mask), mask.shape[1])
        for seed, res in sorted(by_seed.items()):
            res = {k: v for k, v in res.items() if k != "curve"}
            rows.append({"path": path, "budget": budget, "seed": seed, "lr": chosen[path],
                         "tokens_mean": float(counts.mean()), "tokens_max": int(counts.max()),
                         "lm_mflops": lm.forward_flops(lm_cfg, 1 + round(float(counts.mean())) + seq_text) / 1e6,
                         "spatial": float(np.mean([res[f"acc_{k}"] for k in SPATIAL])), **res})
    setup = {**{k: v for k, v in vars(args).items() if k not in ("out", "tower", "data_dir")},
             "tower": str(tower_dir.resolve().relative_to(ROOT) if tower_dir.resolve().is_relative_to(ROOT)
                          else tower_dir), "tower_config": tower_cfg, "lm": lm_cfg, "chosen": chosen,
             "tuning": {f"{p}@{b}|{lr:g}": r[seed0]["accuracy"] for (p, b, lr), r in tuned.items()},
             "test_questions": int(len(test["ids"])), "wide_share": float(test["in_wide"].mean()),
             "views": {k: v["length"] for k, v in views.items()}, **interim}
    command = " ".join(["python", "-m", "experiments.native", *(sys.argv[1:] if argv is None else argv)])
    shown = {**setup, "backend": jax.default_backend(), "date": time.strftime("%Y-%m-%d"), "command": command}
    outputs.write_outputs(out, "native_tokens", setup, to_markdown(rows, shown), {"runs.csv": rows})
    plot(rows, out)
    return out


if __name__ == "__main__":
    xla_flags.use_vitmm_defaults()
    main()
