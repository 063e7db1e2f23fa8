"""The token-budget sweep's options: its presets (the default sweep and the smoke one the tests run)
and the command line, read into one namespace with every unset option at its preset's value."""

from __future__ import annotations

import argparse
import json
import pathlib
import shlex
import sys

from experiments.common.feature_vlm import BLIND, EVAL_BATCH
from vitmm.models import connectors

FAMILIES = ("linear", "mlp", "pool", "pixel_shuffle", "patch_merger", "c_abstractor", "ldp",
            "qwen_resampler", "perceiver", "qformer")
BUDGETS = ("4", "16", "all")

# The LM, the training plan (joint steps, batch of questions, validation every eval_every steps,
# the rate's schedule; with patience > 0, stop after `patience` evaluations without a min_delta
# gain but not before min_steps), images per split, the tuning grid and seeds of a preset.
PRESETS = {
    "default": dict(lm=dict(width=64, depth=2, num_heads=2), steps=8000, batch_size=32, stage0_lr=3e-3, workers=2,
                    eval_every=250, patience=0, min_delta=0.005, min_steps=0, curve_questions=2000,
                    schedule="cosine", stage0_steps=1000, stage1_steps=200, tune_lrs="1e-4,3e-4,1e-3,3e-3",
                    tune_warmups="25,250", tune_extend=2, tune_budget=16, train_images=10_000, val_images=1_000,
                    seeds="0,1,2,3,4", families=",".join(FAMILIES), budgets=",".join(BUDGETS),
                    param_budget=100_000, param_tokens=16, encoder_budgets="16,4", eval_batch=EVAL_BATCH),
    "smoke": dict(lm=dict(width=32, depth=1, num_heads=2), steps=24, batch_size=16, stage0_lr=3e-3, workers=1,
                  eval_every=8, patience=0, min_delta=0.005, min_steps=0, curve_questions=64,
                  schedule="cosine", stage0_steps=100, stage1_steps=6, tune_lrs="1e-2", tune_warmups="2,8",
                  tune_extend=0, tune_budget=4, train_images=128, val_images=32, seeds="0,1",
                  families="mlp,pool,patch_merger", budgets="4,9,all", param_budget=20_000, param_tokens=4,
                  encoder_budgets="4", eval_batch=64),
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="The token-budget experiment: connectors × visual-token "
                                     "budgets × seeds on scenes questions (experiments/token_budget/sweep.py). "
                                     "With --config FILE instead: the budget study on any VLM config "
                                     "(experiments/token_budget/study.py; its options: --config FILE --help).")
    add = parser.add_argument
    add("--out", default="results/token_budget", help="output folder")
    add("--tower", default=None, help="CLIP workdir (default OUT/tower: workdirs/clip_scenes's image tower, "
        "trained first when missing, copied there the first time); trained first when it holds no final checkpoint")
    add("--data", default=None, help="scenes config (default: the tower's training data)")
    add("--data_dir", default=None, help="TFDS data_dir (default ~/tensorflow_datasets)")
    add("--families", default=None, help="comma-separated connector names (default: all)")
    add("--budgets", default=None, help="visual tokens, or 'all' (default: 4,16,all)")
    add("--seeds", default=None, help="comma-separated seeds (default: the preset's)")
    add("--steps", type=int, default=None, help="joint steps (with --patience, at most)")
    add("--batch_size", type=int, default=None)
    add("--eval_every", type=int, default=None, help="joint steps between validation evaluations")
    add("--patience", type=int, default=None, help="evaluations without a --min_delta gain before a run stops (0: "
        "never; a run trains --steps)")
    add("--schedule", default=None, choices=("constant", "cosine"), help="the joint phase's learning rate after the "
        "warmup: constant (runs end by early stopping) or a cosine decay to zero at --steps")
    add("--min_delta", type=float, default=None, help="the validation gain that counts as progress")
    add("--min_steps", type=int, default=None, help="joint steps before a run may stop early (with "
        "--patience; runs can sit on an early plateau until step ~5,000)")
    add("--curve_questions", type=int, default=None, help="validation questions scored at each evaluation")
    add("--eval_batch", type=int, default=None, help="questions per scoring call, the last one padded (speed only: "
        "the smoke preset's splits hold a few hundred)")
    add("--lr", type=float, default=None, help="one learning rate for every family's connector and joint phases (no "
        "tuning; stage 0 keeps --stage0_lr); default: each family's best of --tune_lrs on the validation split")
    add("--chosen", default=None, help="each family's lr/warmup, no tuning: e.g. 'pool=3e-4/25,blind=1e-3/25' (a "
        "finished sweep's choice, from its setup.json; every family run, blind included, must be named)")
    add("--tune_lrs", default=None, help="the learning-rate grid (default: the preset's)")
    add("--tune_extend", type=int, default=None, help="a family whose best rate is at an edge of the grid tries up "
        "to this many more rates past it, one at a time (the 1-3-10 ladder), while the edge wins by --min_delta")
    add("--tune_warmups", default=None, help="warmup steps tried at each family's best lr (the first: during the "
        "lr grid)")
    add("--tune_budget", type=int, default=None, help="visual tokens at which each family is tuned (its nearest "
        "reachable count)")
    add("--tune_each_budget", action="store_true", help="tune every family at every budget of the grid on its own "
        "(default: once, at --tune_budget, the rate used at every budget)")
    add("--tune_seeds", type=int, default=1, help="the first this many of --seeds train each tuning point, the rate "
        "chosen on their mean")
    add("--param_budget", type=int, default=None, help="the equal-parameter comparison: every family with a size "
        "knob sized to this many connector parameters (0: skip)")
    add("--param_tokens", type=int, default=None, help="the token budget of the equal-parameter comparison")
    add("--encoder_budgets", default=None, help="token counts reached on the encoder side (smaller image, larger "
        "patch) against connector compression ('' skips)")
    add("--test_images", type=int, default=None, help="test-split images (default: as validation)")
    add("--lm_width", type=int, default=None)
    add("--lm_depth", type=int, default=None)
    add("--tokenizer", default="words", help="words (the questions' vocabulary) or bytes")
    add("--train_images", type=int, default=None)
    add("--val_images", type=int, default=None)
    add("--max_ratio", type=float, default=2.0, help="run at the nearest reachable count when within this factor of "
        "the budget")
    add("--workers", type=int, default=None, help="single-threaded worker processes (default: the preset's; 1 = in "
        "this process)")
    add("--stage0_steps", type=int, default=None, help="stage 0: LM steps on the questions' text alone before "
        "connector training, per seed (default: the preset's; 0: the LM starts random)")
    add("--stage0_lr", type=float, default=None, help="stage 0's learning rate (default: the preset's, 3e-3), "
        "apart from --lr so that a sweep without tuning starts every run from the same LM as a tuned one")
    add("--stage1_steps", type=int, default=None, help="stage 1: connector-only steps (LM frozen) before the joint "
        "steps, per run (default: the preset's; 0: joint from the start)")
    add("--no_blind", action="store_true", help="skip the no-image baseline")
    add("--native_widths", action="store_true", help="qformer / c_abstractor at their own hidden widths (256), not "
        "the tower's")
    add("--smoke", action="store_true", help="a tiny sweep that runs in about a minute")
    add("--interim", action="store_true", help="train nothing: the tables and plots of the seeds finished so far "
        "(a sweep's later sitting may be running) in OUT/interim/")
    add("--report", action="store_true", help="train nothing: OUT/token_budget.md again from a finished sweep's "
        "runs.csv and setup.json (seconds)")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    if args.interim and not _flags(argv, ("--interim", "--out")):
        argv = saved_flags(pathlib.Path(args.out)) or argv  # --interim alone: the sweep's own flags, as it ran
        args = parser.parse_args(argv)
    preset = PRESETS["smoke" if args.smoke else "default"]
    lr_given = args.lr is not None  # (no preset: without it each family's rate is tuned)
    for key, value in preset.items():  # unset options take the preset's value
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.lm = dict(preset["lm"], **({"width": args.lm_width} if args.lm_width else {}),
                   **({"depth": args.lm_depth} if args.lm_depth else {}))
    args.seeds = [int(x) for x in str(args.seeds).split(",")]
    args.families = [f for f in args.families.split(",") if f]
    unknown = [f for f in args.families if f not in connectors.REGISTRY]
    if unknown:
        parser.error(f"unknown connector(s) {unknown}; choose from {sorted(connectors.REGISTRY)}.")
    args.budgets = [b if b == "all" else int(b) for b in args.budgets.split(",") if b]
    args.encoder_budgets = [int(b) for b in str(args.encoder_budgets).split(",") if b]
    args.tune_lrs = [args.lr] if lr_given else [float(x) for x in args.tune_lrs.split(",")]
    args.tune_warmups = [int(x) for x in str(args.tune_warmups).split(",")][: 1 if lr_given else None]
    if args.chosen:
        args.chosen = parse_chosen(args.chosen, parser)
        missing = [f for f in args.families + ([] if args.no_blind else [BLIND]) if f not in args.chosen]
        if missing:
            parser.error(f"--chosen names no lr/warmup for {missing}; add e.g. {missing[0]}=1e-3/25.")
    args.chosen = args.chosen or None
    if not 1 <= args.tune_seeds <= len(args.seeds):
        parser.error(f"--tune_seeds {args.tune_seeds}: between 1 and the {len(args.seeds)} seeds of --seeds.")
    args.parser = parser
    return args


def _flags(argv: list, dropped: tuple) -> list:
    """``argv`` without the options ``dropped`` (and their values)."""
    kept, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in dropped:
            skip = name == "--out" and "=" not in a  # --out's value follows it
            continue
        kept.append(a)
    return kept


def saved_flags(out: pathlib.Path) -> list | None:
    """The flags of the sweep that wrote ``OUT/setup.json`` (its command), with ``--interim --out OUT``."""
    path = out / "setup.json"
    if not path.is_file() or "command" not in (setup := json.loads(path.read_text())):
        return None
    words = shlex.split(setup["command"])  # "python -m experiments.token_budget FLAGS", quoted as outputs.command
    if words[1:3] not in (["-m", "experiments.token_budget"], ["-m", "experiments.token_budget.sweep"]):
        return None
    words = words[3:]
    flags = _flags(words, ("--interim", "--report", "--out"))
    print(f"--interim: the sweep's flags from {path}: {' '.join(flags) or '(none)'}")
    return [*flags, "--interim", "--out", str(out)]


def parse_chosen(text: str, parser) -> dict:
    """``--chosen 'pool=3e-4/25,...'`` as ``{family: (lr, warmup)}``."""
    chosen = {}
    for item in text.split(","):
        try:
            family, setting = item.split("=")
            lr, warmup = setting.split("/")
            chosen[family.strip()] = (float(lr), int(warmup))
        except ValueError:
            parser.error(f"--chosen: cannot read {item!r}; write family=lr/warmup, e.g. pool=3e-4/25.")
    return chosen
