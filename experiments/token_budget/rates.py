"""Was each family's learning rate, chosen at one token count, also its best at the others?

    python -m experiments.token_budget.rates --main results/token_budget/hard  # a ladder step each way, seeds 0,1
    python -m experiments.token_budget.rates --main M --steps_away=-2,-1,1    # one further, where -1 won at an edge

A sweep tunes each family's lr and warmup at one token count on its first seed (``--tune_budget``) and
reuses them at every budget, so a budget effect could be partly a rate that suits one budget better than
another. This trains every main-table cell of a finished sweep (``--main``) again on its first
``--seeds`` at the chosen rate's neighbours on the 1-3-10 ladder (``--steps_away``: -1 is the next
smaller rate, 1 the next larger), the warmup and everything else the sweep's (its pinned tower, stage-0
LM and stage 1 per seed); each step away is a token-budget sweep of its own in ``OUT/lr_<step>``
(resumable the same way: a step already run trains nothing again; the steps reach 0 without a gap, so
that each cell's best is chosen among every rung between). ``rates.md`` there compares the rates cell by
cell on validation (the curve's questions at each run's tested check: the split a choice is made on),
names each cell's best, flags a best at the outermost rate tried (the grid should grow: rerun with one
more step that way), and sets each family's change from its fewest to its most tokens (test) under the
sweep's rate beside the same change under each budget's best rate: whether the budget effect depends on
the rate choice. With two seeds these are estimates to read, not tests.
Options after the script's own go to the sweep (as ``horizon``'s) and must be those the sweep ran with.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import numpy as np

from experiments.token_budget import horizon, tune
from experiments.token_budget import sweep as tb


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--main", default="results/token_budget/hard", help="the finished sweep (setup.json, runs.csv, curves.json)")
    add("--out", default=None, help="output folder (default: MAIN/rates)")
    add("--families", default="", help="comma-separated connector names (default: every main-table family but blind)")
    add("--seeds", default="0,1", help="comma-separated seeds (of those the sweep ran)")
    add("--steps_away", default="-1,1", help="comma-separated ladder steps from each family's lr (-1: next smaller)")
    add("--workers", type=int, default=None, help="as token_budget.py's")
    add("--report", action="store_true", help="train nothing: rates.md again from the finished sweeps")
    args, passthrough = parser.parse_known_args(argv)
    args.parser = parser
    try:
        args.steps_away = sorted({int(k) for k in args.steps_away.split(",") if k})
        args.seeds = [int(s) for s in args.seeds.split(",") if s]
    except ValueError:
        parser.error(f"--steps_away {args.steps_away!r} / --seeds {args.seeds!r}: comma-separated integers, e.g. -1,1")
    if 0 in args.steps_away or not args.steps_away:
        parser.error("--steps_away: nonzero ladder steps, e.g. -1,1 (0 is the sweep's own rate, which it ran)")
    gap = [k - (1 if k > 0 else -1) for k in args.steps_away if abs(k) > 1 and k - (1 if k > 0 else -1)
           not in args.steps_away]
    if gap:
        parser.error(f"--steps_away {','.join(map(str, args.steps_away))}: include {gap[0]} (each cell's best is "
                     "chosen among the rates run, so a rung between would be left out), e.g. --steps_away=-2,-1,1.")
    return args, passthrough


def step_rate(lr: float, steps: int) -> float:
    """``lr`` moved ``steps`` rungs along the 1-3-10 ladder (negative: smaller)."""
    for _ in range(abs(steps)):
        lr = tune.next_rate(lr, steps > 0)
    return lr


def folder(out: pathlib.Path, steps: int) -> pathlib.Path:
    return out / f"lr_{steps:+d}"


def val_at_check(curves: dict, row: dict) -> float | None:
    """A run's validation accuracy (the curve's questions) at the check it is tested at (``best_step``)."""
    curve = curves.get(f"{row['family']}|{row['tokens']}|{row['variant']}|{row['seed']}")
    at = [acc for step, acc in curve or () if step == int(row["best_step"])]
    return float(at[0]) if at else None


def runs(directory: pathlib.Path, seeds: list[int], families) -> dict:
    """``{(family, tokens): {seed: (validation at the tested check, test accuracy)}}`` of a sweep's main table,
    ``families``' cells only."""
    rows = tb.report.read_runs(directory / "runs.csv")
    curves = json.loads((directory / "curves.json").read_text())
    out = {}
    for r in rows:
        if r["status"] == "ok" and r["variant"] == "" and r["family"] in families and int(r["seed"]) in seeds:
            out.setdefault((r["family"], int(r["tokens"])), {})[int(r["seed"])] = (val_at_check(curves, r),
                                                                                    float(r["accuracy"]))
    return out


def compare(by_step: dict, rates: dict, seeds: list[int], min_delta: float) -> list[str]:
    """``rates.md``'s tables from ``by_step`` (``{ladder step: runs(...)}``, 0 the sweep's own) and
    ``rates`` (``{family: {ladder step: lr}}``)."""
    steps = sorted(by_step)
    lines = [f"Validation exact match in % at each run's tested check (the curve's questions), mean over seeds "
             f"{', '.join(map(str, seeds))} (the seeds every rate ran); the sweep's rate in bold. best − sweep's: "
             "the best rate's lead; edge: the best is the outermost rate tried and leads its neighbour by at least "
             f"{100 * min_delta:g} points (the ladder should go one step further).", "",
             "| connector | tokens | seeds | " + " | ".join(f"lr {k:+d}" if k else "sweep's lr" for k in steps)
             + " | best lr | best − sweep's | edge |", "|---|---:|---:|" + "---:|" * (len(steps) + 3)]
    best, used = {}, {}  # {(family, tokens): ladder step chosen on validation}, {(family, tokens): seeds}
    for family, tokens in sorted(by_step[0]):
        cell = {k: by_step[k].get((family, tokens), {}) for k in steps}
        common = [s for s in seeds if all(s in c and c[s][0] is not None for c in cell.values())]
        if not common:
            lines.append(f"| {family} | {tokens} | 0 | " + " | ".join("" for _ in steps) + " | not all rates ran | | |")
            continue
        val = {k: float(np.mean([c[s][0] for s in common])) for k, c in cell.items()}
        top = max(steps, key=lambda k: (round(val[k], 9), -abs(k)))
        best[(family, tokens)], used[(family, tokens)] = top, common
        inner = top - 1 if top > 0 else top + 1
        edge = top in (steps[0], steps[-1]) and top != 0 and val[top] >= val.get(inner, val[0]) + min_delta
        shown = [f"**{100 * val[k]:.1f}**" if k == 0 else f"{100 * val[k]:.1f}" for k in steps]
        lines.append(f"| {family} | {tokens} | {len(common)} | {' | '.join(shown)} | {rates[family][top]:g} | "
                     f"{100 * (val[top] - val[0]):+.1f} | {'yes' if edge else ''} |")
    lines += ["", "Each family's change from its fewest to its most tokens, test exact match in % (mean over the "
              "seeds above): at the sweep's rate, and at the rate each budget's validation chose.", "",
              "| connector | tokens | at the sweep's lr | at each budget's best lr | same sign |",
              "|---|---|---:|---:|---|"]
    for family in sorted({f for f, _ in best}):
        counts = sorted(t for f, t in best if f == family)
        if len(counts) < 2:
            continue
        lo, hi = counts[0], counts[-1]

        def test_acc(cell, k):
            return float(np.mean([by_step[k][cell][s][1] for s in used[cell]]))

        same = test_acc((family, hi), 0) - test_acc((family, lo), 0)
        tuned = test_acc((family, hi), best[(family, hi)]) - test_acc((family, lo), best[(family, lo)])
        lines.append(f"| {family} | {lo} → {hi} | {100 * same:+.1f} | {100 * tuned:+.1f} | "
                     f"{'yes' if np.sign(round(same, 9)) == np.sign(round(tuned, 9)) else 'no'} |")
    return lines


def preflight(setup: dict, passthrough: list[str]) -> list[str]:
    """The settings in which the sweep the options ``passthrough`` would run differs from the finished
    one's ``setup`` (its LM, stages, tokenizer, plan): checked before anything trains, as the rate
    sweeps' own setup.json is compared with the main one's only once they have finished."""
    args = tb.parse_args([*passthrough, "--out", "/nonexistent"])
    plan = {"batch_size": args.batch_size, "eval_every": args.eval_every, "curve_questions": args.curve_questions,
            "min_delta": args.min_delta, "patience": args.patience}
    out = [k for k in ("stage0_lr", "stage0_steps", "stage1_steps", "tokenizer") if setup.get(k) != getattr(args, k)]
    out += ["lm"] if setup.get("lm") != args.lm else []
    return out + [f"plan.{k}" for k, v in plan.items() if setup["plan"].get(k) != v]


def main(argv=None) -> pathlib.Path:
    args, passthrough = parse_args(argv)
    main_dir = pathlib.Path(args.main)
    out = pathlib.Path(args.out) if args.out else main_dir / "rates"
    if not all((main_dir / name).is_file() for name in ("setup.json", "runs.csv", "curves.json")):
        args.parser.error(f"{main_dir} holds no finished sweep (no setup.json / runs.csv / curves.json); run python -m "
                          "experiments.token_budget to its end first.")
    setup = json.loads((main_dir / "setup.json").read_text())
    if setup.get("tune_each_budget"):
        args.parser.error(f"the sweep in {main_dir} tuned every budget on its own (--tune_each_budget): there is no "
                          "rate chosen at one budget to check.")
    rows = [r for r in tb.report.read_runs(main_dir / "runs.csv") if r["status"] == "ok" and r["variant"] == ""
            and r["family"] != tb.BLIND]
    families = [f for f in args.families.split(",") if f] or list(dict.fromkeys(r["family"] for r in rows))
    unknown = [f for f in families if f not in setup["chosen"] or f not in {r["family"] for r in rows}]
    if unknown:
        args.parser.error(f"--families {unknown}: the sweep in {main_dir} has main-table runs and a chosen rate for "
                          f"{sorted({r['family'] for r in rows} & set(setup['chosen']))}.")
    missing = sorted(set(args.seeds) - {int(s) for s in setup["seeds"]})
    if missing:
        args.parser.error(f"--seeds {missing}: the sweep in {main_dir} ran seeds {setup['seeds']}.")
    budgets = ",".join(dict.fromkeys(str(r["budget"]) for r in rows if r["family"] in families))
    rates = {f: {k: step_rate(setup["chosen"][f][0], k) for k in [0, *args.steps_away]} for f in families}
    argv = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--report"]
    differ = [] if args.report else preflight(setup, passthrough)
    if differ:
        args.parser.error(f"the options after this script's own would train under other settings than the sweep in "
                          f"{main_dir} ({differ}): pass the options it ran with (its setup.json 'command').")
    for k in args.steps_away if not args.report else ():
        tower = ["--tower", str(main_dir / "tower")] if "--tower" not in passthrough else []
        tb.main([*passthrough, *tower, "--out", str(folder(out, k)), "--families", ",".join(families), "--budgets",
                 budgets, "--seeds", ",".join(map(str, args.seeds)), "--steps", str(setup["plan"]["max_steps"]),
                 "--param_budget", "0", "--encoder_budgets", "", "--no_blind",
                 "--chosen", ",".join(f"{f}={rates[f][k]:g}/{setup['chosen'][f][1]}" for f in families),
                 *(["--workers", str(args.workers)] if args.workers else [])])
    by_step = {0: runs(main_dir, args.seeds, families)}
    for k in args.steps_away:
        if not (folder(out, k) / "setup.json").is_file():
            args.parser.error(f"--report: {folder(out, k)} holds no finished sweep; run without --report first.")
        differ = horizon.differences(setup, json.loads((folder(out, k) / "setup.json").read_text()))
        if differ:
            sys.exit(f"the runs in {folder(out, k)} differ from the sweep in {main_dir} in {differ}: pass "
                     "token_budget.py the options the sweep ran with (its setup.json 'command'); nothing compared.")
        by_step[k] = runs(folder(out, k), args.seeds, families)
    first = json.loads((folder(out, args.steps_away[0]) / "setup.json").read_text())
    date = first.get("date", time.strftime("%Y-%m-%d"))
    lines = [f"# Each family's learning rate at every budget: {main_dir} ({date})", "",
             f"`python -m experiments.token_budget.rates {' '.join(argv)}` (each rate's runs: `lr_*/`). The sweep "
             f"chose each rate at {setup['tune_budget']} tokens on seed {setup['tune_seed']}: "
             + ", ".join(f"{f} {setup['chosen'][f][0]:g} (warmup {setup['chosen'][f][1]})" for f in families) + ".", "",
             *compare(by_step, rates, args.seeds, setup["plan"]["min_delta"])]
    out.mkdir(parents=True, exist_ok=True)
    (out / "rates.md").write_text("\n".join(lines) + "\n")
    print((out / "rates.md").read_text())
    return out


if __name__ == "__main__":
    tb.xla_flags.use_vitmm_defaults()
    from experiments.common import entry

    entry.quiet()  # the libraries' routine warnings off the console; --verbose keeps them
    main()
