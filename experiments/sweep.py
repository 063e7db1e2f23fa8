"""What every experiment sweep here shares: finished runs kept on disk as they end (a rerun with
the same settings skips them) and the statistics the tables report (95% intervals over seeds,
t-tests paired by seed)."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib

import numpy as np


def signature(settings: dict) -> str:
    """A short hash of the settings a finished run is valid for."""
    return hashlib.sha1(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]


def load_cells(path: pathlib.Path, signature: str) -> dict:
    """Finished cells ``{key: {seed: result}}`` (key: a tuple, e.g. ``(family, tokens)``) of a
    sweep with these settings; lines of one key (e.g. one per finished seed) are merged."""
    cells: dict = {}
    for line in path.read_text().splitlines() if path.is_file() else ():
        cell = json.loads(line)
        if cell["signature"] == signature:
            cells.setdefault(tuple(cell["key"]), {}).update({int(k): v for k, v in cell["results"].items()})
    return cells


def finished(path: pathlib.Path, signature: str, keys, seeds=None) -> dict:
    """The cells of ``keys`` a rerun skips: those holding every one of ``seeds`` (their results
    only; ``None``: any seeds). A sweep's signature leaves its seed list out, so rerunning it with
    more seeds trains only the new ones (with ``seed_results``, each missing seed of a cell)."""
    cells = load_cells(path, signature)
    if seeds is None:
        return {k: cells[k] for k in keys if k in cells}
    return {k: {s: cells[k][s] for s in seeds} for k in keys if k in cells and set(seeds) <= set(cells[k])}


def seed_results(paths, signature: str) -> dict:
    """Every finished seed ``{key: {seed: result}}`` recorded in any of ``paths`` (the finished
    cells and the per-seed log) under this signature."""
    merged: dict = {}
    for path in paths:
        for key, by_seed in load_cells(pathlib.Path(path), signature).items():
            merged.setdefault(key, {}).update(by_seed)
    return merged


def save_cell(path: pathlib.Path, signature: str, key, results: dict) -> None:
    """Appends one finished cell (all its seeds) as a line of a ``.jsonl`` file, synced to disk."""
    line = json.dumps({"signature": signature, "key": list(key), "results": {str(k): v for k, v in results.items()}})
    with path.open("a") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


def run_cells(path: pathlib.Path, signature: str, keys: list, fn, arrays: dict, context: dict, n_workers: int,
              desc: str, steps_per_key: int, seeds=None, before=None) -> dict:
    """``{key: {seed: result}}`` for every key: the cells ``path`` holds for ``signature`` (with
    every one of ``seeds``: ``finished``), and the rest run now by ``workers.run`` (after
    ``before()``, e.g. a stage every cell needs), each appended to ``path`` as it finishes.
    ``steps_per_key`` sizes the progress bar."""
    import workers  # a sibling module: experiments/ is on sys.path

    done = finished(path, signature, keys, seeds)
    todo = [k for k in keys if k not in done]
    if done:
        print(f"{desc}: {len(done)} cells already done in {path} (settings {signature}), skipped; {len(todo)} to run")
    if todo:
        if before is not None:
            before()
        done.update(workers.run(fn, todo, arrays, context, n_workers, total=len(todo) * steps_per_key, desc=desc,
                                on_result=lambda key, res: save_cell(path, signature, key, res)))
    return done


def ci95(values) -> float:
    """Half-width of the 95% confidence interval of the mean (Student's t over seeds)."""
    from scipy import stats

    values = np.asarray(values, float)
    if len(values) < 2:
        return float("nan")
    return float(stats.t.ppf(0.975, len(values) - 1) * values.std(ddof=1) / np.sqrt(len(values)))


def paired(a: dict, b: dict) -> tuple[float, float] | None:
    """``(mean difference, two-sided p)`` of a t-test paired over the seeds both ``{seed: value}``
    dicts hold; None with fewer than two shared seeds."""
    from scipy import stats

    seeds = sorted(set(a) & set(b))
    if len(seeds) < 2:
        return None
    x, y = np.array([a[k] for k in seeds], float), np.array([b[k] for k in seeds], float)
    diff = x - y
    p = 1.0 if np.allclose(diff, diff[0]) and diff[0] == 0 else float(stats.ttest_rel(x, y).pvalue)
    return float(diff.mean()), p


def one_sample(values) -> tuple[float, float, float] | None:
    """``(mean, 95% CI half-width, two-sided p of a one-sample t-test against 0)``."""
    from scipy import stats

    values = np.asarray(values, float)
    if len(values) < 2:
        return None
    p = 1.0 if np.allclose(values, values[0]) and values[0] == 0 else float(stats.ttest_1samp(values, 0).pvalue)
    return float(values.mean()), ci95(values), p
