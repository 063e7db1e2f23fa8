"""What a stopped token-budget sweep keeps: every finished tuning seed, and a run's mid-run snapshot
until its row is kept."""

import pytest

from experiments.token_budget import jobs as cell_jobs
from vitmm.study import store


def _fake_training(monkeypatch, stop_at=None):
    """Each run writes its snapshot as a real run does mid-way, then returns (or, at seed
    ``stop_at``, is stopped)."""
    monkeypatch.setattr(cell_jobs, "_run", lambda c, key, lr, warmup: "run")

    def train_and_eval(run, seed, *args, snapshot=None, keep_snapshot=False, **kwargs):
        snapshot.parent.mkdir(exist_ok=True)
        snapshot.write_text("mid-run state")
        if seed == stop_at:
            raise KeyboardInterrupt
        return {"accuracy": 0.1 * seed}

    monkeypatch.setattr(cell_jobs, "train_and_eval", train_and_eval)


def _context(tmp_path, log):
    return {"jobs": {("pool", 16, ""): {"view": ""}}, "plan": {"max_steps": 4}, "tune_seeds": [0, 1, 2],
            "snapshots": (str(tmp_path / "snapshots"), "sig"), "tune_log": (str(log), "sig")}


def test_a_stopped_tuning_point_keeps_its_finished_seeds_and_the_stopped_runs_snapshot(tmp_path, monkeypatch):
    """``--tune_seeds 3`` stopped during seed 1: seed 0's row is kept (its snapshot then removed)
    and seed 1's snapshot stays to resume from; the next sitting trains seeds 1 and 2 only."""
    key, log = ("pool", 16, 1e-3, 25), tmp_path / "tuning_seeds.jsonl"
    context = _context(tmp_path, log)
    _fake_training(monkeypatch, stop_at=1)
    with pytest.raises(KeyboardInterrupt):
        cell_jobs.tune_job(key, {"train": None, "val": None}, context, None)
    assert store.load_cells(log, "sig") == {key: {0: {"accuracy": 0.0}}}
    assert [p.exists() for p in (cell_jobs.snapshot_path(context, "tuning", key, s) for s in (0, 1))] == [False, True]

    _fake_training(monkeypatch)
    context["tune_done"] = store.load_cells(log, "sig")
    got = cell_jobs.tune_job(list(key), {"train": None, "val": None}, context, None)  # a list, as stored
    assert got == {0: {"accuracy": 0.0}, 1: {"accuracy": 0.1}, 2: {"accuracy": 0.2}}
    assert [list(row) for row in store.load_cells(log, "sig")[key].values()] == [["accuracy"]] * 3
    assert not list((tmp_path / "snapshots").iterdir())


def test_a_runs_snapshot_outlives_a_stop_before_its_row_is_kept(tmp_path, monkeypatch):
    """The row cannot be written (a stop, a full disk): the finished run's snapshot is still there,
    so the next sitting gets its result back without training it again."""
    key = ("pool", 16, 1e-3, 25)
    context = _context(tmp_path, tmp_path / "missing" / "tuning_seeds.jsonl")
    _fake_training(monkeypatch)
    with pytest.raises(FileNotFoundError):
        cell_jobs.tune_job(key, {"train": None, "val": None}, context, None)
    assert cell_jobs.snapshot_path(context, "tuning", key, 0).exists()
