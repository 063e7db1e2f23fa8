"""``vitmm.study.store``: finished cells kept and found again, and results tied to their tower."""

import json

import pytest

from vitmm.study import store


def test_results_are_tied_to_the_tower_they_were_made_with(tmp_path):
    """Signatures hold the tower's path, not its weights; a tower retrained elsewhere (same path,
    other numbers) must not add its runs to results made with another."""
    import numpy as np

    params = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": {"c": np.ones(2, np.float32)}}
    first = store.check_tower(tmp_path, tmp_path / "tower", params)
    assert json.loads((tmp_path / "tower.json").read_text())["fingerprint"] == first
    assert store.check_tower(tmp_path, tmp_path / "tower", {k: v for k, v in params.items()}) == first
    other = {**params, "a": params["a"] + np.float32(1e-6)}
    assert store.fingerprint(other) != first
    with pytest.raises(SystemExit, match=f"not the one the results in {tmp_path} were made with \\({first}"):
        store.check_tower(tmp_path, tmp_path / "tower", other)
    assert store.fingerprint({"a": params["a"].reshape(3, 2), "b": params["b"]}) != first  # shapes count


def test_a_cell_is_finished_when_it_holds_every_requested_seed(tmp_path):
    """Seeds are not part of a sweep's signature: asking for more seeds reopens a finished cell,
    whose kept seeds (in the cells or the seed log) are not trained again."""
    cells, log = tmp_path / "cells.jsonl", tmp_path / "seeds.jsonl"
    store.save_cell(cells, "sig", ("mlp", 16, ""), {0: {"a": 0}, 1: {"a": 1}})
    store.save_cell(cells, "other", ("pool", 16, ""), {0: {"a": 9}})
    store.save_cell(log, "sig", ("mlp", 16, ""), {2: {"a": 2}})
    keys = [("mlp", 16, ""), ("pool", 16, "")]
    assert store.finished(cells, "sig", keys, [0, 1]) == {("mlp", 16, ""): {0: {"a": 0}, 1: {"a": 1}}}
    assert store.finished(cells, "sig", keys, [1]) == {("mlp", 16, ""): {1: {"a": 1}}}
    assert store.finished(cells, "sig", keys, [0, 1, 2]) == {}
    assert store.seed_results([cells, log], "sig") == {("mlp", 16, ""): {0: {"a": 0}, 1: {"a": 1}, 2: {"a": 2}}}


def _cell(key, arrays, context, progress):  # module-level: worker processes import it by name
    progress.update(len(context["seeds"]))
    return {seed: {"accuracy": float(arrays["data"]["x"][key[0]] + seed)} for seed in context["seeds"]}


def test_run_cells_keeps_finished_cells_and_a_rerun_with_more_seeds_trains_only_those(tmp_path):
    """The README's own-study recipe (experiments/README.md): cells computed once, appended as they
    finish; the same call again computes nothing; more seeds compute only the new seeds' cells."""
    import numpy as np

    arrays, calls = {"data": {"x": np.arange(3.0)}}, []

    def counted(key, arrays, context, progress):
        calls.append((key, tuple(context["seeds"])))
        return _cell(key, arrays, context, progress)

    path, sig = tmp_path / "cells.jsonl", store.signature({"steps": 10})
    first = store.run_cells(path, sig, [(0,), (1,)], counted, arrays, {"seeds": [0, 1]}, 1, "t", 2, seeds=[0, 1])
    assert first == {(0,): {0: {"accuracy": 0.0}, 1: {"accuracy": 1.0}},
                     (1,): {0: {"accuracy": 1.0}, 1: {"accuracy": 2.0}}}
    again = store.run_cells(path, sig, [(0,), (1,)], counted, arrays, {"seeds": [0, 1]}, 1, "t", 2, seeds=[0, 1])
    assert again == first and len(calls) == 2
    store.run_cells(path, sig, [(0,), (1,), (2,)], counted, arrays, {"seeds": [0, 1]}, 1, "t", 2, seeds=[0, 1])
    assert calls[2:] == [((2,), (0, 1))]  # only the new cell
    other = store.run_cells(path, store.signature({"steps": 20}), [(0,)], counted, arrays, {"seeds": [0]}, 1, "t", 1)
    assert other == {(0,): {0: {"accuracy": 0.0}}} and len(calls) == 4  # other settings: computed again


def test_a_torn_last_line_is_skipped_with_a_warning_and_the_next_cell_starts_a_line_of_its_own(tmp_path):
    """A write cut short (a killed worker, a full disk) leaves half a line: loading warns and skips
    it instead of refusing every later sitting, and the next append is not glued onto it."""
    path = tmp_path / "seeds.jsonl"
    store.save_cell(path, "sig", ("pool", 4, ""), {0: {"a": 0}})
    with path.open("a") as f:
        f.write('{"signature": "sig", "key": ["pool", 16, ""], "resu')
    with pytest.warns(UserWarning, match=r"seeds.jsonl:2 is not a whole JSON line"):
        assert store.load_cells(path, "sig") == {("pool", 4, ""): {0: {"a": 0}}}
    store.save_cell(path, "sig", ("ldp", 16, ""), {1: {"a": 1}})
    with pytest.warns(UserWarning, match=r"seeds.jsonl:2 "):
        assert store.load_cells(path, "sig") == {("pool", 4, ""): {0: {"a": 0}}, ("ldp", 16, ""): {1: {"a": 1}}}
    assert path.read_text().endswith('"resu\n' + json.dumps({"signature": "sig", "key": ["ldp", 16, ""],
                                                            "results": {"1": {"a": 1}}}) + "\n")


def test_each_key_may_carry_its_own_signature_and_old_rows_are_re_signed_to_it(tmp_path):
    """A study that signs each key with its own settings (e.g. the run's learning rate) passes a
    function of the key; ``resign`` moves rows signed the old way to it, leaving other rows and
    keys it has no signature for as they were."""
    path = tmp_path / "cells.jsonl"
    rates = {("pool", 4): "lr3e-4", ("mlp", 4): "lr1e-3"}
    own = rates.get  # a key with no rate (not in this sweep) has no signature
    store.save_cell(path, "old", ("pool", 4), {0: {"a": 0}})
    store.save_cell(path, "old", ("gone", 4), {0: {"a": 1}})
    store.save_cell(path, "other", ("mlp", 4), {0: {"a": 2}})
    store.save_cell(path, own, ("mlp", 4), {1: {"a": 3}})
    assert json.loads(path.read_text().splitlines()[-1])["signature"] == "lr1e-3"
    assert store.load_cells(path, own) == {("mlp", 4): {1: {"a": 3}}}
    assert store.resign([path, tmp_path / "absent.jsonl"], "old", own) == 1
    assert [json.loads(line)["signature"] for line in path.read_text().splitlines()] == [
        "lr3e-4", "old", "other", "lr1e-3"]
    assert store.load_cells(path, own) == {("pool", 4): {0: {"a": 0}}, ("mlp", 4): {1: {"a": 3}}}
    assert store.resign([path], "old", own) == 0  # idempotent: nothing left to move


def test_a_rewritten_file_is_synced_before_it_replaces_the_old_one(tmp_path, monkeypatch):
    """``resign`` rewrites the rows of days of runs and ``check_tower`` pins the tower: each file is
    written aside and synced before the rename, so that a crash leaves the old file or the new one,
    never an empty one; a sync that fails (a full disk) leaves the old file as it was, no temporary."""
    import numpy as np

    path = tmp_path / "cells.jsonl"
    store.save_cell(path, "old", ("pool", 4), {0: {"a": 0}})
    before = path.read_text()

    def full_disk(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store.os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space"):
        store.resign([path], "old", lambda key: "new")
    with pytest.raises(OSError, match="No space"):
        store.check_tower(tmp_path, tmp_path / "tower", {"a": np.ones(2, np.float32)})
    assert path.read_text() == before and sorted(p.name for p in tmp_path.iterdir()) == ["cells.jsonl"]


def test_writers_appending_to_one_file_take_turns_so_no_row_is_split_or_blank(tmp_path):
    """Workers append each finished seed to one ``seeds.jsonl``: a writer whose line is on its way
    (a reader may see part of it) holds the file, so the next one neither sees it as torn (and adds
    a blank line) nor writes into it. A blank line (from before) is skipped without a warning."""
    import fcntl
    import threading
    import time
    import warnings

    path = tmp_path / "seeds.jsonl"
    other = json.dumps({"signature": "sig", "key": ["pool", 4, ""], "results": {"0": {"a": 0}}})
    started = threading.Event()

    def slow_writer():
        with path.open("ab") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            f.write(other[:20].encode())
            f.flush()
            started.set()
            time.sleep(0.3)
            f.write((other[20:] + "\n").encode())

    thread = threading.Thread(target=slow_writer)
    thread.start()
    started.wait()
    store.save_cell(path, "sig", ("ldp", 16, ""), {1: {"a": 1}})
    thread.join()
    assert path.read_text().splitlines()[0] == other
    with path.open("a") as f:
        f.write("\n")
    store.save_cell(path, "sig", ("mlp", 4, ""), {2: {"a": 2}})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert set(store.load_cells(path, "sig")) == {("pool", 4, ""), ("ldp", 16, ""), ("mlp", 4, "")}
