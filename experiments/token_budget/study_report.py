"""The Markdown report of a token-budget study on any inputs (``study.py``): the tuning grid, means ±
95% CIs over seeds with each row's test against blind (or, without a blind row, every pair of
families), the costs per cell, for exact-match metrics with question kinds the sweep's spread and
claim tests (``report.py``, ``tables.py``), and a Verdicts table of every test the report makes,
corrected together (Holm), whose adjusted p the rows' lines print (a metric where lower is better:
no Verdicts table, the rows' tests Holm-adjusted among themselves)."""

from __future__ import annotations

import numpy as np

from vitmm.study import stats, verdicts

BLIND = "blind"  # the no-image row (``experiments.common.feature_vlm.BLIND``, which imports JAX)


def report(study, tuned: list[dict], rows: list[dict], chosen: dict, unreachable: list) -> str:
    """The study's Markdown: the tuning grid, the table of means ± 95% CIs with the paired test
    against blind (Holm-adjusted across the table) and the costs, and, for exact-match metrics with
    question kinds, the token-budget sweep's spread and claim tests."""
    from experiments.token_budget import report as tbr  # JAX, through the sweep's feature runs
    from experiments.token_budget import tables

    lrs = sorted({float(r["lr"]) for r in tuned})
    batch = (rows or tuned)[0]["batch"] if rows or tuned else "?"
    lines = [study.description.format(steps=study.steps, batch=batch), ""]
    if tuned:
        lines += [f"Learning rate per family: validation {study.metric_label} (%) at {study.tune.budget} tokens, "
                  f"seed {study.seeds[0]} (the chosen one in bold):", "",
                  "| family | " + " | ".join(f"{lr:g}" for lr in lrs) + " |", "|---|" + "---:|" * len(lrs)]
        for f in dict.fromkeys(r["family"] for r in tuned):
            acc = {float(r["lr"]): 100 * float(r["accuracy"]) for r in tuned if r["family"] == f}
            lines.append(f"| {f} | " + " | ".join(("**{:.1f}**" if chosen.get(f) == lr else "{:.1f}").format(acc[lr])
                                                  if lr in acc else "" for lr in lrs) + " |")
    kinds = tuple(study.kinds)
    grid = [dict(r, seed=int(r["seed"]), tokens=int(r["tokens"]), budget=int(r["budget"]), variant="", status="ok",
                 **{k: float(r[k]) for k in ("accuracy", *(f"acc_{k}" for k in kinds))}) for r in rows]
    if grid:
        summary = sorted(tbr.summarise(grid), key=lambda s: (s["family"] == tbr.BLIND, s["family"], s["tokens"]))
        has_blind = any(x["family"] == tbr.BLIND for x in summary)
        vs = "; vs blind: t-test paired by seed" if has_blind else ""
        if study.examples_key:
            intro = (f"Test questions ({int(grid[0]['qa_examples'])}, the same for every run), mean ± 95% CI over "
                     f"seeds (%){vs}:")
        else:
            intro = f"{study.metric_label} (%), mean ± 95% CI over seeds{vs}:"
        columns = ["all", *kinds, *(["vs blind"] if has_blind else [])]
        lines += ["", intro, "", "| family | tokens | lr | seeds | " + " | ".join(columns) + " |",
                  "|---|---:|---:|---:|" + "---:|" * len(columns)]
        for x in summary:
            cells = [tables.mean_ci(x, "accuracy"), *(tables.mean_ci(x, f"acc_{k}") for k in kinds),
                     *([tables.diff_p(x["vs_blind"])] if has_blind else [])]
            lines.append(f"| {x['family']} | {x['tokens']} | {float(x['lr']):g} | {x['seeds']} | " + " | ".join(cells)
                         + " |")
        if kinds:
            lines += ["", *tables.spread_lines(summary), "", *tables.claim_lines(summary)]
        # Every test the report makes, corrected together (a metric where lower is better would name its worst
        # family "best": the rows' tests are then Holm-adjusted among themselves, with no Verdicts table).
        made = [*tbr.verdict_tests(summary), *([] if has_blind else _pair_tests(summary))]
        corrected = verdicts.correct(made) if made and study.higher_is_better else None
        tests = _holm_lines(summary, corrected) if has_blind else _pairwise_lines(summary, corrected)
        lines += ["", *tests, "", *_cost_lines(grid)] if tests else ["", *_cost_lines(grid)]
        if corrected is not None:
            lines += ["", *verdicts.table_lines(corrected, "**Verdicts.** The tables' tests (points; the analysis of "
                                                           "variance: shares of the variance in %).")]
    if unreachable:
        lines += ["", "Unreachable budgets: " + "; ".join(f"{f} at {b} ({note})" for f, b, note in unreachable) + "."]
    return "\n".join(lines) + "\n"


def _holm_lines(summary: list[dict], corrected: list | None = None) -> list[str]:
    """Every row against blind with its adjusted p: the report's own (``corrected``, its Verdicts
    table's tests, so each test has one adjusted p in the report), else Holm across these rows."""
    tests = [(s["family"], s["tokens"], s["vs_blind"]) for s in summary if s.get("vs_blind")]
    if not tests:
        return []
    if corrected is None:
        adjusted, what = stats.holm([t[2][1] for t in tests]), f"Holm-adjusted across the table's {len(tests)} tests"
    else:
        by_name = {t.name: t.p_adj for t in corrected}
        adjusted = [by_name[f"{f}@{t} − blind"] for f, t, _ in tests]
        what = f"Holm-adjusted with all {len(corrected)} tests of this report (as in the Verdicts table)"
    return [f"Every row against blind, {what}: " + ", ".join(f"{f}@{t} {100 * d:+.1f} (p={p:.2g})"
                                                            for (f, t, (d, _)), p in zip(tests, adjusted, strict=True))
            + "."]


def _pairs(summary: list[dict]) -> list[tuple[dict, dict, tuple]]:
    """Every pair of families at each token count with its paired test ``(mean difference, p)``."""
    by_tokens: dict = {}
    for s in summary:
        by_tokens.setdefault(s["tokens"], []).append(s)
    pairs = [(a, b, stats.paired(a["by_seed"], b["by_seed"])) for cells in by_tokens.values()
             for i, a in enumerate(cells) for b in cells[i + 1:]]
    return [(a, b, t) for a, b, t in pairs if t is not None]


def _pair_name(a: dict, b: dict) -> str:
    return f"{a['family']} − {b['family']} at {a['tokens']} tokens"


def _pair_tests(summary: list[dict]) -> list[verdicts.Test]:
    """Without a blind row, the pairs of families as the report's tests (points, paired by seed)."""
    return [verdicts.paired(_pair_name(a, b), a["by_seed"], b["by_seed"]) for a, b, _ in _pairs(summary)]


def _pairwise_lines(summary: list[dict], corrected: list | None = None) -> list[str]:
    """Without a blind row: every pair of families at each token count, the mean difference paired
    by seed and its p: the report's own adjusted p (``corrected``, its Verdicts table's tests), else
    Holm-adjusted across all the pairs."""
    pairs = _pairs(summary)
    if not pairs:
        return []
    if corrected is None:
        adjusted, what = stats.holm([t[1] for _, _, t in pairs]), f"Holm-adjusted across the {len(pairs)} pairs"
    else:
        by_name = {t.name: t.p_adj for t in corrected}
        adjusted = [by_name[_pair_name(a, b)] for a, b, _ in pairs]
        what = f"Holm-adjusted with all {len(corrected)} tests of this report (as in the Verdicts table)"
    return [f"Families paired by seed at each token count, {what}: "
            + ", ".join(f"{a['family']} − {b['family']} at {a['tokens']}: {100 * t[0]:+.1f} (p={p:.2g})"
                        for (a, b, t), p in zip(pairs, adjusted, strict=True)) + "."]


def _cost_lines(rows: list[dict]) -> list[str]:
    """Per cell: connector parameters, compiled FLOPs, ms per training example and peak memory
    (medians over seeds with their range)."""
    cells: dict = {}
    for r in rows:
        cells.setdefault((r["family"], r["tokens"]), []).append(r)
    lines = ["Cost per cell (medians over seeds [range]; ms per training example from the trainer's logged "
             "speed, peak host memory of the run's process):", "",
             "| family | tokens | connector params | connector MFLOPs | LM MFLOPs | ms/example | peak GiB |",
             "|---|---:|---:|---:|---:|---:|---:|"]

    def med(rs, key, fmt):
        v = [float(r[key]) for r in rs if r.get(key) not in (None, "")]
        return f"{fmt.format(np.median(v))} [{fmt.format(min(v))}–{fmt.format(max(v))}]" if v else ""

    for (family, tokens), rs in sorted(cells.items(), key=lambda kv: (kv[0][0] == BLIND, kv[0])):
        first = rs[0]
        params = f"{int(float(first['connector_params'])):,}" if first.get("connector_params") not in (None, "") else ""
        flops = [f"{float(first[k]):.3g}" if first.get(k) not in (None, "") else ""
                 for k in ("connector_mflops", "lm_mflops")]
        lines.append(f"| {family} | {tokens} | {params} | {flops[0]} | {flops[1]} | "
                     f"{med(rs, 'ms_per_example', '{:.1f}')} | {med(rs, 'peak_rss_gib', '{:.2f}')} |")
    return lines
