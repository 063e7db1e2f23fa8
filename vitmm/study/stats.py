"""The statistics studies report over seeds: 95% intervals of a mean, t-tests paired by seed
(a seed shares its data order and initial models across the cells of a study, so seeds pair),
one-sample tests of per-seed differences, Welch's and Mann–Whitney's tests between groups of
families (families as the unit), Holm's correction across a report's tests, a two-way
analysis of variance with seeds as blocks, and Wilson intervals and two-proportion tests for
accuracies on one shared question set."""

from __future__ import annotations

import numpy as np


def ci95(values) -> float:
    """Half-width of the 95% confidence interval of the mean (Student's t over seeds)."""
    from scipy import stats

    values = np.asarray(values, float)
    if len(values) < 2:
        return float("nan")
    return float(stats.t.ppf(0.975, len(values) - 1) * values.std(ddof=1) / np.sqrt(len(values)))


def paired(a: dict, b: dict) -> tuple[float, float] | None:
    """``(mean difference, two-sided p)`` of a t-test paired over the seeds both ``{seed: value}``
    dicts hold (a difference that does not vary: ``_constant_p``'s p); None with fewer than two
    shared seeds."""
    from scipy import stats

    seeds = sorted(set(a) & set(b))
    if len(seeds) < 2:
        return None
    x, y = np.array([a[k] for k in seeds], float), np.array([b[k] for k in seeds], float)
    diff = x - y
    p = _constant_p(diff)
    return float(diff.mean()), float(stats.ttest_rel(x, y).pvalue) if p is None else p


def _constant_p(values) -> float | None:
    """The two-sided p of values that do not vary (float noise apart), where a t-test's zero variance
    would say p = 0 at any number of seeds: 1 when they are 0, else the exact sign-flip test's
    (only all signs flipped together are as extreme: 2 / 2^n, 0.25 with 3 seeds). None otherwise, also
    where a value is NaN (the t-test's p is then NaN too, which ``holm`` counts as 1: nothing shown)."""
    if not np.isfinite(values).all():
        return None
    scale = float(np.abs(values).max())
    if scale <= 1e-12:  # zero, float noise of either sign apart
        return 1.0
    if float(np.ptp(values)) > 1e-9 * scale:
        return None
    return min(1.0, 2.0 / 2 ** len(values))


def one_sample(values) -> tuple[float, float, float] | None:
    """``(mean, 95% CI half-width, two-sided p of a one-sample t-test against 0)`` (values that do
    not vary: ``_constant_p``'s p); None with fewer than two values."""
    from scipy import stats

    values = np.asarray(values, float)
    if len(values) < 2:
        return None
    p = _constant_p(values)
    return float(values.mean()), ci95(values), float(stats.ttest_1samp(values, 0).pvalue) if p is None else p


def welch(a, b) -> tuple[float, float, float] | None:
    """``(mean(a) − mean(b), 95% CI half-width, two-sided p)`` of Welch's t-test: two independent
    groups with their own variances, e.g. family means of two classes of connectors (the families,
    not the seeds, as the unit). None with fewer than two values in a group. Where neither group
    varies (float noise apart), a t-test's zero variance would say p ≈ 0 whatever the group sizes:
    the p is then the exact Mann–Whitney test's (1 when all values are equal)."""
    from scipy import stats

    a, b = np.asarray(a, float), np.asarray(b, float)
    if len(a) < 2 or len(b) < 2:
        return None
    scale = max(float(np.abs(np.concatenate([a, b])).max()), 1e-12)
    if max(float(np.ptp(a)), float(np.ptp(b))) <= 1e-9 * scale:
        return float(a.mean() - b.mean()), 0.0, mann_whitney(a, b)
    res = stats.ttest_ind(a, b, equal_var=False)
    va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1)) if va + vb > 0 else 1.0
    half = float(stats.t.ppf(0.975, df) * np.sqrt(va + vb))
    return float(a.mean() - b.mean()), half, float(res.pvalue) if res.pvalue == res.pvalue else 1.0


def mann_whitney(a, b) -> float:
    """Two-sided exact p of the Mann–Whitney U test (no assumption of normal family means; with 5
    against 3 families its smallest possible p is 2/56 = 0.036). With tied values, the exact
    permutation distribution of U (scipy's exact method assumes no ties); two-sided as twice the
    smaller tail, as scipy's exact method."""
    from scipy import stats

    a, b = np.asarray(a, float), np.asarray(b, float)
    if len(np.unique(np.concatenate([a, b]))) == len(a) + len(b):
        return float(stats.mannwhitneyu(a, b, alternative="two-sided", method="exact").pvalue)
    u = lambda x, y: stats.mannwhitneyu(x, y, method="asymptotic").statistic  # noqa: E731 - U of x, ties averaged
    return float(stats.permutation_test((a, b), u, permutation_type="independent", n_resamples=np.inf,
                                        alternative="two-sided").pvalue)


def holm(ps: list[float]) -> list[float]:
    """Holm's step-down adjustment of ``ps`` (one claim tested several times, e.g. at every token
    count): the smallest p times n, the next times n - 1, ..., each at least the one before, at most
    1. Controls the chance of any false positive among the n at the nominal level."""
    ps = [1.0 if p != p else p for p in ps]  # a test that could not be made (NaN) shows nothing
    order = sorted(range(len(ps)), key=lambda i: ps[i])
    adjusted, running = [0.0] * len(ps), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(ps) - rank) * ps[i]))
        adjusted[i] = running
    return adjusted


def anova_blocked(y: np.ndarray, names: tuple[str, str] = ("a", "b")) -> dict:
    """Two-way analysis of variance of ``y[a, b, seed]`` (a balanced grid, every cell with every
    seed) with seeds as blocks: each source's sum of squares, degrees of freedom, share of the
    total sum of squares (η², not partial), F and p against the residual (None, both, where there is
    no residual variance). The interaction ``"a × b"`` is tested as well, so an effect of ``b`` that
    differs by ``a`` shows. ``names`` labels the two factors."""
    from scipy import stats

    a, b = names
    n_a, n_b, n_s = y.shape
    grand = y.mean()
    m_a, m_b, m_s, m_ab = y.mean((1, 2)), y.mean((0, 2)), y.mean((0, 1)), y.mean(2)
    ss = {b: n_a * n_s * ((m_b - grand) ** 2).sum(), a: n_b * n_s * ((m_a - grand) ** 2).sum(),
          f"{a} × {b}": n_s * ((m_ab - m_a[:, None] - m_b[None] + grand) ** 2).sum(),
          "seed": n_a * n_b * ((m_s - grand) ** 2).sum()}
    total = ((y - grand) ** 2).sum()
    df = {b: n_b - 1, a: n_a - 1, f"{a} × {b}": (n_a - 1) * (n_b - 1), "seed": n_s - 1}
    # The residual from its own deviations (not the total less the sources: float noise of either
    # sign where it is 0); at float noise of the values' scale it is 0, e.g. where every seed agrees.
    residual = ((y - m_ab[:, :, None] - m_s[None, None, :] + grand) ** 2).sum()
    ss["residual"] = 0.0 if residual <= y.size * (1e-9 * np.abs(y).max()) ** 2 else residual
    df["residual"] = (n_a * n_b - 1) * (n_s - 1)
    ms_e = ss["residual"] / df["residual"] if df["residual"] else 0.0  # one seed: no residual either
    sources = {}
    for name in ss:
        f_stat = float(ss[name] / df[name] / ms_e) if name != "residual" and ms_e > 0 else None
        p = None if f_stat is None else float(stats.f.sf(f_stat, df[name], df["residual"]))
        eta2 = float(ss[name] / total) if total else 0.0
        sources[name] = dict(ss=float(ss[name]), df=df[name], eta2=eta2, f=f_stat, p=p)
    return {"sources": sources, "means": {a: m_a.tolist(), b: m_b.tolist()}}


def wilson(p: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson interval of a proportion ``p`` measured on ``n`` questions (within [0, 1]: at
    p = 0 or 1 float rounding would put the bound a hair outside)."""
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(float(centre - half), 0.0), min(float(centre + half), 1.0)


def two_proportion_p(p1: float, p2: float, n: int, n2: int | None = None) -> float:
    """Two-sided p-value of a difference between two accuracies on ``n`` questions each (``n2``: the
    second's, where it differs): a pooled z-test, which treats the two sets of answers as
    independent. When both runs answer the same questions a paired test (McNemar's, on each
    question's answers) is the right one; this one is conservative only if the runs' per-question
    correctness is positively correlated."""
    from scipy.stats import norm

    if n2 is None or n2 == n:
        pooled = (p1 + p2) / 2
        se = np.sqrt(2 * pooled * (1 - pooled) / n)
    else:
        pooled = (p1 * n + p2 * n2) / (n + n2)
        se = np.sqrt(pooled * (1 - pooled) * (1 / n + 1 / n2))
    return float(2 * norm.sf(abs(p1 - p2) / se)) if se > 0 else 1.0
