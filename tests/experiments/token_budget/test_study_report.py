"""A ``--config`` study's report (``study_report``) ends with one Verdicts table holding every test it
makes, whatever its metric's kinds and whether it has a blind row (faked rows; no training)."""

import re

from experiments.token_budget import study_report
from experiments.token_budget.configs import common


def _study(**kw):
    c = common.study()
    c.update(kw)
    return c


def _rows(families, seeds=range(3)):
    return [{"family": f, "tokens": t, "budget": t, "seed": k, "lr": 1e-3, "batch": 8,
             "accuracy": 0.2 + 0.1 * i + 0.01 * t + 0.02 * k * k * (i + 1), "connector_params": 10}
            for i, f in enumerate(families) for t in ((1,) if f == "blind" else (4, 16)) for k in seeds]


def _verdicts(text: str) -> dict[str, str]:
    """The Verdicts table's adjusted p by test."""
    rows = [line.split(" | ") for line in text.split("**Verdicts.**")[1].splitlines() if line.startswith("| ")]
    return {r[0][2:]: r[5] for r in rows[1:]}


def _cited(line: str) -> dict[str, str]:
    """``name +d.d (p=P)`` items of a report line: the p each prints."""
    items = line.split("table): ", 1)[1].rstrip(".").split(", ")
    return dict(re.fullmatch(r"(.+?):? [+-]\d+\.\d \(p=(.+)\)", item).groups() for item in items)


def test_a_study_without_kinds_ends_with_its_verdicts_and_cites_their_adjusted_p():
    """No kinds (e.g. held-out token accuracy): the rows against blind, the gains and best − worst are
    corrected together, as docs/studies.md says every study report is, and the line against blind
    prints the Verdicts table's adjusted p, not a second correction of its own."""
    text = study_report.report(_study(), [], _rows(["blind", "pool", "perceiver"]), {}, [])
    table = _verdicts(text)
    assert {"pool@4 − blind", "perceiver@16 − blind", "pool 4 → 16 tokens"} <= set(table)
    line = next(x for x in text.splitlines() if x.startswith("Every row against blind"))
    assert f"Holm-adjusted with all {len(table)} tests of this report (as in the Verdicts table)" in line
    cited = _cited(line)
    assert len(cited) == 4 and all(f"{float(table[f'{cell} − blind']):.2g}" == p for cell, p in cited.items())


def test_a_study_without_blind_puts_its_pairs_of_families_in_the_verdicts_table():
    text = study_report.report(_study(), [], _rows(["pool", "perceiver"]), {}, [])
    table = _verdicts(text)
    assert "perceiver − pool at 4 tokens" in table and "pool 4 → 16 tokens" in table
    line = next(x for x in text.splitlines() if x.startswith("Families paired by seed"))
    assert f"with all {len(table)} tests of this report (as in the Verdicts table)" in line
    cited = _cited(line)
    assert len(cited) == 2 and all(f"{float(table[f'{pair} tokens']):.2g}" == p for pair, p in cited.items())


def test_a_metric_where_lower_is_better_keeps_the_rows_own_correction():
    """Its best − worst would name the worst family the best: no Verdicts table, the rows against blind
    Holm-adjusted among themselves."""
    text = study_report.report(_study(higher_is_better=False), [], _rows(["blind", "pool"]), {}, [])
    assert "**Verdicts.**" not in text and "Holm-adjusted across the table's 2 tests" in text
