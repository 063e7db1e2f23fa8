"""Verdicts worded by their evidence: every test a report makes, corrected together, and the one
word each may use.

A report collects its tests (``Test``: what is compared, the estimate, its 95% interval, the
unadjusted p and the unit the test treats as independent: seeds, or families), corrects them as
one family (``correct``, Holm by default: the chance of any false positive among all of them stays
at 5%), and writes them as a table (``table_lines``) whose last column is the verdict:

- ``shown``: adjusted p < 0.05;
- ``trend``: 0.05 ≤ adjusted p < 0.10, not shown;
- ``not shown``: adjusted p ≥ 0.10 (no difference detected; not evidence of none).

Prose that states a finding cites its row's tag (``tag``), e.g. ``[shown: +4.1, Holm p 0.046 of 77]``;
``tests/study/test_verdicts.py`` checks every tag in README.md and results/**/README.md against the
committed tables, so a sentence cannot claim more than its row's adjusted p allows.
"""

from __future__ import annotations

import dataclasses
import math
import re

from vitmm.study import stats

SHOWN, TREND = 0.05, 0.10
WORDS = ("shown", "trend", "not shown")
# A tag as ``tag`` writes it: [word: estimate, Holm p P of N]
TAG = re.compile(r"\[(shown|trend|not shown): ([^\],]+), (Holm|Bonferroni) p ([0-9.e+-]+) of (\d+)\]")


@dataclasses.dataclass
class Test:
    """One test of a report. ``estimate`` and ``ci`` (95% half-width) in the report's units
    (points of accuracy; a share for an analysis of variance); ``p`` unadjusted, two-sided;
    ``unit``: what the test treats as independent (``seeds``, ``families``); ``note``: what a
    reader must know to weigh it (e.g. a comparison chosen after seeing the means)."""

    name: str
    estimate: float
    ci: float | None
    p: float
    unit: str = "seeds"
    note: str = ""
    p_adj: float = math.nan
    family_size: int = 0
    method: str = "Holm"
    digits: int = 1  # decimals of the estimate and CI as printed (and tagged)

    @property
    def word(self) -> str:
        return word(self.p_adj)


def word(p_adj: float) -> str:
    """The verdict an adjusted p allows (the module's docstring)."""
    if p_adj < SHOWN:
        return "shown"
    return "trend" if p_adj < TREND else "not shown"


def correct(tests: list[Test], method: str = "holm") -> list[Test]:
    """``tests`` with ``p_adj`` set, all corrected as one family (Holm's step-down, or Bonferroni)."""
    ps = [t.p for t in tests]
    if method == "holm":
        adjusted = stats.holm(ps)
    elif method == "bonferroni":
        adjusted = [min(1.0, p * len(ps)) for p in ps]
    else:
        raise ValueError(f"correction {method!r}: choose holm or bonferroni.")
    label = "Holm" if method == "holm" else "Bonferroni"
    return [dataclasses.replace(t, p_adj=a, family_size=len(tests), method=label)
            for t, a in zip(tests, adjusted, strict=True)]


def paired(name: str, a: dict, b: dict, scale: float = 100.0, **kwargs) -> Test | None:
    """``a − b`` paired by seed (``{seed: value}`` dicts; the seeds both hold), in ``scale`` units:
    the mean difference, its 95% CI and the p of a one-sample t-test; None with fewer than two seeds."""
    seeds = sorted(set(a) & set(b))
    test = stats.one_sample([a[k] - b[k] for k in seeds])
    return None if test is None else Test(name, scale * test[0], scale * test[1], test[2], **kwargs)


def section(tests: list[Test | None], what: str, heading: str = "**Verdicts.**") -> list[str]:
    """The verdict table of a report's tests (Nones, tests without data, dropped), all corrected
    together: what a report generator appends."""
    tests = [t for t in tests if t is not None]
    title = heading + ("" if heading.endswith("\n") else " ") + what
    return ["", *table_lines(correct(tests), title)] if tests else []


def _estimate(t: Test) -> str:
    return f"{t.estimate:+.{t.digits}f}"


def tag(t: Test) -> str:
    """``[word: estimate, Holm p P of N]``: what prose cites for a finding."""
    return f"[{t.word}: {_estimate(t)}, {t.method} p {t.p_adj:.2g} of {t.family_size}]"


def table_lines(tests: list[Test], title: str) -> list[str]:
    """The report's verdict table: every test, its estimate ± 95% CI, unadjusted and adjusted p,
    the unit and the verdict with the tag prose may cite."""
    if not tests:
        return []
    method = tests[0].method
    lines = [f"{title} All {len(tests)} tests of this report corrected together ({method}); verdict: shown "
             f"(adjusted p < {SHOWN:g}), trend ({SHOWN:g} ≤ adjusted p < {TREND:g}), not shown (adjusted p ≥ "
             f"{TREND:g}: no difference detected, which is not evidence of none). The tag is what a sentence "
             "citing the row writes.", "",
             "| test | estimate | 95% CI | unit | p | adjusted p | verdict | tag | note |",
             "|---|---:|---:|---|---:|---:|---|---|---|"]
    for t in tests:
        ci = "" if t.ci is None or t.ci != t.ci else f"± {t.ci:.{t.digits}f}"
        lines.append(f"| {t.name} | {_estimate(t)} | {ci} | {t.unit} | {t.p:.2g} | {t.p_adj:.2g} | "
                     f"{t.word} | `{tag(t)}` | {t.note} |")
    return lines


def find_tags(text: str) -> list[re.Match]:
    """The tags in ``text``, also where a line break falls inside one (Markdown prose is wrapped)."""
    return list(TAG.finditer(" ".join(text.split())))


def check_tags(text: str, tables: str) -> list[str]:
    """What is wrong with the tags in ``text``: a word its adjusted p does not allow, or a tag that
    no committed verdict table (``tables``, their text joined) prints. Empty when every tag holds."""
    problems = []
    for m in find_tags(text):
        stated, p_adj = m.group(1), float(m.group(4))
        # a p printed as a threshold (0.05, 0.1) may round either side of it: the table's tag decides
        if m.group(4) not in ("0.05", "0.1") and word(p_adj) != stated:
            problems.append(f"{m.group(0)}: adjusted p {m.group(4)} allows '{word(p_adj)}', not '{stated}'")
        if f"`{m.group(0)}`" not in tables:
            problems.append(f"{m.group(0)}: no committed verdict table prints this tag")
    return problems
