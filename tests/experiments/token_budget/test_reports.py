"""The committed reports are what the code writes from the committed runs (`--report`), so their
Verdicts tables cannot drift from the tests that make them; and the class test with families as
the unit on known numbers."""

import pathlib
import shutil

import numpy as np
import pytest

from experiments.token_budget import horizon, report, study, sweep

ROOT = pathlib.Path(__file__).resolve().parents[3]


def _copy(src: pathlib.Path, dst: pathlib.Path) -> pathlib.Path:
    dst.mkdir(parents=True)
    for name in ("runs.csv", "setup.json", "curves.json"):  # (the curves: each run's highest check)
        if (src / name).is_file():
            shutil.copy(src / name, dst / name)
    return dst


@pytest.mark.parametrize("folder, tests", [("", 80), ("hard", 39)])
def test_the_main_stage_report_is_written_again_from_its_runs_byte_for_byte(tmp_path, folder, tests):
    out = _copy(ROOT / "results/token_budget" / folder, tmp_path / "tb")
    written = sweep.main(["--report", "--out", str(out)])
    assert written.read_text() == (ROOT / "results/token_budget" / folder / "token_budget.md").read_text()
    assert f"All {tests} tests of this report corrected together (Holm)" in written.read_text()


def test_the_horizon_and_frozen_reports_are_written_again_from_their_runs(tmp_path):
    out = _copy(ROOT / "results/token_budget/horizon", tmp_path / "horizon")
    horizon.main(["--report", "--main", str(ROOT / "results/token_budget"), "--out", str(out)])
    new, old = ((d / "horizon.md").read_text().splitlines() for d in (out, ROOT / "results/token_budget/horizon"))
    assert new[:2] + new[3:] == old[:2] + old[3:]  # line 3 is the command line, which names the folders
    frozen = _copy(ROOT / "results/vlm_smollm2/frozen", tmp_path / "frozen")
    written = study.main(["--config", str(ROOT / "experiments/token_budget/configs/smollm2_frozen.py"), "--report",
                          "--out", str(frozen)])
    assert written.read_text() == (ROOT / "results/vlm_smollm2/frozen/frozen.md").read_text()


def test_a_report_without_finished_runs_is_refused_and_nothing_is_written(tmp_path):
    with pytest.raises(SystemExit, match="has no runs.csv or setup.json"):
        sweep.main(["--report", "--out", str(tmp_path)])
    assert list(tmp_path.iterdir()) == []


def test_the_class_test_takes_each_familys_mean_as_one_observation():
    from scipy import stats

    def rows(family, spatial_by_seed):
        return [{"family": family, "budget": 4, "tokens": 4, "note": "", "lr": 1e-3, "warmup": 25, "seed": k,
                 "status": "ok", "accuracy": 0.5, **{f"acc_{kind}": (a if kind in report.SPATIAL else 0.6)
                                                     for kind in report.KINDS}}
                for k, a in enumerate(spatial_by_seed)]

    loc = {"pool": [0.7, 0.72], "pixel_shuffle": [0.8, 0.78], "ldp": [0.66, 0.7]}
    query = {"perceiver": [0.6, 0.64], "qformer": [0.5, 0.58]}
    summary = report.summarise([r for f, accs in {**loc, **query}.items() for r in rows(f, accs)])
    (diff, _, p), mw, n_loc, n_query = report.family_group_test(summary, 4, report.SPATIAL)
    a, b = [np.mean(v) for v in loc.values()], [np.mean(v) for v in query.values()]
    assert (n_loc, n_query) == (3, 2) and diff == pytest.approx(np.mean(a) - np.mean(b))
    assert p == pytest.approx(stats.ttest_ind(a, b, equal_var=False).pvalue)
    assert mw == pytest.approx(stats.mannwhitneyu(a, b, method="exact").pvalue)
    names = [t.name for t in report.verdict_tests(summary)]
    assert "Honeybee at 4 tokens, spatial kinds, families as the unit" in names


def test_a_pair_chosen_after_seeing_the_means_pays_for_the_choice_before_holm():
    """The best − worst family at 4 tokens is one pair of the 28 that 8 families make: its p is the
    paired t-test's (scipy, on the committed runs) times 28, then corrected with the report's tests."""
    import csv

    from scipy import stats

    with open(ROOT / "results/token_budget/runs.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["tokens"] == "4" and r["variant"] == "" and r["family"] != "blind"]
    by = {}
    for r in rows:
        by.setdefault(r["family"], {})[int(r["seed"])] = float(r["accuracy"])
    assert len(by) == 8
    means = {f: np.mean(list(v.values())) for f, v in by.items()}
    best, worst = max(means, key=means.get), min(means, key=means.get)
    seeds = sorted(by[best])
    p = stats.ttest_rel([by[best][s] for s in seeds], [by[worst][s] for s in seeds]).pvalue
    row = next(line for line in (ROOT / "results/token_budget/token_budget.md").read_text().splitlines()
               if line.startswith(f"| best − worst family at 4 tokens ({best} − {worst})"))
    cells = [c.strip() for c in row.split("|")]
    assert float(cells[5]) == pytest.approx(min(1.0, 28 * p), rel=0.05) and "p × 28" in cells[9]


def test_a_row_reading_another_rows_runs_is_late_by_that_rows_curve(tmp_path):
    """Perceiver sized to the parameter budget is its default size, so its row reads the default
    row's runs; ``runs.csv`` without ``peak_step`` (the committed one) recovers it from that row's
    curve, not ``best_step``, which the tested checkpoint can put earlier."""
    import json

    from vitmm.study import outputs

    base = {"family": "perceiver", "budget": 16, "tokens": 16, "note": "", "seed": 0, "status": "ok",
            "best_step": 5750, "steps_trained": 8000}
    outputs.write_rows([{**base, "variant": ""}, {**base, "variant": "params ≈ 100,000"}], tmp_path / "runs.csv")
    curve = [[0, 0.4], [5750, 0.84], [7750, 0.842], [8000, 0.841]]  # highest at 7,750; tested at 5,750
    (tmp_path / "curves.json").write_text(json.dumps({"perceiver|16||0": curve}))
    (tmp_path / "setup.json").write_text(json.dumps({"connectors": {
        "perceiver|16|": {"connector": {"name": "perceiver", "budget": 16}, "view": ""},
        "perceiver|16|params ≈ 100,000": {"connector": {"name": "perceiver", "budget": 16, "depth": 2},
                                          "view": "", "runs_of": ["perceiver", 16, ""]}}}))
    rows = report.read_runs(tmp_path / "runs.csv")
    assert [r["peak_step"] for r in rows] == [7750, 7750] and all(report.late(r) for r in rows)


def test_longer_runs_with_another_min_delta_or_connector_width_are_not_compared():
    """``min_delta`` decides which check is tested and ``--native_widths`` changes Q-Former: either
    differing from the sweep's stops the horizon check (the committed pair passes)."""
    import copy
    import json

    main, long = (json.loads((ROOT / "results/token_budget" / d / "setup.json").read_text()) for d in ("", "horizon"))
    assert horizon.differences(main, long) == []
    other = copy.deepcopy(long)
    other["plan"]["min_delta"] = 0.0
    other["connectors"]["qformer|16|"]["connector"].pop("width")
    assert horizon.differences(main, other) == ["plan.min_delta", "connectors[qformer|16|]"]


def test_two_budgets_that_reach_one_token_count_are_tested_once():
    """On the smoke sweep's 4×4 grid budget 9 and ``all`` are both 16 tokens: the same runs, so each
    comparison at 16 tokens is one test of the Verdicts table (and of its Holm family), not two."""
    def rows(family, budget, tokens):
        return [{"family": family, "budget": budget, "tokens": tokens, "note": "", "lr": 1e-3, "warmup": 25,
                 "seed": k, "status": "ok", "accuracy": 0.3 + 0.01 * k * k + 0.02 * tokens + 0.05 * (family == "pool"),
                 **{f"acc_{kind}": 0.5 + 0.01 * k * tokens for kind in report.KINDS}} for k in range(3)]

    cells = [("blind", 0, 0), *((f, b, t) for f in ("mlp", "pool") for b, t in ((4, 4), (9, 16), ("all", 16)))]
    summary = report.summarise([r for c in cells for r in rows(*c)])
    names = [t.name for t in report.verdict_tests(summary)]
    assert report.factor_test(summary)["budgets"] == ["4", "9"]  # the analysis of variance: "all" is budget 9's runs
    assert len(names) == len(set(names)), [n for n in names if names.count(n) > 1]
    assert "pool@16 − blind" in names and "best − worst family at 16 tokens (pool − mlp)" in names
    once = [c for c in cells if c[1] != "all"]
    assert len(names) == len(report.verdict_tests(report.summarise([r for c in once for r in rows(*c)])))


def test_a_cell_of_one_seed_prints_its_last_quarter_gain_without_an_interval():
    """``--interim``: a cell with one finished seed has no 95% interval; the per-seed table prints the
    mean alone, as ``mean_ci`` does for accuracies, not '± nan'."""
    from experiments.token_budget import tables

    def row(family, seed, acc):
        return {"family": family, "budget": 4, "tokens": 4, "note": "", "lr": 1e-3, "warmup": 25, "seed": seed,
                "status": "ok", "accuracy": acc, "best_step": 90, "steps_trained": 100, "late_gain": 0.01,
                **{f"acc_{kind}": acc for kind in report.KINDS}}

    summary = report.summarise([row("blind", 0, 0.4), row("blind", 1, 0.41), row("pool", 0, 0.8)])
    line = next(x for x in tables.seed_lines(summary) if x.startswith("| pool |"))
    assert "nan" not in line and line.endswith("| 1 | +1.0 |")


def test_an_interim_pair_is_chosen_on_the_seeds_every_family_ran():
    """``--interim``: pool has seeds 0-2, Q-Former seeds 0-1. On their shared seeds pool leads
    (87.5 against 80.0), though pool's own three-seed mean (70.0) is below Q-Former's: the best −
    worst pair (and the spread table's) is pool − Q-Former, on the seeds the paired test compares."""
    from experiments.token_budget import tables

    def row(family, seed, acc):
        return {"family": family, "budget": 4, "tokens": 4, "note": "", "lr": 1e-3, "warmup": 25, "seed": seed,
                "status": "ok", "accuracy": acc, **{f"acc_{kind}": acc for kind in report.KINDS}}

    summary = report.summarise([row("pool", 0, 0.9), row("pool", 1, 0.85), row("pool", 2, 0.35),
                                row("qformer", 0, 0.8), row("qformer", 1, 0.8)])
    names = [t.name for t in report.verdict_tests(summary)]
    assert "best − worst family at 4 tokens (pool − qformer)" in names
    line = next(x for x in tables.spread_lines(summary) if x.startswith("| 4 |"))
    assert line.startswith("| 4 | 2 | pool ")
