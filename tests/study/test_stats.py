"""``vitmm.study.stats``: each test on numbers whose answer is known by hand or by another method."""

import numpy as np
import pytest

from vitmm.study import stats


def test_holm_adjusts_each_p_by_its_rank_and_keeps_the_order():
    """Holm's step-down on known numbers: 0.01 × 3, then max(0.03 × 2, that), then max(0.04 × 1, that)."""
    assert stats.holm([0.04, 0.01, 0.03]) == pytest.approx([0.06, 0.03, 0.06])
    assert stats.holm([0.5, 0.9]) == [1.0, 1.0] and stats.holm([]) == []


def test_the_blocked_anova_splits_the_total_sum_of_squares_and_finds_a_planted_effect():
    """On a 3 × 2 grid with 4 seeds: the sources' sums of squares add up to the total, the planted
    effect of the second factor is found and is the largest share, and F and p agree with the ratio of
    mean squares and scipy's F distribution."""
    from scipy import stats as sp

    rng = np.random.default_rng(0)
    y = rng.normal(size=(3, 2, 4)) + np.array([0.0, 3.0])[None, :, None]
    out = stats.anova_blocked(y, ("family", "budget"))["sources"]
    assert sum(s["ss"] for s in out.values()) == pytest.approx(((y - y.mean()) ** 2).sum())
    assert out["budget"]["p"] < 1e-6 and max(out, key=lambda k: out[k]["eta2"]) == "budget"
    ms_e = out["residual"]["ss"] / out["residual"]["df"]
    f = out["budget"]["ss"] / out["budget"]["df"] / ms_e
    assert out["budget"]["f"] == pytest.approx(f) and out["budget"]["p"] == pytest.approx(sp.f.sf(f, 1, 15))
    assert [out[k]["df"] for k in ("budget", "family", "family × budget", "seed", "residual")] == [1, 2, 2, 3, 15]


def test_intervals_and_paired_tests_against_scipy():
    """ci95 is Student's t half-width; ``paired`` pairs only shared seeds; identical values give p 1."""
    from scipy import stats as sp

    v = [0.5, 0.7, 0.6, 0.9]
    assert stats.ci95(v) == pytest.approx(sp.t.ppf(0.975, 3) * np.std(v, ddof=1) / 2)
    assert np.isnan(stats.ci95([1.0]))
    a, b = {0: 0.5, 1: 0.6, 2: 0.9, 7: 0.1}, {0: 0.4, 1: 0.6, 2: 0.7}
    diff, p = stats.paired(a, b)
    assert diff == pytest.approx(0.1) and p == pytest.approx(sp.ttest_rel([0.5, 0.6, 0.9], [0.4, 0.6, 0.7]).pvalue)
    assert stats.paired({0: 1.0, 1: 2.0}, {0: 1.0, 1: 2.0}) == (0.0, 1.0) and stats.paired({0: 1.0}, {0: 2.0}) is None
    # A difference that does not vary (one image of 1,000 on every seed) is not p = 0: the exact
    # sign-flip test's 2 / 2^n, and a one-sample test alike.
    diff, p = stats.paired({0: 1.0, 1: 1.0, 2: 1.0}, {0: 0.999, 1: 0.999, 2: 0.999})
    assert diff == pytest.approx(0.001) and p == 0.25
    assert stats.one_sample([0.3] * 5)[2] == 2 / 32 and stats.one_sample([0.0] * 5)[2] == 1.0
    noise = {s: 0.1 + 0.2 for s in range(10)}, {s: 0.3 if s % 2 else 0.1 + 0.2 + 1e-17 for s in range(10)}
    assert stats.paired(*noise)[1] == 1.0  # float noise of either sign around no difference: nothing
    lo, hi = stats.wilson(0.5, 100)
    assert lo == pytest.approx(0.4038, abs=1e-4) and hi == pytest.approx(0.5962, abs=1e-4)
    assert stats.wilson(0.0, 209)[0] == 0.0 and stats.wilson(1.0, 209)[1] == 1.0  # not -1.7e-18 / 1 + 2e-16


def test_a_difference_with_a_missing_value_is_no_evidence():
    """A NaN among the per-seed values (a run without its accuracy) makes no test: a NaN p, which
    Holm counts as 1. Not the sign-flip test of values that do not vary (NaN compares as neither
    varying nor not), which gave 2 / 2^6 = 0.031, "shown", with six seeds."""
    values = [0.01, 0.01, 0.01, 0.01, 0.01, float("nan")]
    assert np.isnan(stats.one_sample(values)[2])
    assert np.isnan(stats.paired(dict(enumerate(values)), {k: 0.0 for k in range(6)})[1])
    assert stats.holm([stats.one_sample(values)[2], 0.01]) == [1.0, 0.02]


def test_the_blocked_anova_of_seeds_that_agree_has_no_residual_to_test_against():
    """Every seed giving the same accuracy (as deterministic runs would) leaves no residual variance:
    no F and no p ("n/a" in the report), not the F of float noise (~1e17, p = 0, "shown") nor a
    negative residual sum of squares; the shares still add up to the whole."""
    rng = np.random.default_rng(0)
    for _ in range(20):
        y = np.repeat(np.round(rng.uniform(70, 90, size=(8, 3)), 1)[:, :, None], 5, axis=2)
        out = stats.anova_blocked(y, ("family", "budget"))["sources"]
        assert out["residual"]["ss"] == 0.0 and all(s["f"] is None and s["p"] is None for s in out.values())
        assert all(s["eta2"] >= 0 for s in out.values()) and sum(s["eta2"] for s in out.values()) == pytest.approx(1)
