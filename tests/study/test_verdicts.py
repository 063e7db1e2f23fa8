"""Verdicts worded by their adjusted p, and every verdict tag the READMEs cite printed by a
committed report with the word its adjusted p allows."""

import pathlib

import pytest

from vitmm.study import outputs, stats, verdicts

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("p_adj", "word"), [(0.0, "shown"), (0.0499, "shown"), (0.05, "trend"), (0.0999, "trend"),
                                             (0.1, "not shown"), (1.0, "not shown")])
def test_the_word_follows_the_adjusted_p(p_adj, word):
    assert verdicts.word(p_adj) == word


def test_all_tests_of_a_report_are_corrected_as_one_family():
    tests = [verdicts.Test(f"t{i}", 1.0, 0.5, p) for i, p in enumerate([0.01, 0.04, 0.03, 0.5])]
    holm = verdicts.correct(tests)
    assert [t.p_adj for t in holm] == stats.holm([0.01, 0.04, 0.03, 0.5]) == [0.04, 0.09, 0.09, 0.5]
    assert [t.word for t in holm] == ["shown", "trend", "trend", "not shown"]
    assert {t.family_size for t in holm} == {4} and holm[0].p == 0.01  # the unadjusted p is kept
    bonferroni = verdicts.correct(tests, "bonferroni")
    assert [t.p_adj for t in bonferroni] == [0.04, 0.16, 0.12, 1.0] and bonferroni[0].method == "Bonferroni"
    with pytest.raises(ValueError, match="holm or bonferroni"):
        verdicts.correct(tests, "fdr")


def test_a_tag_holds_only_as_printed_and_with_the_word_its_p_allows():
    tests = verdicts.correct([verdicts.Test("a − b", -5.1, 1.2, 0.00025), verdicts.Test("c − d", 2.1, 1.4, 0.014)])
    table = "\n".join(verdicts.table_lines(tests, "Verdicts."))
    tags = [verdicts.tag(t) for t in tests]
    assert tags == ["[shown: -5.1, Holm p 0.0005 of 2]", "[shown: +2.1, Holm p 0.014 of 2]"]
    assert "| a − b | -5.1 | ± 1.2 | seeds | 0.00025 | 0.0005 | shown |" in table
    assert verdicts.check_tags(f"pixel shuffle loses 5.1 {tags[0]}; {tags[1]}", table) == []
    wrapped = "loses 5.1 [shown: -5.1, Holm p\n  0.0005 of 2] (a tag broken over two lines of prose)"
    assert len(verdicts.find_tags(wrapped)) == 1 and verdicts.check_tags(wrapped, table) == []
    overclaimed = "[shown: +2.1, Holm p 0.33 of 81]"  # the Qwen resampler's gain as the main stage corrects it
    problems = verdicts.check_tags(f"the Qwen resampler gains 2.1 {overclaimed}", table)
    assert any("allows 'not shown', not 'shown'" in p for p in problems)
    assert any("no committed verdict table prints this tag" in p for p in problems)


def test_every_verdict_tag_in_the_readmes_is_printed_by_a_committed_report_with_its_word():
    """README.md and results/**/README.md cite findings by their verdict tags; each must be a row of
    a committed report's Verdicts table (so it was computed, with every test of its report
    corrected together) and say what its adjusted p allows."""
    reports = "\n".join(p.read_text() for p in sorted((ROOT / "results").rglob("*.md")) if p.name != "README.md")
    readmes = [ROOT / "README.md", *sorted((ROOT / "results").rglob("README.md"))]
    found = {p: verdicts.find_tags(p.read_text()) for p in readmes}
    assert len(found[ROOT / "results/token_budget/README.md"]) >= 30
    assert len(found[ROOT / "README.md"]) >= 5
    problems = [f"{p.relative_to(ROOT)}: {x}" for p in readmes for x in verdicts.check_tags(p.read_text(), reports)]
    assert not problems, "\n".join(problems)


def test_welch_and_mann_whitney_treat_families_as_the_unit():
    from scipy import stats as sp

    loc, query = [88.0, 90.1, 84.1, 81.6, 86.5], [82.5, 82.4, 77.3]
    diff, half, p = stats.welch(loc, query)
    assert diff == pytest.approx(sum(loc) / 5 - sum(query) / 3)
    assert p == pytest.approx(sp.ttest_ind(loc, query, equal_var=False).pvalue)
    assert 0 < half < 20 and stats.welch([1.0], query) is None
    assert stats.mann_whitney([5, 6, 7, 8, 9], [1, 2, 3]) == pytest.approx(2 / 56)  # the smallest 5-vs-3 p
    # groups that do not vary: no t-test (its zero variance gave p ~ 1e-31), the exact rank test's p
    assert stats.welch([0.5, 0.5, 0.5], [0.4, 0.4, 0.4]) == (pytest.approx(0.1), 0.0, pytest.approx(0.1))
    assert stats.welch([0.5, 0.5], [0.5, 0.5])[2] == 1.0


def test_a_mean_of_one_seed_is_printed_without_an_interval():
    assert outputs.mean_ci({0: 0.5}) == "50.0" and outputs.mean_ci([0.5, 0.7]) == "60.0 ± 127.1"
