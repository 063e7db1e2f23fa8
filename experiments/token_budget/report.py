"""The token-budget sweep's numbers: mean ± 95% CI over seeds per (connector, budget, variant),
paired tests against blind, and the tests of the claims (Honeybee's groups, more tokens for fine
detail, budget against connector as an analysis of variance, the seeds that learn a kind).
``tables`` writes them as Markdown."""

from __future__ import annotations

import json
import pathlib

import numpy as np

from experiments.common.feature_vlm import BLIND
from vitmm.data import scenes
from vitmm.study import outputs, stats, verdicts

KINDS = scenes.QUESTION_KINDS


SPATIAL, GLOBAL = ("color_at", "shape_at", "relative"), ("exists", "count")
LOCALITY = ("pool", "pixel_shuffle", "patch_merger", "c_abstractor", "ldp")  # Honeybee's locality-preserving
LEARNED_QUERY = ("qwen_resampler", "perceiver", "qformer")  # learned queries attending to all patches
# A seed "learns" a kind when its test accuracy on it is this far above the blind cell's mean on that
# kind. Fixed (session 27) after seeing that colour-at-location is bimodal over seeds (~18% or 50-77%)
# and before the blind cell or most families had finished; ~8 binomial standard errors at ~1,000 questions.
LEARNED_MARGIN = 0.10
LATE = 0.75  # "late in training": past this share of the steps trained


def late_gain(curve: list) -> float:
    """Validation accuracy at the last check minus at the last check at or before ``LATE`` of the
    steps: what the final quarter of training still added (a run at its plateau adds ~0)."""
    end = curve[-1][0]
    return float(curve[-1][1] - [acc for step, acc in curve if step <= LATE * end][-1])


def peak_step(curve: list) -> int:
    """The step of the highest validation check (the earliest of equal ones). Not ``best_step``, the
    checkpoint a run is tested at: that moves only on a gain of at least ``min_delta``, so a run can
    still be reaching new, smaller highs after it."""
    return int(max(curve, key=lambda point: (point[1], -point[0]))[0])


def read_runs(path) -> list[dict]:
    """A sweep's ``runs.csv`` as rows (a CSV's empty variant and note read back as ""), each run's
    ``peak_step`` taken from the ``curves.json`` beside it where the CSV predates the column: the
    curve of the job whose runs the row reads (``setup.json``'s ``runs_of``: a row sized to the
    parameter budget at its default size reads the default row's), so that ``late`` judges every
    row by its highest check."""
    path = pathlib.Path(path)
    rows = outputs.read_rows(path)
    curves, setup = (path.parent / name for name in ("curves.json", "setup.json"))
    curves = json.loads(curves.read_text()) if curves.is_file() else {}
    jobs = json.loads(setup.read_text()).get("connectors", {}) if setup.is_file() else {}
    for r in rows:
        r["variant"], r["note"] = r["variant"] or "", r["note"] or ""
        row = f"{r['family']}|{r['tokens']}|{r['variant']}"
        runs_of = jobs.get(row, {}).get("runs_of")
        curve = curves.get(f"{'|'.join(map(str, runs_of)) if runs_of else row}|{r['seed']}")
        if r.get("peak_step") is None and curve:
            r["peak_step"] = peak_step(curve)
    return rows


def late(r: dict) -> bool:
    """Whether a run's highest validation check came after ``LATE`` of its steps (it may still be
    rising); runs stored without their curve fall back to ``best_step``."""
    step = r.get("peak_step")
    return float(r["best_step"] if step in (None, "") else step) > LATE * float(r["steps_trained"])


def summarise(rows: list[dict]) -> list[dict]:
    """Mean, std and 95% CI over seeds per (family, requested budget, variant); the question kinds
    the rows carry (none, for a study whose metric has no kinds)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["family"], r["budget"], r.get("variant", "")), []).append(r)
    out = []
    for rs in groups.values():
        first = rs[0]
        s = {k: first.get(k) for k in ("family", "budget", "tokens", "note", "lr", "warmup", "connector_params",
                                       "connector_mflops", "lm_mflops")}
        s["variant"] = first.get("variant", "")
        s["seeds"] = sum(r["status"] == "ok" for r in rs)
        ok = [r for r in rs if r["status"] == "ok"]
        for key in ("train_ms", "infer_ms"):  # cost: the median over seeds and its range
            values = [float(r[key]) for r in ok if r.get(key) not in (None, "")]
            s[key] = float(np.median(values)) if values else float("nan")
            s[key + "_range"] = (min(values), max(values)) if values else None
        kinds = [k for k in KINDS if f"acc_{k}" in first]
        for key in ("accuracy", *(f"acc_{k}" for k in kinds), "best_step", "steps_trained", "late_gain"):
            values = np.array([r[key] for r in ok if r.get(key) is not None], float)
            s[key] = float(values.mean()) if len(values) else float("nan")
            s[key + "_std"] = float(values.std(ddof=1)) if len(values) > 1 else 0.0
            s[key + "_ci"] = stats.ci95(values)
        s["by_seed"] = {int(r["seed"]): float(r["accuracy"]) for r in ok}
        s["kinds_by_seed"] = {int(r["seed"]): {k: float(r[f"acc_{k}"]) for k in kinds} for r in ok}
        s["late_best"] = sum(late(r) for r in ok if r.get("best_step") is not None)
        s["status"] = first["status"]
        out.append(s)
    blind = next((s for s in out if s["family"] == BLIND and s["status"] == "ok"), None)
    for s in out:
        s["vs_blind"] = paired_vs(s, blind) if blind is not None and s is not blind and s["status"] == "ok" else None
    return out


def paired_vs(s: dict, base: dict) -> tuple[float, float] | None:
    """``(mean difference, two-sided p)`` of a paired t-test over the seeds both cells ran (the data
    order is the same per seed, so the seeds pair); None with fewer than two shared seeds."""
    return stats.paired(s["by_seed"], base["by_seed"])


def chosen_pair(cells: list[dict]) -> tuple[dict, dict]:
    """The best and the worst of ``cells`` by mean accuracy over the seeds they all ran, so that an
    interim sweep's cell with fewer seeds is not chosen for its few seeds' luck (the paired tests
    compare shared seeds too); by each cell's own mean where they share no seed."""
    shared = set.intersection(*(set(s["by_seed"]) for s in cells))

    def mean(s: dict) -> float:
        return float(np.mean([s["by_seed"][k] for k in shared])) if shared else s["accuracy"]

    return max(cells, key=mean), min(cells, key=mean)


def ok_rows(summary, variant=None):
    return [s for s in summary if s["status"] == "ok" and (variant is None or s["variant"] == variant)]


def _kind_mean(s: dict, seed: int, kinds) -> float:
    return float(np.mean([s["kinds_by_seed"][seed][k] for k in kinds]))


def group_test(summary: list[dict], tokens: int, kinds) -> tuple[float, float, float] | None:
    """Honeybee's claim at ``tokens``: per seed, the mean accuracy on ``kinds`` of the
    locality-preserving families minus that of the learned-query families; the mean over seeds
    with its CI and the p of a t-test (paired by seed)."""
    rows = {s["family"]: s for s in ok_rows(summary, "") if s["tokens"] == tokens}
    loc, query = [rows[f] for f in LOCALITY if f in rows], [rows[f] for f in LEARNED_QUERY if f in rows]
    if not loc or not query:
        return None
    seeds = sorted(set.intersection(*(set(s["kinds_by_seed"]) for s in loc + query)))
    return stats.one_sample([np.mean([_kind_mean(s, k, kinds) for s in loc])
                        - np.mean([_kind_mean(s, k, kinds) for s in query]) for k in seeds])


def family_group_test(summary: list[dict], tokens: int, kinds) -> tuple[tuple, float, int, int] | None:
    """Honeybee's claim at ``tokens`` with the families as the unit: each family's mean over seeds
    on ``kinds``, the locality-preserving against the learned-query ones. ``((difference, 95% CI,
    Welch p), Mann–Whitney p, families in each group)``; None with fewer than two in a group."""
    rows = {s["family"]: s for s in ok_rows(summary, "") if s["tokens"] == tokens}
    means = {f: np.mean([_kind_mean(s, k, kinds) for k in s["kinds_by_seed"]]) for f, s in rows.items()}
    loc, query = [means[f] for f in LOCALITY if f in means], [means[f] for f in LEARNED_QUERY if f in means]
    welch = stats.welch(loc, query)
    return None if welch is None else (welch, stats.mann_whitney(loc, query), len(loc), len(query))


def detail_test(summary: list[dict]) -> tuple[float, float, float] | None:
    """"More tokens help fine-detail kinds more": per seed, the mean over families of (gain on the
    spatial kinds − gain on the global kinds) from each family's fewest to its most tokens."""
    by_family: dict[str, dict[int, dict]] = {}
    for s in ok_rows(summary, ""):
        if s["family"] != BLIND:
            by_family.setdefault(s["family"], {})[int(s["tokens"])] = s
    pairs = [(c[min(c)], c[max(c)]) for c in by_family.values() if len(c) > 1]
    if not pairs:
        return None
    seeds = sorted(set.intersection(*(set(s["kinds_by_seed"]) for pair in pairs for s in pair)))
    return stats.one_sample([np.mean([(_kind_mean(hi, k, SPATIAL) - _kind_mean(lo, k, SPATIAL))
                                 - (_kind_mean(hi, k, GLOBAL) - _kind_mean(lo, k, GLOBAL)) for lo, hi in pairs])
                        for k in seeds])


def factor_test(summary: list[dict]) -> dict | None:
    """MM1's and TokenPacker's question, budget or connector, as a two-way analysis of variance
    with seeds as blocks (a seed shares its data order and stage-0 LM across cells) on the balanced
    part of the main table: the families that ran at every requested budget, over the seeds all of
    them ran. Returns each source's sum of squares, degrees of freedom, share of the total (η²), F
    and p against the residual (family × budget is tested as well, so a budget effect that differs
    by family shows), and the budget and family marginal means in points."""
    order = lambda b: (not b.isdigit(), int(b) if b.isdigit() else 0)
    cells, reached = {}, set()  # a budget that reaches a count a smaller one did (all = 9 on 4×4): its runs, once
    for s in sorted(ok_rows(summary, ""), key=lambda s: order(str(s["budget"]))):
        if s["family"] != BLIND and (s["family"], int(s["tokens"])) not in reached:
            reached.add((s["family"], int(s["tokens"])))
            cells[(s["family"], str(s["budget"]))] = s
    budgets = sorted({b for _, b in cells}, key=order)
    families = [f for f in dict.fromkeys(f for f, _ in cells) if all((f, b) in cells for b in budgets)]
    if len(families) < 2 or len(budgets) < 2:
        return None
    seeds = sorted(set.intersection(*(set(cells[(f, b)]["by_seed"]) for f in families for b in budgets)))
    if len(seeds) < 2:
        return None
    y = np.array([[[cells[(f, b)]["by_seed"][k] for k in seeds] for b in budgets] for f in families]) * 100
    anova = stats.anova_blocked(y, ("family", "budget"))
    return {"families": families, "budgets": budgets, "seeds": seeds,
            "budget_means": dict(zip(budgets, anova["means"]["budget"], strict=True)),
            "family_means": dict(zip(families, anova["means"]["family"], strict=True)), "sources": anova["sources"]}


def learned(summary: list[dict]) -> dict | None:
    """Per cell (not blind) and spatial kind, the seeds that learn the kind: test accuracy at least
    ``LEARNED_MARGIN`` above the blind cell's mean on it. None until the blind cell has a seed. A
    cell is a job: two requested budgets that reach one token count share its runs, counted once."""
    blind = next((s for s in ok_rows(summary) if s["family"] == BLIND), None)
    if blind is None:
        return None
    bar = {k: blind[f"acc_{k}"] + LEARNED_MARGIN for k in SPATIAL}
    cells = {(s["family"], s["tokens"], s["variant"]): s for s in ok_rows(summary) if s["family"] != BLIND}
    return {"bar": bar, "cells": [(s, {k: sum(acc[k] >= bar[k] for acc in s["kinds_by_seed"].values())
                                       for k in SPATIAL}) for s in cells.values()]}



def verdict_tests(summary: list[dict]) -> list[verdicts.Test]:
    """Every test the report makes, in points (the analysis of variance: shares in %), uncorrected:
    each cell against blind, each family's gain from its fewest to its most tokens, the best
    against the worst family at each token count, each equal-parameter row against its default size
    and the spread at equal parameters, each encoder-side row against the best connector side and
    against ``pool`` at its count, the analysis of variance, Honeybee's groups with seeds and with
    families as the unit, and fine detail. ``verdicts.correct`` corrects them as one family; a
    comparison chosen after seeing the means first pays for the choice (``add``'s ``chosen_from``)."""
    tests: list[verdicts.Test] = []

    def add(name, test, unit="seeds", note="", scale=100.0, chosen_from=1):
        """``chosen_from``: a comparison picked among that many after seeing the means: its p is
        multiplied by their number (Bonferroni for the choice) before the report's correction."""
        if test is not None:
            est, ci, p = (test[0], None, test[1]) if len(test) == 2 else test
            if chosen_from > 1:
                p, note = min(1.0, chosen_from * p), f"{note}: p × {chosen_from} (Bonferroni for the choice)"
            tests.append(verdicts.Test(name, scale * est, None if ci is None else scale * ci, p, unit, note))

    cells: dict[tuple, dict] = {}  # a cell is a job: two requested budgets that reach one token count
    for s in ok_rows(summary):  # (9 and all on a 4×4 grid) share its runs, tested once
        cells.setdefault((s["family"], int(s["tokens"]), s["variant"]), s)
    ok = [s for s in cells.values() if s["family"] != BLIND]
    blind = next((s for s in cells.values() if s["family"] == BLIND), None)
    main = [s for s in ok if s["variant"] == ""]
    default = {(s["family"], s["tokens"]): s for s in main}
    for s in ok if blind is not None else ():
        same = default.get((s["family"], s["tokens"]))
        if s["variant"] and same is not None and same["by_seed"] == s["by_seed"]:
            continue  # a variant that is the default cell (its size already the default): the same runs, one test
        add(f"{_cell(s)} − blind", _with_ci(s, blind))
    by_family: dict[str, dict[int, dict]] = {}
    for s in main:
        by_family.setdefault(s["family"], {})[int(s["tokens"])] = s
    for family, cells in by_family.items():
        if len(cells) > 1:
            lo, hi = min(cells), max(cells)
            add(f"{family} {lo} → {hi} tokens", _with_ci(cells[hi], cells[lo]))
    for tokens in sorted({int(s["tokens"]) for s in main}):
        at = [s for s in main if int(s["tokens"]) == tokens]
        if len(at) > 1:
            best, worst = chosen_pair(at)
            add(f"best − worst family at {tokens} tokens ({best['family']} − {worst['family']})",
                _with_ci(best, worst), note="the pair chosen after seeing the means",
                chosen_from=len(at) * (len(at) - 1) // 2)
    sized = [s for s in ok if s["variant"].startswith("params")]
    for s in sized:
        base = default.get((s["family"], s["tokens"]))
        if base is not None and base["connector_params"] != s["connector_params"]:
            add(f"{_cell(s)} − default size", _with_ci(s, base))
    if len(sized) > 1:
        best, worst = chosen_pair(sized)
        add(f"best − worst at equal parameters ({best['family']} − {worst['family']})", _with_ci(best, worst),
            note="the pair chosen after seeing the means", chosen_from=len(sized) * (len(sized) - 1) // 2)
    for s in [s for s in ok if s["variant"].startswith(("image", "patch"))]:
        side = [c for c in main if c["tokens"] == s["tokens"]]
        if side:
            best = chosen_pair(side)[0]
            add(f"{s['variant']} − best connector at {s['tokens']} tokens ({best['family']})", _with_ci(s, best),
                note="the connector chosen after seeing the means", chosen_from=len(side))
        pool = default.get(("pool", s["tokens"]))
        if pool is not None:
            add(f"{s['variant']} − pool at {s['tokens']} tokens", _with_ci(s, pool))
    anova = factor_test(summary)
    if anova is not None:
        for name in ("budget", "family", "family × budget"):
            src = anova["sources"][name]
            if src["p"] is not None:
                tests.append(verdicts.Test(f"analysis of variance: {name} (share of the variance, %)",
                                           100 * src["eta2"], None, src["p"]))
    has_kinds = bool(main) and all(set(SPATIAL + GLOBAL) <= set(by_kind) for s in main
                                   for by_kind in s["kinds_by_seed"].values())
    counts = sorted({int(s["tokens"]) for s in main}) if has_kinds else []  # the class tests need every kind
    for tokens in counts:
        for label, kinds in (("spatial", SPATIAL), ("global", GLOBAL)):
            add(f"Honeybee at {tokens} tokens, {label} kinds: locality-preserving − learned-query",
                group_test(summary, tokens, kinds), note="mean over the families of each group, per seed")
            fam = family_group_test(summary, tokens, kinds)
            if fam is not None:
                (diff, ci, p), mw, n_loc, n_query = fam
                add(f"Honeybee at {tokens} tokens, {label} kinds, families as the unit", (diff, ci, p),
                    unit="families", note=f"Welch's t over {n_loc} against {n_query} family means; "
                                          f"Mann–Whitney p {mw:.2g}")
    if has_kinds:
        add("more tokens help fine detail more (spatial gain − global gain, fewest to most tokens)",
            detail_test(summary))
    return tests


def _cell(s: dict) -> str:
    return f"{s['family']}@{s['tokens']}" + (f" ({s['variant']})" if s["variant"] else "")


def _with_ci(a: dict, b: dict) -> tuple[float, float, float] | None:
    """``(mean difference, 95% CI, p)`` of ``a`` − ``b``, paired by seed."""
    seeds = sorted(set(a["by_seed"]) & set(b["by_seed"]))
    return stats.one_sample([a["by_seed"][k] - b["by_seed"][k] for k in seeds])
