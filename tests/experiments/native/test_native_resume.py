"""What a stopped native-tokens study keeps: a finished run's mid-run snapshot stays until its row
is kept, so that a stop in between (e.g. while its steps are timed) does not lose the run."""

import pytest

from experiments.common import feature_vlm
from experiments.native import tokens
from vitmm.study import store


def _fake_training(monkeypatch, stop_timing=False):
    """Each run writes its snapshot mid-way and, as the real one, removes it at the end unless kept."""
    monkeypatch.setattr(tokens, "_run", lambda c, path, budget, lr: "run")

    def train_and_eval(run, seed, *args, snapshot=None, keep_snapshot=False, **kwargs):
        snapshot.parent.mkdir(exist_ok=True)
        snapshot.write_text("mid-run state")
        if not keep_snapshot:
            snapshot.unlink()
        return {"accuracy": 0.1 * seed}

    def time_steps(*args, **kwargs):
        if stop_timing:
            raise KeyboardInterrupt
        return {"train_ms": 1.0}

    monkeypatch.setattr(feature_vlm, "train_and_eval", train_and_eval)
    monkeypatch.setattr(feature_vlm, "time_steps", time_steps)


def _context(tmp_path):
    return {"chosen": {"square": 1e-3}, "plan": {"max_steps": 4, "batch_size": 2}, "seeds": [0], "stage1_steps": 0,
            "snapshots": (str(tmp_path / "snapshots"), "sig"), "seed_log": (str(tmp_path / "seeds.jsonl"), "sig")}


def test_a_cells_snapshot_outlives_a_stop_before_its_row_is_kept(tmp_path, monkeypatch):
    key, context = ("square", 16), _context(tmp_path)
    snapshot = feature_vlm.snapshot_path(context, key, 0, 1e-3)  # the name it always had
    _fake_training(monkeypatch, stop_timing=True)
    with pytest.raises(KeyboardInterrupt):
        tokens.cell_job(key, {"train": None, "val": None, "test": None}, context, None)
    assert snapshot.exists() and not (tmp_path / "seeds.jsonl").exists()
    _fake_training(monkeypatch)
    assert tokens.cell_job(key, {"train": None, "val": None, "test": None}, context, None) == {
        0: {"accuracy": 0.0, "train_ms": 1.0}}
    assert store.load_cells(tmp_path / "seeds.jsonl", "sig") == {key: {0: {"accuracy": 0.0, "train_ms": 1.0}}}
    assert not snapshot.exists()


def test_a_tuning_runs_snapshot_stays_until_the_sweep_has_kept_its_row(tmp_path, monkeypatch):
    """A tuning point's row is written by the sweep's process once the job is back; only then is
    the snapshot removed (``forget_snapshots``)."""
    key, context = ("square", 16, 1e-3), _context(tmp_path)
    snapshot = feature_vlm.snapshot_path(context, "tuning", key, 0)
    _fake_training(monkeypatch)
    assert tokens.tune_job(key, {"train": None, "val": None}, context, None) == {0: {"accuracy": 0.0}}
    assert snapshot.exists()
    tokens.forget_snapshots(context, "tuning", {key: {0: {"accuracy": 0.0}}})
    assert not snapshot.exists()
