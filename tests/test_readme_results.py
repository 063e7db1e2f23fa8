"""README.md's Results table: every row's linked files exist, and every number in its result
column is printed by them (a `.md`, `.csv`, `.json` or `.jsonl` in a linked file's folder, or a
linked folder), as written or as their more precise figure rounded to its digits. The token-budget
row has its own, stricter check (tests/experiments/token_budget/test_token_budget_sweep.py) and
verdict tags theirs (tests/study/test_verdicts.py). It cannot tell which file's number a row means,
so it catches a number no file holds (a typo, a figure from a run that was not kept), not a
misattributed one."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Numbers as prose writes them: 1,234 / 0.630 / 3.6e-7 / 1.8e-22; not version-like "0.7.3" tails.
NUMBER = re.compile(r"(?<![\w.])\d{1,3}(?:,\d{3})+(?:\.\d+)?(?![\d.])|(?<![\w.,])\d+(?:\.\d+)?(?:e-?\d+)?(?![\d])")
SUFFIXES = (".md", ".csv", ".json", ".jsonl")


def _rows() -> list[list[str]]:
    section = (ROOT / "README.md").read_text().split("\n## Results\n", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| what |")]
    return [[cell.strip() for cell in line.strip().strip("|").split(" | ")] for line in lines]


def _linked(details: str) -> list[pathlib.Path]:
    paths, folder = [], None
    for name in re.findall(r"`([^`]+)`", details):
        if name.startswith("…/") and folder is not None:
            name = str(folder.relative_to(ROOT) / name[2:])
        path = ROOT / name
        assert path.exists(), f"the Results table links {name}, which does not exist"
        paths.append(path)
        folder = path if path.is_dir() else path.parent
    return paths


def _printed(paths: list[pathlib.Path]) -> set[str]:
    folders = {p if p.is_dir() else p.parent for p in paths}
    files = {f for d in folders for f in d.rglob("*") if f.suffix in SUFFIXES and f.stat().st_size < 4_000_000}
    return {n for f in sorted(files) for n in NUMBER.findall(f.read_text(errors="replace"))}


def _value(text: str) -> float:
    return float(text.replace(",", ""))


def _held(number: str, printed: set[str], rounded: dict[int, set[float]]) -> bool:
    if number in printed or number.replace(",", "") in printed:
        return True
    if "e" in number:  # 8e-7 holds 8.0e-7: the same value at the row's significant digits
        significant = len(number.split("e")[0].replace(".", ""))
        return any(f"{_value(n):.{significant - 1}e}" == f"{_value(number):.{significant - 1}e}" for n in printed)
    digits = len(number.split(".")[1]) if "." in number else 0
    return round(_value(number), digits) in rounded.setdefault(digits, {
        round(_value(n), digits) for n in printed if "e" not in n})


@pytest.mark.parametrize("row", [r for r in _rows() if "token-budget" not in r[0]], ids=lambda r: r[0][:40])
def test_each_results_row_prints_only_numbers_its_linked_files_hold(row):
    what, result, details = row[0], row[1], row[-1]
    printed = _printed(_linked(details))
    result = re.sub(r"`\[[^\]]*\]`", "", result)  # verdict tags: tests/study/test_verdicts.py
    rounded: dict[int, set[float]] = {}
    missing = [n for n in NUMBER.findall(result) if not _held(n, printed, rounded)]
    assert not missing, f"{what}: {missing} in no file it links ({details})"
