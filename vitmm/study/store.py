"""Cells × seeds that survive a stop: each finished cell is appended to a ``.jsonl`` file under
the settings' signature (the sweep's, or each key's own) as it ends, and a rerun with the same
settings skips it (with more seeds, it trains only the new ones). A study's results also hold the
one frozen model its cells read (``check_tower``), so that sittings on several machines are never
mixed.

A cell is one point of a study's grid (e.g. ``(family, tokens)``) with a result per seed; a study
names its cells, gives ``run_cells`` a module-level function that computes one cell's seeds, and
gets back ``{key: {seed: result}}``."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import pathlib
import warnings

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
        _replace(record, json.dumps({"workdir": str(tower_dir), "fingerprint": current}, indent=1) + "\n")
    return current


def _replace(path: pathlib.Path, text: str) -> None:
    """``path`` holds ``text`` whole, or what it held before: written aside, synced, then renamed
    over it (a rename alone, unsynced, can leave an empty file after a crash on some filesystems)."""
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        with tmp.open("w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def signed(signature, key) -> str | None:
    """The signature ``key``'s rows carry: ``signature`` itself, or ``signature(key)`` where a study
    signs each key with its own settings (e.g. a run's learning rate; None: no settings for it)."""
    return signature(tuple(key)) if callable(signature) else signature


def _rows(path: pathlib.Path) -> list[dict]:
    """The rows of a ``.jsonl`` file; a line that does not parse (torn by a kill or a full disk
    mid-write) is skipped with a warning naming it, so that the rest still load."""
    rows = []
    for number, line in enumerate(path.read_text().splitlines() if path.is_file() else (), 1):
        if not line.strip():  # no row (two writers once both ended a line they took for torn)
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            warnings.warn(f"{path}:{number} is not a whole JSON line (a write cut short?); skipped: {line[:80]!r}",
                          stacklevel=3)
    return rows


def load_cells(path: pathlib.Path, signature, holds=None) -> dict:
    """Finished cells ``{key: {seed: result}}`` (key: a tuple, e.g. ``(family, tokens)``) of a
    sweep with these settings (``signature``: one for every key, or a function of the key:
    ``signed``); lines of one key (e.g. one per finished seed) are merged. With
    ``holds(result) -> bool``, only the results it accepts (a setting left out of the signature
    that a result may or may not be valid for, e.g. ``holds_under_min_steps``)."""
    cells: dict = {}
    for cell in _rows(path):
        key = tuple(cell["key"])
        if cell["signature"] == signed(signature, key):
            results = {int(k): v for k, v in cell["results"].items() if holds is None or holds(v)}
            if results:
                cells.setdefault(key, {}).update(results)
    return cells


def finished(path: pathlib.Path, signature, keys, seeds=None, holds=None) -> dict:
    """The cells of ``keys`` a rerun skips: those holding every one of ``seeds`` (their results
    only; ``None``: any seeds). A sweep's signature leaves its seed list out, so rerunning it with
    more seeds trains only the new ones (with ``seed_results``, each missing seed of a cell)."""
    cells = load_cells(path, signature, holds)
    if seeds is None:
        return {k: cells[k] for k in keys if k in cells}
    return {k: {s: cells[k][s] for s in seeds} for k in keys if k in cells and set(seeds) <= set(cells[k])}


def seed_results(paths, signature, holds=None) -> dict:
    """Every finished seed ``{key: {seed: result}}`` recorded in any of ``paths`` (the finished
    cells and the per-seed log) under this signature (and accepted by ``holds``)."""
    merged: dict = {}
    for path in paths:
        for key, by_seed in load_cells(pathlib.Path(path), signature, holds).items():
            merged.setdefault(key, {}).update(by_seed)
    return merged


def save_cell(path: pathlib.Path, signature, key, results: dict) -> None:
    """Appends one finished cell (all its seeds) as a line of a ``.jsonl`` file, synced to disk;
    on a line of its own even after a torn last line (``_rows`` skips that one). Writers (a sweep's
    workers) take turns: one whose line is on its way holds the file, so that the next does not
    take that line for torn."""
    line = json.dumps({"signature": signed(signature, key), "key": list(key),
                       "results": {str(k): v for k, v in results.items()}})
    with path.open("a+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)  # released when the file closes
        end = os.fstat(f.fileno()).st_size  # now, not when the file was opened
        torn = end > 0 and os.pread(f.fileno(), 1, end - 1) != b"\n"
        f.write((("\n" if torn else "") + line + "\n").encode())
        f.flush()
        os.fsync(f.fileno())


def resign(paths, old: str, new) -> int:
    """Rewrites the rows of ``paths`` signed ``old`` as ``signed(new, key)`` (what a signature
    names changed, not the settings; a key ``new`` has no signature for keeps ``old``); each file
    written aside, then renamed over it, so run it while no sweep appends there. Lines that do not
    parse are kept as they are. Returns how many rows changed."""
    changed = 0
    for path in map(pathlib.Path, paths):
        if not path.is_file():
            continue
        lines, hits = path.read_text().splitlines(), 0
        for i, line in enumerate(lines):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            sig = signed(new, row["key"])
            if row["signature"] == old and sig not in (None, old):
                lines[i], hits = json.dumps({**row, "signature": sig}), hits + 1
        if hits:
            _replace(path, "".join(line + "\n" for line in lines))
            changed += hits
    return changed


def run_cells(path: pathlib.Path, signature, keys: list, fn, arrays: dict, context: dict, n_workers: int,
              desc: str, steps_per_key: int, seeds=None, before=None, holds=None) -> dict:
    """``{key: {seed: result}}`` for every key: the cells ``path`` holds for ``signature`` (with
    every one of ``seeds``: ``finished``), and the rest run now by ``workers.run`` (after
    ``before()``, e.g. a stage every cell needs), each appended to ``path`` as it finishes.
    ``steps_per_key`` sizes the progress bar; ``holds``: as ``load_cells``."""
    done = finished(path, signature, keys, seeds, holds)
    todo = [k for k in keys if k not in done]
    if done:
        settings = f" (settings {signature})" if isinstance(signature, str) else ""
        print(f"{desc}: {len(done)} cells already done in {path}{settings}, skipped; {len(todo)} to run")
    if todo:
        if before is not None:
            before()
        done.update(workers.run(fn, todo, arrays, context, n_workers, total=len(todo) * steps_per_key, desc=desc,
                                on_result=lambda key, res: save_cell(path, signature, key, res)))
    return done
