"""The token-budget experiment: connectors × visual-token budgets × seeds on scenes questions.

    python experiments/token_budget.py                        # the default sweep (results/token_budget/)
    python experiments/token_budget.py --smoke --out /tmp/tb  # about a minute; the tests run it
    python experiments/token_budget.py --families pool,perceiver --budgets 4,16 --seeds 0,1,2

One frozen CLIP image tower (a ``python -m vitmm.train`` workdir; default
``workdirs/clip_scenes``, which ``make demo`` writes and this script trains first when it is
missing) encodes every image once; all runs of the sweep read those features. Stage 0 trains
the small Llama-style LM (word tokens) on the training questions' text alone, once per seed
(``--stage0_steps``), so that connector training starts from an LM that answers in the right
format. Each run then trains its connector alone for ``--stage1_steps`` (the LM frozen: LLaVA's
stage 1, so a fresh connector's tokens do not disturb the trained LM), and then the connector and
the LM together on (image, question, answer) triples — LLaVA's stage 2 with the tower frozen —
and scores exact-match accuracy per question
kind on the test questions. Each family's learning rate is chosen first: the best of
``--tune_lrs`` by validation accuracy at ``--tune_budget`` tokens and the first seed
(``tuning.jsonl``; ``--lr`` skips tuning). Exact match is computed teacher-forced in one forward
pass, which equals greedy decoding's exact match
(``vitmm.decode.answer_scores``).

Budgets are visual tokens handed to the LM. A family whose knob cannot hit a budget exactly runs
at its nearest reachable count (within a factor ``--max_ratio``) and the tables record the
actual count; a budget it cannot approach is listed as unreachable, with what it can reach. A
``blind`` baseline (the same stage-0 LM, fine-tuned with a visual token carrying no image) measures what the questions
alone give away. The two families with a hidden width of their own (``qformer`` 256,
``c_abstractor`` 256 by default) run at the tower's width instead, so that no connector is wider
than what it reads: at 256 their training step cost 6–11× the others' and would take the sweep past its hour
(``--native_widths`` keeps the defaults).

Writes to ``--out``: ``cells.jsonl`` (each finished (connector, tokens) cell with all its seeds,
as it finishes: a rerun with the same settings skips those cells, so a sweep can span several
sittings), ``runs.csv`` (one row per run and seed), ``token_budget.md`` (mean ± 95% CI
over seeds per family and budget: accuracy per question kind, parameters, connector and LM
FLOPs per example, training and inference examples/s), ``accuracy_vs_budget.png``,
``accuracy_vs_cost.png`` and ``setup.json`` (tower, data, model and training settings).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import pathlib
import sys
import time

import jax
import numpy as np

from vitmm import checkpoint as ckpt_lib
from vitmm import xla_flags
from vitmm.models import connectors
from vitmm.models.vit import ViT

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))  # the sibling modules below, also when loaded by path
import qa_features  # noqa: E402
import token_budget_report as report  # noqa: E402
import token_budget_run as run_lib  # noqa: E402
import workers  # noqa: E402

FAMILIES = ("linear", "mlp", "pool", "pixel_shuffle", "patch_merger", "c_abstractor", "ldp",
            "qwen_resampler", "perceiver", "qformer")
BUDGETS = ("4", "16", "all")
BLIND, KINDS = report.BLIND, report.KINDS

# The LM, training steps and batch (questions), images encoded per split, and seeds of a preset.
PRESETS = {
    "default": dict(lm=dict(width=64, depth=2, num_heads=2), steps=500, batch_size=32, lr=3e-3, workers=2,
                    stage0_steps=1000, stage1_steps=200, tune_lrs="1e-3,3e-3,1e-2", tune_budget=16,
                    train_images=10_000, val_images=1_000, seeds="0,1,2,3,4", families=",".join(FAMILIES),
                    budgets=",".join(BUDGETS)),
    "smoke": dict(lm=dict(width=32, depth=1, num_heads=2), steps=12, batch_size=16, lr=3e-3, workers=1,
                  stage0_steps=100, stage1_steps=6, tune_lrs="3e-3,1e-2", tune_budget=4,
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


def choose_lrs(tuned: dict) -> dict:
    """``{family: lr}`` with the best validation accuracy in the tuning grid (ties: the smaller lr)."""
    best = {}
    for (family, _, lr), results in tuned.items():
        acc = np.mean([r["accuracy"] for r in results.values()])
        if family not in best or (acc, -lr) > (best[family][1], -best[family][0]):
            best[family] = (lr, acc)
    return {family: lr for family, (lr, _) in best.items()}


# ------------------------------------------------------------------------------------ resume
def load_cells(path: pathlib.Path, signature: str) -> dict:
    """Finished cells ``{key: {seed: result}}`` (key: a tuple, e.g. ``(family, tokens)``) of a
    sweep with these settings."""
    cells = {}
    for line in path.read_text().splitlines() if path.is_file() else ():
        cell = json.loads(line)
        if cell["signature"] == signature:
            cells[tuple(cell["key"])] = {int(k): v for k, v in cell["results"].items()}
    return cells


def save_cell(path: pathlib.Path, signature: str, key, results: dict) -> None:
    """Appends one finished cell (all its seeds) as a line of a ``.jsonl`` file."""
    line = json.dumps({"signature": signature, "key": list(key), "results": {str(k): v for k, v in results.items()}})
    with path.open("a") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


def _signature(settings: dict) -> str:
    return hashlib.sha1(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]


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
    parser.add_argument("--lr", type=float, default=None,
                        help="one learning rate for every family (no tuning); default: each family's best of "
                             "--tune_lrs on the validation split")
    parser.add_argument("--tune_lrs", default=None, help="the learning-rate grid (default: the preset's)")
    parser.add_argument("--tune_budget", type=int, default=None,
                        help="visual tokens at which each family is tuned (its nearest reachable count)")
    parser.add_argument("--test_images", type=int, default=None, help="test-split images (default: as validation)")
    parser.add_argument("--lm_width", type=int, default=None)
    parser.add_argument("--lm_depth", type=int, default=None)
    parser.add_argument("--tokenizer", default="words", help="words (the questions' vocabulary) or bytes")
    parser.add_argument("--train_images", type=int, default=None)
    parser.add_argument("--val_images", type=int, default=None)
    parser.add_argument("--max_ratio", type=float, default=2.0,
                        help="run at the nearest reachable count when within this factor of the budget")
    parser.add_argument("--workers", type=int, default=None,
                        help="single-threaded worker processes (default: the preset's; 1 = in this process)")
    parser.add_argument("--stage0_steps", type=int, default=None,
                        help="stage 0: LM steps on the questions' text alone before connector training, per seed "
                             "(default: the preset's; 0: the LM starts random)")
    parser.add_argument("--stage1_steps", type=int, default=None,
                        help="stage 1: connector-only steps (LM frozen) before the joint steps, per run "
                             "(default: the preset's; 0: joint from the start)")
    parser.add_argument("--no_blind", action="store_true", help="skip the no-image baseline")
    parser.add_argument("--native_widths", action="store_true",
                        help="qformer / c_abstractor at their own hidden widths (256), not the tower's")
    parser.add_argument("--smoke", action="store_true", help="a tiny sweep that runs in about a minute")
    args = parser.parse_args(argv)
    preset = PRESETS["smoke" if args.smoke else "default"]
    steps = args.steps or preset["steps"]
    batch_size = args.batch_size or preset["batch_size"]
    lr = args.lr or preset["lr"]  # stage 0's, and every family's when --lr is given
    lm_preset = dict(preset["lm"], **({"width": args.lm_width} if args.lm_width else {}),
                     **({"depth": args.lm_depth} if args.lm_depth else {}))
    seeds = [int(s) for s in (args.seeds or preset["seeds"]).split(",")]
    families = [f for f in (args.families or preset["families"]).split(",") if f]
    unknown = [f for f in families if f not in connectors.REGISTRY]
    if unknown:
        parser.error(f"unknown connector(s) {unknown}; choose from {sorted(connectors.REGISTRY)}.")
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
        parser.error(f"{tower_dir} does not say what data it was trained on; pass --data (e.g. scenes/easy_224).")
    tower = ViT(**tower_cfg)
    tower_params = ckpt_lib.load_params(tower_dir)["img"]

    t0 = time.perf_counter()
    tokenizer, max_len = qa_features.make_tokenizer(args.tokenizer, data, args.data_dir)
    train = qa_features.encode_split(tower, tower_params, data, "train", args.train_images or preset["train_images"],
                         image_size, tokenizer, max_len, args.data_dir)
    val = qa_features.encode_split(tower, tower_params, data, "validation", args.val_images or preset["val_images"],
                       image_size, tokenizer, max_len, args.data_dir)
    test = qa_features.encode_split(tower, tower_params, data, "test",
                                    args.test_images or args.val_images or preset["val_images"], image_size,
                                    tokenizer, max_len, args.data_dir)
    grid, in_dim = train["grid"], train["patches"].shape[-1]
    print(f"tower features: {len(train['patches'])} train / {len(val['patches'])} validation / {len(test['patches'])} "
          f"test images, grid {grid}, {in_dim} channels; {len(train['ids'])} / {len(val['ids'])} / {len(test['ids'])} "
          f"questions ({time.perf_counter() - t0:.0f} s)")

    lm_cfg = dict(vocab_size=tokenizer.vocab_size, **lm_preset)
    stage0_steps = preset["stage0_steps"] if args.stage0_steps is None else args.stage0_steps
    stage1_steps = preset["stage1_steps"] if args.stage1_steps is None else args.stage1_steps
    plan = []  # (family, requested budget, setting, tokens, note)
    if not args.no_blind:
        plan.append((BLIND, 0, 1, 1, "no image"))
    for family in families:
        for b in budgets:
            setting, tokens, note = connectors.resolve(family, b, grid, args.max_ratio)
            plan.append((family, b, setting, tokens, note))
    jobs = {}  # (family, tokens) -> connector config; two budgets at one reachable count share a job
    widths = {} if args.native_widths else {"qformer": {"width": in_dim}, "c_abstractor": {"hidden": in_dim}}
    for family, _, setting, tokens, _ in plan:
        if setting is not None:
            jobs.setdefault((family, tokens), {"name": "pool" if family == BLIND else family, "budget": setting,
                                               **widths.get(family, {})})
    print(f"{len(jobs)} distinct (connector, tokens) settings × {len(seeds)} seeds × {steps} steps; "
          f"unreachable: {[(f, b) for f, b, s, _, _ in plan if s is None]}")
    # A finished cell is reused only by a sweep with the same settings (everything but the cells).
    settings = dict(tower=str(tower_dir.resolve()), data=data, lm=lm_cfg, steps=steps, batch_size=batch_size,
                    stage0_lr=lr, seeds=seeds, stage0_steps=stage0_steps, stage1_steps=stage1_steps,
                    train=len(train["ids"]), val=len(val["ids"]), test=len(test["ids"]), max_len=max_len,
                    tokenizer=args.tokenizer, widths=widths)
    context = dict(tower_cfg=tower_cfg, lm_cfg=lm_cfg, grid=grid, in_dim=in_dim, max_len=max_len, steps=steps,
                   batch_size=batch_size, seeds=seeds, stage0={}, stage1_steps=stage1_steps, jobs=jobs,
                   tune_seed=seeds[0])
    arrays = {name: {k: v for k, v in split.items() if k != "grid"}
              for name, split in (("train", train), ("val", val), ("test", test))}
    n_workers = args.workers or preset["workers"]
    stage0_loss = {}

    def ensure_stage0():  # trained the first time some run needs it
        for seed in seeds if stage0_steps > 0 and not context["stage0"] else ():
            t0 = time.perf_counter()
            context["stage0"][seed], stage0_loss[seed] = run_lib.pretrain_lm(lm_cfg, train["ids"], tokenizer.pad_id,
                                                                     stage0_steps, batch_size, lr, seed)
            print(f"stage 0, seed {seed}: {stage0_steps} LM steps on the questions' text, final loss "
                  f"{stage0_loss[seed]:.3f} ({time.perf_counter() - t0:.0f} s)")

    # Tuning: each family's learning rate, chosen on the validation split at one budget and one seed.
    tune_lrs = [lr] if args.lr else [float(x) for x in (args.tune_lrs or preset["tune_lrs"]).split(",")]
    tune_budget = args.tune_budget or preset["tune_budget"]
    tune_keys = []
    for family in dict.fromkeys(f for f, _ in jobs):
        tokens = min((t for f, t in jobs if f == family), key=lambda t: (abs(math.log(t / tune_budget)), t))
        tune_keys += [(family, tokens, x) for x in tune_lrs] if len(tune_lrs) > 1 else []
    tune_path, tune_sig = out / "tuning.jsonl", _signature({**settings, "tune_seed": seeds[0]})
    tuned = {k: v for k, v in load_cells(tune_path, tune_sig).items() if k in set(tune_keys)}
    tune_todo = [k for k in tune_keys if k not in tuned]
    if tune_todo:
        ensure_stage0()
        tuned.update(workers.run(run_lib.tune_job, sorted(tune_todo, key=lambda k: -k[1]), arrays, context, n_workers,
                                 total=len(tune_todo) * (stage1_steps + steps), desc="tuning",
                                 on_result=lambda key, res: save_cell(tune_path, tune_sig, key, res)))
    lrs = choose_lrs(tuned) if tune_keys else {f: lr for f, _ in jobs}
    context["lrs"] = lrs
    print(f"learning rates (validation, seed {seeds[0]}, {len(tune_keys)} tuning runs): {lrs}")

    cells_path, signature = out / "cells.jsonl", _signature({**settings, "lrs": lrs})
    results = {k: v for k, v in load_cells(cells_path, signature).items() if k in jobs}
    todo = [k for k in jobs if k not in results]
    if results:
        print(f"{len(results)} cells already done in {cells_path} (settings {signature}), skipped; {len(todo)} to run")
    if todo:
        ensure_stage0()
    order = sorted(todo, key=lambda key: -key[1])  # the most tokens (the slowest) first
    results.update(workers.run(run_lib.job, order, arrays, context, n_workers,
                               total=len(todo) * len(seeds) * (stage1_steps + steps), desc="token budget",
                               on_result=lambda key, res: save_cell(cells_path, signature, key, res)))

    rows = []
    for family, requested, setting, tokens, note in plan:
        base = {"family": family, "budget": requested, "tokens": tokens, "note": note}
        if setting is None:
            rows.append({**base, "seed": "", "status": "unreachable"})
            continue
        connector_cfg = jobs[(family, tokens)]
        cost = run_lib.costs(None if family == BLIND else connector_cfg, lm_cfg, in_dim, grid, tokens, max_len - 1)
        for seed in seeds:
            rows.append({**base, "seed": seed, "status": "ok", "lr": lrs[family], **cost,
                         **results[(family, tokens)][seed]})

    shown = tower_dir.resolve()
    shown = shown.relative_to(ROOT) if shown.is_relative_to(ROOT) else shown  # no machine paths in results
    if not stage0_loss and (out / "setup.json").is_file():  # every cell was reused: so is stage 0's record
        stage0_loss = json.loads((out / "setup.json").read_text()).get("stage0_final_loss", {})
    tuning = {}  # {"family@tokens": {lr: validation accuracy}}
    for (family, tokens, x), res in sorted(tuned.items()):
        tuning.setdefault(f"{family}@{tokens}", {})[str(x)] = res[seeds[0]]["accuracy"]
    setup = {"tower": str(shown), "tower_config": tower_cfg, "data": data, "image_size": image_size,
             "grid": list(grid), "lm": lm_preset, "steps": steps, "batch_size": batch_size, "stage0_lr": lr,
             "tune_lrs": tune_lrs, "tune_budget": tune_budget, "tune_seed": seeds[0], "chosen_lr": lrs,
             "tuning": tuning,
             "stage0_steps": stage0_steps, "stage0_final_loss": stage0_loss, "stage1_steps": stage1_steps,
             "seeds": seeds, "connector_widths": widths, "tokenizer": args.tokenizer,
             "vocab_size": tokenizer.vocab_size, "max_len": max_len,
             "train_images": len(train["patches"]),
             "train_questions": len(train["ids"]), "val_questions": len(val["ids"]),
             "test_questions": len(test["ids"]),
             "workers": args.workers or preset["workers"], "backend": jax.default_backend(),
             "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv)}
    summary = report.summarise(rows)
    report.write_csv(rows, out / "runs.csv")
    (out / "token_budget.md").write_text(report.to_markdown(summary, setup))
    (out / "setup.json").write_text(json.dumps(setup, indent=1, default=str) + "\n")
    report.plot(summary, out)
    print((out / "token_budget.md").read_text())
    print(f"wrote {out}/runs.csv, token_budget.md, accuracy_vs_budget.png, accuracy_vs_cost.png, setup.json")
    return out


if __name__ == "__main__":
    xla_flags.use_vitmm_defaults()  # before JAX opens a backend
    main()
