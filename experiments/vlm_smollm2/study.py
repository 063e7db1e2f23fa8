"""SmolLM2-135M-Instruct as a VLM's LM on the scenes questions, against a blind baseline and the
from-scratch LM at the same connector and token budget (`configs/vlm_smollm2_scenes.py`).

    python experiments/vlm_smollm2.py            # needs workdirs/clip_scenes (make demo) and workdirs/smollm2
    python experiments/vlm_smollm2.py --smoke --vision DIR --lm DIR --data_dir DIR   # what the test runs
    python experiments/vlm_smollm2.py --frozen   # the token-budget subset on the frozen LM (results/vlm_smollm2/frozen)

Each run is a `python -m vitmm.train` process; its row (exact match per question kind, wall
time, peak memory, training speed) is appended to ``runs.csv`` when it finishes, so a rerun
skips finished runs (and the trainer resumes an interrupted one from its checkpoint).

``--frozen``: the token-budget study's question on a real LM. SmolLM2 stays frozen and each run
trains its connector alone (stage 1) for ``--steps`` steps of 16 examples: ``--families`` ×
``--budgets`` × ``--seeds`` (the seed sets the initialisation and the data order, the same for
every family, so seeds pair), and a ``blind`` row per seed (pool at the largest budget on blank
images: what a learned soft prompt gets from the questions alone). Each family's learning rate is
the best of ``--lrs`` on the validation questions at ``--tune_budget`` tokens and the first seed
(the tuning rows); blind uses pool's. The grid is scored on ``--test_questions`` test questions,
greedy decoding; ``frozen.md`` has the means with 95% CIs over seeds and t-tests paired by seed
(the token-budget report's spread and claim tests). The tower is the token-budget sweep's
(``results/token_budget/tower``) unless ``--vision`` says otherwise. A run checkpoints every
``--checkpoint_every`` steps (a run killed mid-way resumes there; checkpoints do not change its
numbers) and its checkpoints (the frozen LM with them: ~0.35 GB each) are deleted once its row is written.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

import numpy as np

from vitmm.study import stats

ROOT = pathlib.Path(__file__).resolve().parents[2]
KINDS = ("exists", "count", "color_at", "shape_at", "relative")
FIELDS = ("run", "lm", "connector", "steps", "batch", "examples", "wall_s", "peak_rss_gib", "img_per_s", "final_loss",
          "qa_examples", "accuracy", *(f"acc_{k}" for k in KINDS))


def plan(steps: int, scratch_steps: int, smoke: bool) -> list[dict]:
    """The runs in order; ``after`` names the run whose checkpoint a run starts from."""
    smol = "configs/vlm_smollm2_scenes.py"
    extra = ",smoke" if smoke else ""
    return [
        dict(run="smollm2_stage1", lm="SmolLM2-135M (frozen)", config=f"{smol}:stage=1,steps={steps}{extra}"),
        dict(run="smollm2_stage2_lora", lm="SmolLM2-135M + LoRA r8", config=f"{smol}:stage=2,steps={steps}{extra}",
             after="smollm2_stage1"),
        dict(run="smollm2_stage2_lora_blind", lm="SmolLM2-135M + LoRA r8, blank images",
             config=f"{smol}:stage=2,steps={steps},blind=True{extra}", after="smollm2_stage1"),
        dict(run="scratch_lm_same_examples", lm="from-scratch 4-layer LM, bytes",
             config=f"configs/vlm_scenes.py:connector=pool,budget=16,stage=2,steps={scratch_steps}{extra}"),
        dict(run="scratch_lm_500_steps", lm="from-scratch 4-layer LM, bytes",
             config=f"configs/vlm_scenes.py:connector=pool,budget=16,stage=2,steps={4 if smoke else 500}{extra}"),
    ]


def run_one(spec: dict, workdirs: pathlib.Path, overrides: list[str]) -> dict:
    workdir = workdirs / spec["run"]
    cmd = [sys.executable, "-m", "vitmm.train", "--config", spec["config"], "--workdir", str(workdir), *overrides,
           *spec.get("overrides", ())]
    if spec.get("after"):
        cmd.append(f"--config.init.checkpoint={workdirs / spec['after']}")
    if "vlm_scenes" in spec["config"]:  # the from-scratch LM has no init.lm; the tower is the SmolLM2 runs'
        cmd = [a for a in cmd if not a.startswith("--config.init.lm=")]
        if not any(a.startswith("--config.init.vision=") for a in cmd) and ",smoke" not in spec["config"]:
            cmd.append(f"--config.init.vision={ROOT / 'workdirs/clip_scenes'}")
    print("$", " ".join(cmd), flush=True)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{spec['run']} failed (exit {os.waitstatus_to_exitcode(status)}); rerun to resume it.")
    lines = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    train = [x for x in lines if "loss" in x]
    evals = [x for x in lines if "qa/accuracy" in x][-1]
    config = json.loads((workdir / "config.json").read_text())
    speeds = [x["img_per_s"] for x in train[2:] if "img_per_s" in x] or [x.get("img_per_s", 0) for x in train]
    return dict(run=spec["run"], lm=spec["lm"], connector=f"{config['model']['connector']['name']}@"
                f"{config['model']['connector']['budget']}", steps=config["total_steps"], batch=config["batch_size"],
                examples=config["total_steps"] * config["batch_size"], wall_s=round(wall),
                peak_rss_gib=round(usage.ru_maxrss / 2**20, 2), img_per_s=round(float(np.median(speeds)), 2),
                final_loss=round(train[-1]["loss"], 4), qa_examples=int(evals["qa/examples"]),
                accuracy=round(evals["qa/accuracy"], 4),
                **{f"acc_{k}": round(evals.get(f"qa/acc_{k}", float("nan")), 4) for k in KINDS})


def append_row(table: pathlib.Path, fields, row: dict) -> None:
    """Appends ``row`` to the CSV ``table`` (its header first when the file is new)."""
    new = not table.is_file()
    with table.open("a", newline="") as f:
        writer = csv.DictWriter(f, fields)
        if new:
            writer.writeheader()
        writer.writerow(row)


def kind_counts(workdir: pathlib.Path) -> dict:
    """How many of the QA evaluator's questions are of each kind (the same questions for every
    run: the first ``num_examples`` validation images, one seeded question each)."""
    import ml_collections

    from vitmm.data import pipeline, preprocess
    from vitmm.train import tasks

    config = ml_collections.ConfigDict(json.loads((workdir / "config.json").read_text()))
    cfg = tasks._evals_config(config)["qa"]
    data = cfg["data"]
    source = pipeline.get_source(data["name"], data["split"], data.get("data_dir"),
                                 keys=("questions", "question_kinds"))
    n = min(cfg.get("num_examples") or len(source), len(source))
    pick = preprocess.parse("choose(('questions', 'question_kinds'), ('question', 'question_kind'))|"
                            "keep('question_kind')")
    from vitmm.train.evaluators import _Prefix

    kinds = np.concatenate([b["question_kind"][b["_mask"] > 0] for b in pipeline.eval_batches(
        _Prefix(source, n), pick, cfg.get("batch_size", 64), process_index=0, process_count=1, num_threads=1)])
    from vitmm.data import scenes

    return {name: int((kinds == i).sum()) for i, name in enumerate(scenes.QUESTION_KINDS)} | {"all": int(len(kinds))}






def report(table: pathlib.Path, counts: dict, out: pathlib.Path) -> None:
    """``vlm_smollm2.md``: accuracy per question kind with 95% intervals, and the key differences."""
    rows = {r["run"]: r for r in csv.DictReader(table.open())}
    cols = ("accuracy", *(f"acc_{k}" for k in KINDS))
    ns = (counts["all"], *(counts[k] for k in KINDS))
    lines = ["Exact match (greedy decoding) on the QA evaluator's questions, in % with the 95% Wilson interval; "
             f"questions per kind: {', '.join(f'{k} {counts[k]}' for k in KINDS)} ({counts['all']} in all). One seed "
             "per run.", "",
             "| run | LM | connector | examples | all | " + " | ".join(KINDS) + " | img/s | peak RSS GiB | wall min |",
             "|---|---|---|---:|" + "---:|" * (len(cols) + 3)]
    for r in rows.values():
        cells = []
        for col, n in zip(cols, ns, strict=True):
            p = float(r[col])
            lo, hi = stats.wilson(p, n)
            cells.append(f"{100 * p:.1f} [{100 * lo:.0f}, {100 * hi:.0f}]")
        lines.append(f"| {r['run']} | {r['lm']} | {r['connector']} | {int(r['examples']):,} | " + " | ".join(cells)
                     + f" | {r['img_per_s']} | {r['peak_rss_gib']} | {int(r['wall_s']) / 60:.1f} |")
    pairs = [("smollm2_stage2_lora", "smollm2_stage2_lora_blind"), ("smollm2_stage1", "smollm2_stage2_lora_blind"),
             ("smollm2_stage2_lora", "smollm2_stage1"), ("smollm2_stage2_lora", "scratch_lm_same_examples"),
             ("smollm2_stage2_lora", "scratch_lm_500_steps")]
    lines += ["", "Differences (percentage points; two-sided p of a two-proportion z-test per kind):", "",
              "| comparison | " + " | ".join(c.removeprefix("acc_") for c in cols) + " |",
              "|---|" + "---:|" * len(cols)]
    for a, b in pairs:
        if a in rows and b in rows:
            cells = []
            for c, n in zip(cols, ns, strict=True):
                pa, pb = float(rows[a][c]), float(rows[b][c])
                cells.append(f"{100 * (pa - pb):+.1f} (p={stats.two_proportion_p(pa, pb, n):.2g})")
            lines.append(f"| {a} − {b} | " + " | ".join(cells) + " |")
    (out / "vlm_smollm2.md").write_text("\n".join(lines) + "\n")


FROZEN_FIELDS = (*FIELDS, "family", "budget", "tokens", "seed", "lr", "split", "status", "variant")


def frozen_specs(args, chosen: dict | None) -> list[dict]:
    """The frozen-LM subset's runs: without ``chosen`` the tuning runs (every family at
    ``tune_budget`` with every lr, the first seed, scored on validation); with ``chosen``
    (``{family: lr}``) the grid and the blind rows, scored on the test split."""
    smol, extra = "configs/vlm_smollm2_scenes.py", ",smoke" if args.smoke else ""

    def spec(run, family, budget, seed, lr, split, blind=False):
        connector = "pool" if blind else family
        test = [f"--config.evals.qa.data.split={split}"] + (
            [f"--config.evals.qa.num_examples={args.test_questions}"] if split == "test" else [])
        return dict(run=run, lm="SmolLM2-135M (frozen)", family="blind" if blind else family, budget=budget,
                    seed=seed, lr=lr, split=split,
                    config=f"{smol}:stage=1,connector={connector},budget={budget},steps={args.steps}"
                           f"{',blind=True' if blind else ''}{extra}",
                    overrides=[f"--config.optim.lr={lr}", f"--config.seed={seed}",
                               f"--config.checkpoint_every={args.checkpoint_every}", *test])

    if chosen is None:
        return [spec(f"tune_{f}_{args.tune_budget}_lr{lr:g}", f, args.tune_budget, args.seeds[0], lr, "validation")
                for f in args.families for lr in args.lrs]
    runs = [spec(f"{f}_{b}_s{seed}", f, b, seed, chosen[f], "test")
            for seed in args.seeds for b in sorted(args.budgets, reverse=True) for f in args.families]
    blind_lr = chosen.get("pool", chosen[args.families[0]])
    return runs + [spec(f"blind_{max(args.budgets)}_s{seed}", None, max(args.budgets), seed, blind_lr, "test", True)
                   for seed in args.seeds]


def visual_tokens(workdir: pathlib.Path) -> int:
    """The visual tokens the run's connector handed the LM (its config and the tower's grid)."""
    import ml_collections

    from vitmm.models import connectors
    from vitmm.models.vit import ViT
    from vitmm.train import tasks

    config = ml_collections.ConfigDict(json.loads((workdir / "config.json").read_text()))
    vision, _ = tasks.vlm_parts(config)
    grid = tuple(ViT(**vision).grid((config.input.image_size, config.input.image_size)))
    return int(connectors.num_visual_tokens(config.model.connector.to_dict(), grid))


def choose_lrs(rows: list[dict], families) -> dict:
    """``{family: lr}``: the best validation accuracy among the tuning rows (ties: the smaller lr)."""
    best = {}
    for r in rows:
        key = (float(r["accuracy"]), -float(r["lr"]))
        if r["run"].startswith("tune_") and r["family"] in families and key > best.get(r["family"], ((-1, 0), 0))[0]:
            best[r["family"]] = (key, float(r["lr"]))
    return {f: lr for f, (_, lr) in best.items()}


def frozen_report(rows: list[dict], chosen: dict, args, path: pathlib.Path) -> None:
    """``frozen.md``: the tuning grid, then the grid's means ± 95% CI over seeds per question kind
    with the paired gain over blind, the spread across families against the gain from more
    tokens, and Honeybee's and the fine-detail claims (``experiments/token_budget/tables.py``)."""
    from experiments.token_budget import report as tbr
    from experiments.token_budget import tables

    tune = [r for r in rows if r["run"].startswith("tune_")]
    lrs = sorted({float(r["lr"]) for r in tune})
    batch = rows[0]["batch"] if rows else "?"
    lines = [f"SmolLM2-135M-Instruct frozen; each run trains its connector alone for {args.steps} steps of {batch} "
             "examples (stage 1), exact match of greedy answers.", "",
             f"Learning rate per family: validation accuracy (%) at {args.tune_budget} tokens, seed {args.seeds[0]} "
             "(the chosen one in bold):", "", "| family | " + " | ".join(f"{lr:g}" for lr in lrs) + " |",
             "|---|" + "---:|" * len(lrs)]
    for f in dict.fromkeys(r["family"] for r in tune):
        acc = {float(r["lr"]): 100 * float(r["accuracy"]) for r in tune if r["family"] == f}
        lines.append(f"| {f} | " + " | ".join(("**{:.1f}**" if chosen.get(f) == lr else "{:.1f}").format(acc[lr])
                                              if lr in acc else "" for lr in lrs) + " |")
    grid = [dict(r, seed=int(r["seed"]), tokens=int(r["tokens"]), budget=int(r["budget"]), variant="", status="ok",
                 **{k: float(r[k]) for k in ("accuracy", *(f"acc_{k}" for k in KINDS))})
            for r in rows if not r["run"].startswith("tune_")]
    if grid:
        summary = sorted(tbr.summarise(grid), key=lambda s: (s["family"] == tbr.BLIND, s["family"], s["tokens"]))
        n = int(grid[0]["qa_examples"])
        lines += ["", f"Test questions ({n}, the same for every run), mean ± 95% CI over seeds (%); "
                  "vs blind: t-test paired by seed:", "",
                  "| family | tokens | lr | seeds | all | " + " | ".join(KINDS) + " | vs blind |",
                  "|---|---:|---:|---:|" + "---:|" * (len(KINDS) + 2)]
        for x in summary:
            cells = [tables.mean_ci(x, "accuracy"), *(tables.mean_ci(x, f"acc_{k}") for k in KINDS),
                     tables.diff_p(x["vs_blind"])]
            lines.append(f"| {x['family']} | {x['tokens']} | {float(x['lr']):g} | {x['seeds']} | " + " | ".join(cells)
                         + " |")
        lines += ["", *tables.spread_lines(summary), "", *tables.claim_lines(summary)]
    path.write_text("\n".join(lines) + "\n")


def run_frozen(args, overrides: list[str]) -> None:
    out, workdirs = pathlib.Path(args.out), pathlib.Path(args.workdirs)
    out.mkdir(parents=True, exist_ok=True)
    table = out / "runs.csv"

    def rows():
        return list(csv.DictReader(table.open())) if table.is_file() else []

    def run_all(specs):
        for spec in specs:
            if spec["run"] in {r["run"] for r in rows()}:
                print(f"{spec['run']}: done, skipped", flush=True)
                continue
            row = run_one(spec, workdirs, overrides)
            row.update({k: spec[k] for k in ("family", "budget", "seed", "lr", "split")},
                       tokens=visual_tokens(workdirs / spec["run"]), status="ok", variant="")
            append_row(table, FROZEN_FIELDS, row)
            shutil.rmtree(workdirs / spec["run"] / "checkpoints", ignore_errors=True)
            print(row, flush=True)

    chosen = {f: args.lrs[0] for f in args.families}  # one lr: nothing to tune
    if args.interim:  # train nothing: the report of the runs finished so far, beside the final one
        done = rows()
        if len(args.lrs) > 1:  # the lrs show as chosen only once every family has tried every lr
            tuned = {(r["family"], float(r["lr"])) for r in done if r["run"].startswith("tune_")}
            complete = tuned >= {(f, lr) for f in args.families for lr in args.lrs}
            chosen = choose_lrs(done, args.families) if complete else {}
        (out / "interim").mkdir(exist_ok=True)
        frozen_report(done, chosen, args, out / "interim/frozen.md")
        print(f"wrote {out / 'interim/frozen.md'} from {len(done)} finished runs")
        return
    if len(args.lrs) > 1:
        run_all(frozen_specs(args, None))
        chosen = choose_lrs(rows(), args.families)
    print(f"learning rate per family: {chosen}", flush=True)
    run_all(frozen_specs(args, chosen))
    frozen_report(rows(), chosen, args, out / "frozen.md")
    print(f"wrote {out / 'frozen.md'}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300, help="steps of each SmolLM2 stage (batch 16)")
    parser.add_argument("--out", default=str(ROOT / "results/vlm_smollm2"))
    parser.add_argument("--workdirs", default=str(ROOT / "workdirs/smol"))
    parser.add_argument("--vision", default=None, help="the tower folder (default: the config's, make demo's; "
                        "--frozen: the token-budget sweep's, results/token_budget/tower)")
    parser.add_argument("--lm", default=None, help="the converted LM folder (default: the config's)")
    parser.add_argument("--data_dir", default=None)
    parser.add_argument("--only", default=None, help="comma-separated run names (default: all)")
    parser.add_argument("--smoke", action="store_true")
    frozen = parser.add_argument_group("--frozen: the token-budget subset on the frozen LM")
    frozen.add_argument("--frozen", action="store_true")
    frozen.add_argument("--families", default="pool,c_abstractor,qwen_resampler")
    frozen.add_argument("--budgets", default="4,16", help="visual tokens")
    frozen.add_argument("--seeds", default="0,1,2")
    frozen.add_argument("--lrs", default="3e-4,1e-3,3e-3", help="the tuning grid (one value: no tuning)")
    frozen.add_argument("--tune_budget", type=int, default=16)
    frozen.add_argument("--test_questions", type=int, default=1024)
    frozen.add_argument("--checkpoint_every", type=int, default=50,
                        help="steps between a run's checkpoints: a run killed mid-way resumes from the last one")
    frozen.add_argument("--interim", action="store_true", help="train nothing: the report of the runs finished so "
                        "far (a sitting may be running) in OUT/interim/frozen.md")
    args = parser.parse_args(argv)
    overrides = [f"--config.init.{k}={v}" for k, v in (("vision", args.vision), ("lm", args.lm)) if v]
    if args.data_dir:
        overrides.append(f"--config.input.data_dir={args.data_dir}")
    if args.frozen:
        args.families, args.lrs = args.families.split(","), [float(x) for x in args.lrs.split(",")]
        args.budgets, args.seeds = [int(x) for x in args.budgets.split(",")], [int(x) for x in args.seeds.split(",")]
        if args.out == parser.get_default("out"):
            args.out = str(ROOT / "results/vlm_smollm2/frozen")
        if args.workdirs == parser.get_default("workdirs"):
            args.workdirs = str(ROOT / "workdirs/smol_frozen")
        if args.vision is None:  # the token-budget sweep's own tower, pinned with its results
            overrides.append(f"--config.init.vision={ROOT / 'results/token_budget/tower'}")
        return run_frozen(args, overrides)
    out, workdirs = pathlib.Path(args.out), pathlib.Path(args.workdirs)
    out.mkdir(parents=True, exist_ok=True)
    table = out / "runs.csv"
    done = {r["run"] for r in csv.DictReader(table.open())} if table.is_file() else set()
    # The from-scratch LM sees as many examples as both SmolLM2 stages together (batch 64 there).
    scratch_steps = 4 if args.smoke else max(2 * args.steps * 16 // 64, 1)
    for spec in plan(args.steps, scratch_steps, args.smoke):
        if args.only and spec["run"] not in args.only.split(","):
            continue
        if spec["run"] in done:
            print(f"{spec['run']}: done, skipped", flush=True)
            continue
        row = run_one(spec, workdirs, overrides)
        append_row(table, FIELDS, row)
        print(row, flush=True)
    if table.is_file():
        first = next(csv.DictReader(table.open()))["run"]
        report(table, kind_counts(workdirs / first), out)
        print(f"wrote {out / 'vlm_smollm2.md'}")


if __name__ == "__main__":
    main()
