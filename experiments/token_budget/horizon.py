"""Had the token-budget sweep's runs levelled off? Some of its cells again, trained longer.

    python -m experiments.token_budget.horizon          # pool, perceiver, qformer at 16 tokens, seeds 0-2, 2x steps
    python -m experiments.token_budget.horizon --families pool --budget 4 --seeds 0,1 --factor 4

Each run repeats a main-stage run of a finished sweep (``--main``, default ``results/token_budget``)
with everything the same (tower, data, stage-0 LM and stage 1 per seed, the family's chosen lr and
warmup from the sweep's ``setup.json``) except the joint phase: ``--factor`` times the steps, the
cosine decay stretched to the new end. Options after the script's own (e.g. ``--smoke --tower T
--data_dir D``) go to the sweep (``python -m experiments.token_budget``) and must be those the
sweep ran with; the runs' settings are checked against the sweep's before anything is compared.
The runs themselves are a token-budget sweep in ``--out`` (resumable the same way);
``horizon.md`` there compares each cell at the two horizons, paired by seed: if the sweep's runs
had levelled off, the longer runs gain ~0.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import numpy as np

from experiments.token_budget import sweep as tb
from experiments.token_budget import tune
from vitmm.study import stats, verdicts

# The families whose order the longer runs were first trained to check (issue 57: the pool − Q-Former gap
# shrank): their gaps are tested; a family added later to ask whether it had levelled off adds its gain
# alone, so that the report's family of tests (Holm) does not grow with every pair of families.
GAP_FAMILIES = ("pool", "perceiver", "qformer")

# What must be equal for a run at the longer horizon to pair with the sweep's run of the same seed.
SAME = ("tower_fingerprint", "data", "lm", "stage0_lr", "stage0_steps", "stage1_steps", "train_questions",
        "val_questions", "test_questions", "max_len", "tokenizer")
PLAN_SAME = ("batch_size", "eval_every", "curve_questions", "schedule", "patience", "min_delta")  # min_delta: which
# check is tested


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--main", default="results/token_budget", help="the finished sweep (its setup.json and runs.csv)")
    add("--out", default="results/token_budget/horizon", help="output folder")
    add("--families", default="pool,perceiver,qformer", help="comma-separated connector names")
    add("--gap_families", default=",".join(GAP_FAMILIES), help="the families whose gaps (at each horizon, and "
        "their change) are tested beside every family's gain; the others' gains alone")
    add("--budget", type=int, default=16, help="visual tokens (each family at its nearest reachable count)")
    add("--seeds", default="0,1,2", help="comma-separated seeds (of those the sweep ran)")
    add("--factor", type=int, default=2, help="joint steps: this many times the sweep's")
    add("--workers", type=int, default=None, help="as token_budget.py's")
    add("--report", action="store_true", help="train nothing: horizon.md again from both sweeps' runs.csv")
    args, passthrough = parser.parse_known_args(argv)
    args.parser = parser
    return args, passthrough


def differences(main: dict, long: dict) -> list[str]:
    """The settings (``SAME``, the plan's ``PLAN_SAME``, the longer runs' connectors, e.g. at
    another width) in which two setup.json records differ."""
    out = [k for k in SAME if main.get(k) != long.get(k)]
    losses = [main.get("stage0_final_loss", {}), long.get("stage0_final_loss", {})]  # the same LM per seed
    out += [f"stage0_final_loss[{k}]" for k in sorted(set(losses[0]) & set(losses[1])) if losses[0][k] != losses[1][k]]
    out += [f"plan.{k}" for k in PLAN_SAME if main["plan"].get(k) != long["plan"].get(k)]
    return out + [f"connectors[{k}]" for k, job in long.get("connectors", {}).items()
                  if main.get("connectors", {}).get(k) != job]


def cell_runs(rows: list[dict], family: str, tokens) -> dict:
    """``{seed: row}`` of a cell's finished main-table runs."""
    return {int(r["seed"]): r for r in rows if r["status"] == "ok" and r["variant"] == ""
            and r["family"] == family and str(r["tokens"]) == str(tokens)}


def by_seed(rows: list[dict], family: str, tokens, key: str) -> dict:
    """``{seed: float(row[key])}`` of a cell's finished main-table runs."""
    return {seed: float(r[key]) for seed, r in cell_runs(rows, family, tokens).items()}


def _pm(values) -> str:
    values = 100 * np.asarray(values)
    return f"{values.mean():.1f} ± {stats.ci95(values):.1f}"


def compare(main_rows: list[dict], long_rows: list[dict], steps: tuple[int, int],
            gap_families=GAP_FAMILIES) -> list[str]:
    """``horizon.md``'s table: per cell, accuracy at both horizons and the gain paired by seed."""
    lines = [f"Each cell at {steps[0]:,} joint steps (the sweep's runs) and at {steps[1]:,} (the same runs, the "
             "cosine stretched), test exact match in %, mean ± 95% CI over the seeds both ran; gains: paired by "
             "seed (p: t-test on the overall gain); learn color_at: seeds at least "
             f"{100 * tb.report.LEARNED_MARGIN:g} points above the sweep's blind on colour-at-location; rising: seeds "
             "whose highest validation check came in the last quarter of their steps, at each horizon (a run whose "
             "highest check is earlier has reached a plateau; one whose highest is late may still be rising, or the "
             "decayed rate's last checks are its best).", "",
             f"| connector | tokens | seeds | all at {steps[0]:,} | all at {steps[1]:,} | gain | p | color_at gain | "
             "shape_at gain | learn color_at | rising |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    blind = [float(r["acc_color_at"]) for r in main_rows if r["family"] == tb.BLIND and r["status"] == "ok"]
    bar = np.mean(blind) + tb.report.LEARNED_MARGIN if blind else None
    for family, tokens in dict.fromkeys((r["family"], r["tokens"]) for r in long_rows if r["status"] == "ok"):
        cell = {key: [by_seed(rows, family, tokens, key) for rows in (main_rows, long_rows)]
                for key in ("accuracy", "acc_color_at", "acc_shape_at")}
        seeds = sorted(set(cell["accuracy"][0]) & set(cell["accuracy"][1]))
        if len(seeds) < 2:
            lines.append(f"| {family} | {tokens} | {len(seeds)} | too few seeds in both |" + " |" * 7)
            continue
        gain = {key: stats.one_sample([b[k] - a[k] for k in seeds]) for key, (a, b) in cell.items()
                if key.startswith("acc")}
        rising = " → ".join(str(sum(tb.report.late(runs[k]) for k in seeds))
                            for runs in (cell_runs(rows, family, tokens) for rows in (main_rows, long_rows)))
        shown = {key: f"{100 * g[0]:+.1f} ± {100 * g[1]:.1f}" for key, g in gain.items()}
        short, long = cell["accuracy"]
        learn = "" if bar is None else " → ".join(str(sum(c[k] >= bar for k in seeds)) for c in cell["acc_color_at"])
        lines.append(f"| {family} | {tokens} | {len(seeds)} | {_pm([short[k] for k in seeds])} | "
                     f"{_pm([long[k] for k in seeds])} | {shown['accuracy']} | {gain['accuracy'][2]:.2g} | "
                     f"{shown['acc_color_at']} | {shown['acc_shape_at']} | {learn} | {rising} |")
    cells = {family for family, _ in dict.fromkeys((r["family"], r["tokens"]) for r in long_rows)}
    gaps = [f for f in gap_families if f in cells]
    which = "the families" if set(gaps) == cells else f"{', '.join(gaps)} (`--gap_families`; the others: gains alone)"
    return lines + ["", *verdicts.table_lines(verdicts.correct(horizon_tests(main_rows, long_rows, steps, gaps)),
                                              f"**Verdicts.** The gains above, the gaps between {which} at each "
                                              "horizon and each gap's change (points, paired by seed).")]


def horizon_tests(main_rows: list[dict], long_rows: list[dict], steps: tuple[int, int],
                  gap_families=GAP_FAMILIES) -> list[verdicts.Test]:
    """Each cell's gain from the shorter to the longer horizon, at each horizon the gap between every
    two of ``gap_families`` (does their order hold when the runs train longer?), and each gap's change
    between the horizons: a gain over the seeds its cell ran at both horizons (the table's), a gap and
    its change over the seeds both families ran at both."""
    cells = list(dict.fromkeys((r["family"], r["tokens"]) for r in long_rows if r["status"] == "ok"))
    acc = {cell: [by_seed(rows, *cell, "accuracy") for rows in (main_rows, long_rows)] for cell in cells}
    paired = [cell for cell in cells if cell[0] in gap_families]

    def both(*of):  # the seeds every horizon of every cell named holds
        return sorted(set.intersection(*(set(runs) for cell in of for runs in acc[cell])))

    tests = []

    def add(name, diffs):
        if (test := stats.one_sample(100 * np.asarray(diffs))) is not None:
            tests.append(verdicts.Test(name, *test))

    for (family, tokens), (short, long) in acc.items():
        add(f"{family}@{tokens}: {steps[1]:,} − {steps[0]:,} steps",
            [long[k] - short[k] for k in both((family, tokens))])
    for h, n in enumerate(steps):
        for i, a in enumerate(paired):
            for b in paired[i + 1:]:
                add(f"{a[0]} − {b[0]} at {n:,} steps", [acc[a][h][k] - acc[b][h][k] for k in both(a, b)])
    for i, a in enumerate(paired):  # does a gap close with training? (the spread partly how fast each learns)
        for b in paired[i + 1:]:
            add(f"{a[0]} − {b[0]}: change from {steps[0]:,} to {steps[1]:,} steps",
                [(acc[a][1][k] - acc[b][1][k]) - (acc[a][0][k] - acc[b][0][k]) for k in both(a, b)])
    return tests


def main(argv=None) -> pathlib.Path:
    args, passthrough = parse_args(argv)
    main_dir, out = pathlib.Path(args.main), pathlib.Path(args.out)
    for d in (main_dir, *([out] if args.report else [])):
        if not (d / "setup.json").is_file() or not (d / "runs.csv").is_file():
            module = "experiments.token_budget" + (".horizon" if d == out else "")
            args.parser.error(f"{d} holds no finished sweep (no setup.json / runs.csv); run python -m {module} to its "
                              "end first.")
    setup = json.loads((main_dir / "setup.json").read_text())
    chosen = setup["chosen"]
    families = [f for f in args.families.split(",") if f]
    gaps = [f for f in args.gap_families.split(",") if f]
    rates = {}
    for f in families:  # the family's choice, or (tuned at each budget) the one at the budget compared
        try:
            rates[f] = tune.rate(chosen, f, args.budget)
        except KeyError:
            pass
    missing = [f for f in families if f not in rates]
    if missing:
        args.parser.error(f"the sweep in {main_dir} has no chosen lr/warmup for {missing}; it ran {sorted(chosen)}.")
    steps = setup["plan"]["max_steps"]
    argv = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--report"]
    if args.report:
        return write(main_dir, out, families, args.budget, (steps, args.factor * steps), argv, gaps)
    tower = ["--tower", str(main_dir / "tower")] if "--tower" not in passthrough else []
    tb.main([*passthrough, *tower, "--out", str(out), "--families", ",".join(families), "--budgets",
             str(args.budget), "--seeds", args.seeds, "--steps", str(args.factor * steps), "--param_budget", "0",
             "--encoder_budgets", "", "--no_blind",
             "--chosen", ",".join(f"{f}={rates[f][0]:g}/{rates[f][1]}" for f in families),
             *(["--workers", str(args.workers)] if args.workers else [])])
    long_setup = json.loads((out / "setup.json").read_text())
    differ = differences(setup, long_setup)
    if differ:
        sys.exit(f"the runs in {out} differ from the sweep in {main_dir} in {differ}: pass token_budget.py the "
                 "options the sweep ran with (its setup.json 'command'); nothing compared.")
    return write(main_dir, out, families, args.budget, (steps, args.factor * steps), argv, gaps)


def write(main_dir: pathlib.Path, out: pathlib.Path, families: list[str], budget: int, steps: tuple[int, int],
          argv: list[str], gap_families=GAP_FAMILIES) -> pathlib.Path:
    """``horizon.md`` from both sweeps' ``runs.csv``, dated by the longer runs' ``setup.json``."""
    main_rows, long_rows = (tb.report.read_runs(d / "runs.csv") for d in (main_dir, out))
    date = json.loads((out / "setup.json").read_text()).get("date", time.strftime("%Y-%m-%d"))
    lines = [f"# Longer training: {', '.join(families)} at {budget} tokens ({date})", "",
             f"`python -m experiments.token_budget.horizon {' '.join(argv)}`"
             f" (the runs' own tables: `token_budget.md` here).", "",
             *compare(main_rows, long_rows, steps, gap_families)]
    (out / "horizon.md").write_text("\n".join(lines) + "\n")
    print((out / "horizon.md").read_text())
    return out


if __name__ == "__main__":
    tb.xla_flags.use_vitmm_defaults()
    from experiments.common import entry

    entry.quiet()  # the libraries' routine warnings off the console; --verbose keeps them
    main()
