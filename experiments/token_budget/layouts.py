"""What holds across scene layouts: finished token-budget sweeps' tests side by side.

    python -m experiments.token_budget.layouts easy=results/token_budget hard=results/token_budget/hard \\
        [medium=results/token_budget/medium] [--out results/token_budget/layouts.md]

The sweeps must be finished and made under the same settings (``layout_checks``: the same LM,
plan, stages, tokenizer, tuning protocol and image grid; the data, the tower and the chosen rates
differ by design). Each sweep is cut to the runs every sweep finished: the (family, token count,
seed) triples they share, main rows and blind (no equal-parameter or encoder-side rows); a cut
without blind, or with no run in common, is refused. On that cut each layout's tests are the ones
its report makes (``report.verdict_tests``: each cell against blind, each family's gain from its
fewest to its most tokens, the best against the worst family, the analysis of variance, Honeybee's
groups, fine detail) recomputed on the cut and corrected together (Holm) within the layout over the
cut's own number of tests. They are not its report's verdicts: the best − worst pair is chosen
among the cut's families, the analysis of variance and Honeybee's groups use the cut's families
only, and the correction counts the cut's tests, so the output lists, per layout, the verdicts whose
word (or chosen pair) differs from that layout's own report, and the tests its report makes that
the cut cannot. The table puts the tests the layouts share in one row, each layout's verdict tag in
its column, and says what holds across them: the same sign shown in every layout, opposite signs
shown, or shown in some layouts only (a best − worst test holds only where the layouts' best and
worst are the same pair). It adds no test of its own: "shown in 1 of 2" is not evidence that the
effect differs between the layouts (that needs a test of the difference, which none here makes).
"""

from __future__ import annotations

import argparse
import pathlib
import re

from experiments.token_budget import layout_checks, report
from vitmm.study import verdicts


def main_rows(rows: list[dict]) -> list[dict]:
    """A sweep's finished main and blind rows (no equal-parameter or encoder-side variants)."""
    return [r for r in rows if r["status"] == "ok" and not r["variant"]]


def shared_design(sweeps: dict[str, list[dict]]) -> dict[str, list[dict]]:
    """Each sweep's finished main and blind rows of the (family, token count, seed) runs all of them finished."""
    def cells(rows):
        return {(r["family"], str(r["tokens"]), str(r["seed"])) for r in main_rows(rows)}

    common = set.intersection(*(cells(rows) for rows in sweeps.values()))
    return {name: [r for r in main_rows(rows) if (r["family"], str(r["tokens"]), str(r["seed"])) in common]
            for name, rows in sweeps.items()}


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


def _tests(rows: list[dict]) -> dict[str, tuple[verdicts.Test, str]]:
    """The report's tests on ``rows``, corrected together, by name without the chosen pair."""
    tests = verdicts.correct(report.verdict_tests(report.summarise(rows)))
    return {_key(t.name)[0]: (t, _key(t.name)[1]) for t in tests}


def _seeds(seeds) -> str:
    return ", ".join(map(str, sorted(seeds)))


def _cells(rows: list[dict]) -> dict[tuple[str, int], set[int]]:
    """The seeds of each (family, token count) cell in ``rows``."""
    cells: dict[tuple[str, int], set[int]] = {}
    for r in rows:
        cells.setdefault((r["family"], int(r["tokens"])), set()).add(int(r["seed"]))
    return cells


def describe(rows: list[dict]) -> str:
    """The cells ``rows`` hold, e.g. ``pool at 16, 64 tokens; qformer at 4 tokens; and blind, seeds 0, 1``
    (a cell with other seeds named with them)."""
    cells = _cells(rows)
    groups: dict[tuple[int, ...], list[str]] = {}
    for family in sorted({f for f, _ in cells if f != report.BLIND}):
        groups.setdefault(tuple(sorted(t for f, t in cells if f == family)), []).append(family)
    parts = [f"{', '.join(fams)} at {', '.join(map(str, tokens))} tokens" for tokens, fams in groups.items()]
    seed_sets = [frozenset(s) for s in cells.values()]
    usual = max(set(seed_sets), key=seed_sets.count)
    other = [f"{f}@{t}: {_seeds(s)}" for (f, t), s in sorted(cells.items()) if s != usual]
    blind = "and blind, " if any(f == report.BLIND for f, _ in cells) else "no blind, "
    return "; ".join(parts) + f"; {blind}seeds {_seeds(usual)}" + (f" (except {'; '.join(other)})" if other else "")


def design(rows: list[dict]) -> str:
    """Which of the cut's families the analysis of variance and Honeybee's groups use."""
    anova = report.factor_test(report.summarise(rows))
    families = {r["family"] for r in rows}
    groups = [", ".join(f for f in group if f in families) or "none"
              for group in (report.LOCALITY, report.LEARNED_QUERY)]
    return ((f"The analysis of variance uses {', '.join(anova['families'])} (the families at every token count)"
             if anova else "No analysis of variance on this cut") + f"; Honeybee's groups: {groups[0]} (locality-"
            f"preserving) against {groups[1]} (learned-query), those of them at each token count.")


def _dropped(rows: list[dict], kept: list[dict]) -> str:
    """What the cut took from a sweep's main and blind rows: whole families, cells and runs."""
    full, cut = _cells(main_rows(rows)), _cells(kept)
    families = sorted({f for f, _ in full} - {f for f, _ in cut})
    lost = [f"{f}@{t}" for f, t in sorted(full) if (f, t) not in cut and f not in families]
    seeds = [f"{f}@{t} seeds {_seeds(full[f, t] - s)}" for (f, t), s in sorted(cut.items()) if full[f, t] - s]
    parts = ([f"families {', '.join(families)}"] if families else []) + ([f"cells {', '.join(lost)}"] if lost else [])
    return "; ".join(parts + ([f"runs {'; '.join(seeds)}"] if seeds else [])) or "nothing"


def compare(sweeps: dict[str, list[dict]], data: dict[str, str] | None = None) -> str:
    """The Markdown table (``--out``'s content) of sweeps ``{layout: runs.csv rows}`` (``data``: each
    layout's scenes, named in the header)."""
    cut = shared_design(sweeps)
    any_rows = next(iter(cut.values()))
    if not any(r["family"] != report.BLIND for r in any_rows):
        raise SystemExit("the sweeps share no finished (family, token count, seed) run: nothing to compare.")
    if not any(r["family"] == report.BLIND for r in any_rows):
        raise SystemExit("the sweeps share no finished blind run: every '− blind' test and the learned-seed bar need "
                         "it, so layouts compares no cut without blind.")
    per_layout = {name: _tests(rows) for name, rows in cut.items()}
    names = list(dict.fromkeys(k for tests in per_layout.values() for k in tests))
    shared = [n for n in names if all(n in tests for tests in per_layout.values())]
    sizes = ", ".join(f"{name} {len(tests)}" for name, tests in per_layout.items())
    lines = [f"The tests the layouts share, on the runs every sweep finished: {describe(any_rows)}. Each layout's "
             f"tests are its report's tests recomputed on this cut and corrected together within the layout (Holm; "
             f"{sizes} tests: each layout's count on this cut): the best − worst pairs are chosen among the cut's "
             "families and the analysis of variance and Honeybee's groups use the cut's families only, so a verdict "
             "here is not its report's (those that differ are listed below the table); this table adds no test. "
             "A test shown in some layouts only is not shown to differ between them (no test here compares the "
             "layouts: a verdict can change with the noise alone); only opposite signs, each shown, say they differ."
             + f" {design(any_rows)}"
             + ("" if data is None else " Data: " + ", ".join(f"{name} {d}" for name, d in data.items()) + "."), "",
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
    lines += ["", "What the cut took from each sweep (besides its equal-parameter and encoder-side rows): "
              + "; ".join(f"{name}: {_dropped(sweeps[name], rows)}" for name, rows in cut.items()) + "."]
    for name, rows in sweeps.items():
        own = _tests(rows)  # its report's tests: equal-parameter and encoder-side rows' too
        lost = [n for n in own if n not in per_layout[name]]
        count = f" ({len(lost)} of its {len(own)})" if lost else ""
        lines += ["", f"Tests {name}'s report makes that this cut cannot{count}: " + ("; ".join(lost) or "none") + ".",
                  ""]
        lines += differs(name, per_layout[name], own)
    return "\n".join(lines) + "\n"


def differs(name: str, here: dict, own: dict) -> list[str]:
    """The lines naming the tests whose word (or chosen pair) on the cut differs from ``name``'s own report."""
    def cell(t, pair):
        return f"`{verdicts.tag(t)}`" + (f" ({pair})" if pair else "")

    out = []
    for n, (t, pair) in here.items():
        if n not in own:
            out.append(f"- {n}: here {cell(t, pair)}; its report makes no such test")
        elif own[n][0].word != t.word or own[n][1] != pair:
            out.append(f"- {n}: here {cell(t, pair)}; its report {cell(*own[n])}")
    head = (f"Verdicts here that differ from {name}'s own report (cite that report for its design, this table for "
            "the cut)")
    return [f"{head}: none."] if not out else [f"{head}:", "", *out]


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
    text = compare({name: rows for name, (rows, _) in loaded.items()},
                   {name: setup.get("data", "?") for name, (_, setup) in loaded.items()})
    if args.out:
        pathlib.Path(args.out).write_text(text)
        print(f"wrote {args.out}")
    else:
        print(text, end="")
    return text


if __name__ == "__main__":
    main()
