"""Cells × seeds that survive a stop: each finished cell is appended to a ``.jsonl`` file under
the settings' signature as it ends, and a rerun with the same settings skips it (with more seeds,
it trains only the new ones). A study's results also hold the one frozen model its cells read
(``check_tower``), so that sittings on several machines are never mixed.

A cell is one point of a study's grid (e.g. ``(family, tokens)``) with a result per seed; a study
names its cells, gives ``run_cells`` a module-level function that computes one cell's seeds, and
gets back ``{key: {seed: result}}``."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib

import numpy as np

from vitmm.study import workers


def signature(settings: dict) -> str:
    """A short hash of the settings a finished run is valid for."""
    return hashlib.sha1(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]


def fingerprint(params) -> str:
    """A short hash of a parameter tree's names, shapes, dtypes and values."""
    import jax

    digest = hashlib.sha1()
    leaves = {jax.tree_util.keystr(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
    for name in sorted(leaves):
        leaf = np.ascontiguousarray(leaves[name])
        digest.update(f"{name}:{leaf.dtype}:{leaf.shape};".encode())
        digest.update(leaf.tobytes())
    return digest.hexdigest()[:16]


def check_tower(out: pathlib.Path, tower_dir: pathlib.Path, params) -> str:
    """The tower's ``fingerprint``, recorded in ``OUT/tower.json`` by the first sweep that writes
    to ``out``; a later sweep there with another tower (e.g. one retrained on another machine:
    the path, which the signatures hold, is the same) is refused, since its runs would be mixed
    with runs on different features."""
    current = fingerprint(params)
    record = out / "tower.json"
    if record.is_file():
        known = json.loads(record.read_text())
        if known["fingerprint"] != current:
            raise SystemExit(
                f"The tower in {tower_dir} (parameters {current}) is not the one the results in {out} were made "
                f"with ({known['fingerprint']}, {known['workdir']}): pass --tower with that one, or write these "
                f"runs to a new --out.")
    else:
        record.write_text(json.dumps({"workdir": str(tower_dir), "fingerprint": current}, indent=1) + "\n")
    return current


def load_cells(path: pathlib.Path, signature: str, holds=None) -> dict:
    """Finished cells ``{key: {seed: result}}`` (key: a tuple, e.g. ``(family, tokens)``) of a
    sweep with these settings; lines of one key (e.g. one per finished seed) are merged. With
    ``holds(result) -> bool``, only the results it accepts (a setting left out of the signature
    that a result may or may not be valid for, e.g. ``holds_under_min_steps``)."""
    cells: dict = {}
    for line in path.read_text().splitlines() if path.is_file() else ():
        cell = json.loads(line)
        if cell["signature"] == signature:
            results = {int(k): v for k, v in cell["results"].items() if holds is None or holds(v)}
            if results:
                cells.setdefault(tuple(cell["key"]), {}).update(results)
    return cells


def finished(path: pathlib.Path, signature: str, keys, seeds=None, holds=None) -> dict:
    """The cells of ``keys`` a rerun skips: those holding every one of ``seeds`` (their results
    only; ``None``: any seeds). A sweep's signature leaves its seed list out, so rerunning it with
    more seeds trains only the new ones (with ``seed_results``, each missing seed of a cell)."""
    cells = load_cells(path, signature, holds)
    if seeds is None:
        return {k: cells[k] for k in keys if k in cells}
    return {k: {s: cells[k][s] for s in seeds} for k in keys if k in cells and set(seeds) <= set(cells[k])}


def seed_results(paths, signature: str, holds=None) -> dict:
    """Every finished seed ``{key: {seed: result}}`` recorded in any of ``paths`` (the finished
    cells and the per-seed log) under this signature (and accepted by ``holds``)."""
    merged: dict = {}
    for path in paths:
        for key, by_seed in load_cells(pathlib.Path(path), signature, holds).items():
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
              desc: str, steps_per_key: int, seeds=None, before=None, holds=None) -> dict:
    """``{key: {seed: result}}`` for every key: the cells ``path`` holds for ``signature`` (with
    every one of ``seeds``: ``finished``), and the rest run now by ``workers.run`` (after
    ``before()``, e.g. a stage every cell needs), each appended to ``path`` as it finishes.
    ``steps_per_key`` sizes the progress bar; ``holds``: as ``load_cells``."""
    done = finished(path, signature, keys, seeds, holds)
    todo = [k for k in keys if k not in done]
    if done:
        print(f"{desc}: {len(done)} cells already done in {path} (settings {signature}), skipped; {len(todo)} to run")
    if todo:
        if before is not None:
            before()
        done.update(workers.run(fn, todo, arrays, context, n_workers, total=len(todo) * steps_per_key, desc=desc,
                                on_result=lambda key, res: save_cell(path, signature, key, res)))
    return done
