"""What holds across scene layouts: finished token-budget sweeps' tests side by side.

    python -m experiments.token_budget.layouts easy=results/token_budget hard=results/token_budget/hard \\
        [medium=results/token_budget/medium] [--out results/token_budget/layouts.md]

The sweeps must be finished and made under the same settings (``layout_checks``: the same LM,
plan, stages, tokenizer, tuning protocol and image grid; the data, the tower and the chosen rates
differ by design). Each sweep is cut to the runs every sweep finished: the (family, token
count, seed) triples they share, main rows and blind (no equal-parameter or encoder-side rows). On
that cut, each layout's tests are the ones its own report makes (``report.verdict_tests``: each cell
against blind, each family's gain from its fewest to its most tokens, the best against the worst
family, the analysis of variance, Honeybee's groups, fine detail), corrected together (Holm) within
the layout, as its Verdicts table does. The table puts the tests the layouts share in one row, each
layout's verdict tag in its column, and says what holds across them: the same sign shown in every
layout, opposite signs shown, or shown in some layouts only (a best − worst test holds only where the
layouts' best and worst are the same pair). It adds no test of its own.
"""

from __future__ import annotations

import argparse
import pathlib
import re

from experiments.token_budget import layout_checks, report
from vitmm.study import verdicts


def shared_design(sweeps: dict[str, list[dict]]) -> dict[str, list[dict]]:
    """Each sweep's finished main and blind rows of the (family, token count, seed) runs all of them finished."""
    def cells(rows):
        return {(r["family"], str(r["tokens"]), str(r["seed"])) for r in rows
                if r["status"] == "ok" and not r["variant"]}

    common = set.intersection(*(cells(rows) for rows in sweeps.values()))
    return {name: [r for r in rows if r["status"] == "ok" and not r["variant"]
                   and (r["family"], str(r["tokens"]), str(r["seed"])) in common] for name, rows in sweeps.items()}


def _key(name: str) -> tuple[str, str]:
    """A test's name without the pair chosen after seeing the means, and that pair."""
    m = re.match(r"(.*) \((.*)\)$", name)
    return (m.group(1), m.group(2)) if m and name.startswith("best − worst") else (name, "")


def across(tests: list[verdicts.Test | None]) -> str:
    """What the layouts' verdicts on one test say together."""
    shown = [t for t in tests if t is not None and t.word == "shown"]
    signs = {t.estimate > 0 for t in shown}
    if len(signs) > 1:
        return "opposite signs shown"
    if len(shown) == len(tests):
        return "holds in every layout"
    return "shown in none" if not shown else f"shown in {len(shown)} of {len(tests)}"


def compare(sweeps: dict[str, list[dict]]) -> str:
    """The Markdown table (``--out``'s content) of sweeps ``{layout: runs.csv rows}``."""
    cut = shared_design(sweeps)
    per_layout = {}
    for name, rows in cut.items():
        tests = verdicts.correct(report.verdict_tests(report.summarise(rows)))
        per_layout[name] = {_key(t.name)[0]: (t, _key(t.name)[1]) for t in tests}
    names = list(dict.fromkeys(k for tests in per_layout.values() for k in tests))
    shared = [n for n in names if all(n in tests for tests in per_layout.values())]
    any_rows = next(iter(cut.values()))
    families = sorted({r["family"] for r in any_rows if r["family"] != report.BLIND})
    tokens = sorted({int(r["tokens"]) for r in any_rows if r["family"] != report.BLIND})
    seeds = sorted({int(r["seed"]) for r in any_rows})
    sizes = ", ".join(f"{name} {len(tests)}" for name, tests in per_layout.items())
    lines = [f"The tests the layouts share, on the runs every sweep finished: {', '.join(families)} at "
             f"{', '.join(map(str, tokens))} tokens and blind, seeds {', '.join(map(str, seeds))}. Each layout's "
             f"tests are corrected together within the layout (Holm; {sizes} tests), as its own report's "
             "Verdicts table does on its full design; this table adds no test.", "",
             "| test | " + " | ".join(per_layout) + " | across layouts |", "|---|" + "---|" * (len(per_layout) + 1)]
    for n in shared:
        found = [per_layout[layout][n] for layout in per_layout]
        cells = [f"`{verdicts.tag(t)}`" + (f" ({pair})" if pair else "") for t, pair in found]
        pairs = {pair for _, pair in found}
        together = across([t for t, _ in found]) if len(pairs) == 1 else "different pairs: not one test"
        lines.append(f"| {n} | " + " | ".join(cells) + f" | {together} |")
    only = [n for n in names if n not in shared]
    if only:
        lines += ["", "Tests only some layouts make (e.g. a class test whose families one cut lacks): "
                  + "; ".join(only) + "."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweeps", nargs="+", metavar="LAYOUT=FOLDER", help="a finished sweep per layout")
    parser.add_argument("--out", default=None, help="a Markdown file for the table (default: print it)")
    args = parser.parse_args(argv)
    pairs = [s.split("=", 1) for s in args.sweeps]
    if len(pairs) < 2 or any(len(p) != 2 for p in pairs):
        parser.error("name two or more sweeps as LAYOUT=FOLDER, e.g. easy=results/token_budget.")
    if (why := layout_checks.distinct(pairs)) is not None:
        parser.error(why)
    loaded = {name: layout_checks.load(pathlib.Path(folder)) for name, folder in pairs}
    layout_checks.check_same({name: setup for name, (_, setup) in loaded.items()})
    text = compare({name: rows for name, (rows, _) in loaded.items()})
    if args.out:
        pathlib.Path(args.out).write_text(text)
        print(f"wrote {args.out}")
    else:
        print(text, end="")
    return text


if __name__ == "__main__":
    main()
