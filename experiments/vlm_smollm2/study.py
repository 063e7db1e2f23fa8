"""SmolLM2-135M-Instruct as a VLM's LM on the scenes questions, against a blind baseline and the
from-scratch LM at the same connector and token budget (`configs/vlm_smollm2_scenes.py`).

    python -m experiments.vlm_smollm2            # needs workdirs/clip_scenes (make demo) and workdirs/smollm2
    python -m experiments.vlm_smollm2 --smoke --vision DIR --lm DIR --data_dir DIR   # what the test runs

Each run is a `python -m vitmm.train` process; its row (exact match per question kind, wall
time, peak memory, training speed) is appended to ``runs.csv`` when it finishes, so a rerun
skips finished runs (and the trainer resumes an interrupted one from its checkpoint: the one it saves
on SIGTERM or Ctrl-C, which reach it through the study, or its last of every 50 steps).

The token-budget study's question on this frozen LM (``results/vlm_smollm2/frozen``) is a config
of that study: ``python -m experiments.token_budget --config
experiments/token_budget/configs/smollm2_frozen.py``.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import pathlib

import numpy as np

from experiments.common import train_run
from vitmm.study import stats, verdicts

ROOT = pathlib.Path(__file__).resolve().parents[2]
KINDS = ("exists", "count", "color_at", "shape_at", "relative")
FIELDS = ("run", "lm", "connector", "steps", "batch", "examples", "wall_s", "peak_rss_gib", "img_per_s", "final_loss",
          "qa_examples", "accuracy", *(f"acc_{k}" for k in KINDS))


def plan(steps: int, scratch_steps: int, smoke: bool) -> list[dict]:
    """The runs in order; ``after`` names the run whose checkpoint a run starts from, ``overrides``
    its own flags: a SmolLM2 stage (~15-19 minutes; the config checkpoints at its last step only)
    saves every 50 steps, so that one killed outright resumes part-way (checkpoints change no number)."""
    smol = "configs/vlm_smollm2_scenes.py"
    extra = ",smoke" if smoke else ""
    saves = (f"--config.checkpoint_every={min(50, steps)}",)
    return [
        dict(run="smollm2_stage1", lm="SmolLM2-135M (frozen)", config=f"{smol}:stage=1,steps={steps}{extra}",
             overrides=saves),
        dict(run="smollm2_stage2_lora", lm="SmolLM2-135M + LoRA r8", config=f"{smol}:stage=2,steps={steps}{extra}",
             after="smollm2_stage1", overrides=saves),
        dict(run="smollm2_stage2_lora_blind", lm="SmolLM2-135M + LoRA r8, blank images",
             config=f"{smol}:stage=2,steps={steps},blind=True{extra}", after="smollm2_stage1", overrides=saves),
        dict(run="scratch_lm_same_examples", lm="from-scratch 4-layer LM, bytes",
             config=f"configs/vlm_scenes.py:connector=pool,budget=16,stage=2,steps={scratch_steps}{extra}"),
        dict(run="scratch_lm_500_steps", lm="from-scratch 4-layer LM, bytes",
             config=f"configs/vlm_scenes.py:connector=pool,budget=16,stage=2,steps={4 if smoke else 500}{extra}"),
    ]


def run_one(spec: dict, workdirs: pathlib.Path, overrides: list[str]) -> dict:
    args = [*overrides, *spec.get("overrides", ())]
    if spec.get("after"):
        args.append(f"--config.init.checkpoint={workdirs / spec['after']}")
    if "vlm_scenes" in spec["config"]:  # the from-scratch LM has no init.lm; the tower is the SmolLM2 runs'
        args = [a for a in args if not a.startswith("--config.init.lm=")]
        if not any(a.startswith("--config.init.vision=") for a in args) and ",smoke" not in spec["config"]:
            args.append(f"--config.init.vision={ROOT / 'workdirs/clip_scenes'}")
    summary, lines = train_run.train(spec["config"], workdirs / spec["run"], args, spec["run"])
    evals = [x for x in lines if "qa/accuracy" in x][-1]
    return dict(run=spec["run"], lm=spec["lm"], **summary, qa_examples=int(evals["qa/examples"]),
                accuracy=round(evals["qa/accuracy"], 4),
                **{f"acc_{k}": round(evals.get(f"qa/acc_{k}", float("nan")), 4) for k in KINDS})


def append_row(table: pathlib.Path, fields, row: dict) -> None:
    """Appends ``row`` to the CSV ``table`` (its header first when the file is new), synced to
    disk; a last row that a kill cut short (no newline after it) is dropped first."""
    with table.open("a+b") as f:
        size = f.seek(0, 2)
        if size and os.pread(f.fileno(), 1, size - 1) != b"\n":
            size = os.pread(f.fileno(), size, 0).rfind(b"\n") + 1
            f.truncate(size)
    new = size == 0  # (a header cut short is written again)
    with table.open("a", newline="") as f:
        writer = csv.DictWriter(f, fields)
        if new:
            writer.writeheader()
        writer.writerow(row)
        f.flush()
        os.fsync(f.fileno())


def read_rows(table: pathlib.Path) -> list[dict]:
    """The finished runs' rows of ``table`` (none when it is missing), without a last row a kill
    cut short (no newline after it: not a finished run, and an open quote in it would swallow
    the rows after it)."""
    if not table.is_file():
        return []
    text = table.read_text()
    return list(csv.DictReader(io.StringIO(text[: text.rfind("\n") + 1])))


def kind_counts(workdir: pathlib.Path) -> dict:
    """How many of the QA evaluator's questions are of each kind (the same questions for every
    run: the first ``num_examples`` validation images, one seeded question each)."""
    import ml_collections

    from vitmm.data import pipeline, preprocess
    from vitmm.train import tasks

    config = ml_collections.ConfigDict(json.loads((workdir / "config.json").read_text()))
    cfg = tasks.evals_config(config)["qa"]
    data = cfg["data"]
    source = pipeline.get_source(data["name"], data["split"], data.get("data_dir"),
                                 keys=("questions", "question_kinds"))
    n = min(cfg.get("num_examples") or len(source), len(source))
    pick = preprocess.parse("choose(('questions', 'question_kinds'), ('question', 'question_kind'))|"
                            "keep('question_kind')")
    from vitmm.train.eval_embeddings import Prefix

    kinds = np.concatenate([b["question_kind"][b["_mask"] > 0] for b in pipeline.eval_batches(
        Prefix(source, n), pick, cfg.get("batch_size", 64), process_index=0, process_count=1, num_threads=1)])
    from vitmm.data import scenes

    return {name: int((kinds == i).sum()) for i, name in enumerate(scenes.QUESTION_KINDS)} | {"all": int(len(kinds))}






def report(table: pathlib.Path, counts: dict, out: pathlib.Path) -> None:
    """``vlm_smollm2.md``: accuracy per question kind with 95% intervals, and the key differences.

    ``counts``: the questions per kind (``kind_counts``), one dict that every run answered, or
    ``{run: counts}`` where the runs answered different numbers (``--smoke``: 8 for SmolLM2, 16 for
    the scratch LM). Each row's intervals and tests use its own counts, checked against the number of
    questions it logged."""
    rows = {r["run"]: r for r in read_rows(table)}
    per_run = {run: counts for run in rows} if "all" in counts else counts
    for run, r in rows.items():
        if run not in per_run or per_run[run]["all"] != int(r["qa_examples"]):
            held = per_run[run]["all"] if run in per_run else "no"
            raise SystemExit(f"{run} answered {r['qa_examples']} questions, but counts.json has {held} counts for it: "
                             f"rerun without --report (it counts each run's questions from its workdir).")
    cols = ("accuracy", *(f"acc_{k}" for k in KINDS))
    ns = {run: (c["all"], *(c[k] for k in KINDS)) for run, c in per_run.items()}
    first = next(iter(per_run.values()), {})
    if all(c == first for c in per_run.values()):
        asked = f"questions per kind: {', '.join(f'{k} {first[k]}' for k in KINDS)} ({first['all']} in all)"
    else:
        asked = "questions per kind: each run's own, in counts.json (the runs answered different numbers)"
    lines = ["Exact match (greedy decoding) on the QA evaluator's questions, in % with the 95% Wilson interval; "
             f"{asked}. One seed per run.", "",
             "| run | LM | connector | examples | all | " + " | ".join(KINDS) + " | img/s | peak RSS GiB | wall min |",
             "|---|---|---|---:|" + "---:|" * (len(cols) + 3)]
    for r in rows.values():
        cells = []
        for col, n in zip(cols, ns[r["run"]], strict=True):
            p = float(r[col])
            lo, hi = stats.wilson(p, n)
            cells.append(f"{100 * p:.1f} [{100 * lo:.0f}, {100 * hi:.0f}]")
        lines.append(f"| {r['run']} | {r['lm']} | {r['connector']} | {int(r['examples']):,} | " + " | ".join(cells)
                     + f" | {r['img_per_s']} | {r['peak_rss_gib']} | {int(r['wall_s']) / 60:.1f} |")
    pairs = [("smollm2_stage2_lora", "smollm2_stage2_lora_blind"), ("smollm2_stage1", "smollm2_stage2_lora_blind"),
             ("smollm2_stage2_lora", "smollm2_stage1"), ("smollm2_stage2_lora", "scratch_lm_same_examples"),
             ("smollm2_stage2_lora", "scratch_lm_500_steps"), ("scratch_lm_same_examples", "smollm2_stage2_lora_blind")]
    lines += ["", "Differences (percentage points; two-sided p of a two-proportion z-test per kind):", "",
              "| comparison | " + " | ".join(c.removeprefix("acc_") for c in cols) + " |",
              "|---|" + "---:|" * len(cols)]
    tests = []
    for a, b in pairs:
        if a in rows and b in rows:
            cells = []
            for c, n, n_b in zip(cols, ns[a], ns[b], strict=True):
                pa, pb = float(rows[a][c]), float(rows[b][c])
                p = stats.two_proportion_p(pa, pb, n, n_b)
                cells.append(f"{100 * (pa - pb):+.1f} (p={p:.2g})")
                tests.append(verdicts.Test(f"{a} − {b}, {c.removeprefix('acc_')}", 100 * (pa - pb), None, p,
                                           unit=f"{n} questions" if n == n_b else f"{n} and {n_b} questions"))
            lines.append(f"| {a} − {b} | " + " | ".join(cells) + " |")
    lines += verdicts.section(tests, "The differences above (points; one seed per run, so the unit is the question: "
                                     "a run-to-run difference of another seed is not in these tests).")
    (out / "vlm_smollm2.md").write_text("\n".join(lines) + "\n")
    (out / "counts.json").write_text(json.dumps(counts) + "\n")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300, help="steps of each SmolLM2 stage (batch 16)")
    parser.add_argument("--out", default=str(ROOT / "results/vlm_smollm2"))
    parser.add_argument("--workdirs", default=str(ROOT / "workdirs/smol"))
    parser.add_argument("--vision", default=None, help="the tower folder (default: the config's, make demo's)")
    parser.add_argument("--lm", default=None, help="the converted LM folder (default: the config's)")
    parser.add_argument("--data_dir", default=None)
    parser.add_argument("--only", default=None, help="comma-separated run names (default: all)")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--report", action="store_true", help="train nothing: vlm_smollm2.md again from runs.csv and "
                        "counts.json (the questions per kind)")
    parser.add_argument("--verbose", action="store_true", help="the libraries' routine warnings and INFO lines too "
                        "(python -m experiments.vlm_smollm2 reads it)")
    args = parser.parse_args(argv)
    overrides = [f"--config.init.{k}={v}" for k, v in (("vision", args.vision), ("lm", args.lm)) if v]
    if args.data_dir:
        overrides.append(f"--config.input.data_dir={args.data_dir}")
    out, workdirs = pathlib.Path(args.out), pathlib.Path(args.workdirs)
    table = out / "runs.csv"
    if args.report:
        if not table.is_file() or not (out / "counts.json").is_file():
            raise SystemExit(f"--report: {out} has no runs.csv or counts.json; a finished study writes them.")
        report(table, json.loads((out / "counts.json").read_text()), out)
        print(f"wrote {out / 'vlm_smollm2.md'}")
        return out / "vlm_smollm2.md"
    out.mkdir(parents=True, exist_ok=True)
    done = {r["run"] for r in read_rows(table)}
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
        counts = {r["run"]: kind_counts(workdirs / r["run"]) for r in read_rows(table)}
        same = all(c == next(iter(counts.values())) for c in counts.values())
        report(table, next(iter(counts.values())) if same else counts, out)
        print(f"wrote {out / 'vlm_smollm2.md'}")


if __name__ == "__main__":
    main()
