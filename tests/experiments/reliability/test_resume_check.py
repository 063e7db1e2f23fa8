"""`python -m experiments.reliability resume_check` on the session's smoke CLIP."""

import importlib
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[3]


def test_resume_check_compares_a_resumed_run_step_by_step(clip_smoke_run):
    """``experiments/reliability/resume_check.py`` (on a GPU it separated nondeterminism from the resume): on
    this CPU the resumed and the repeated runs equal the straight one at every step."""
    script = importlib.import_module("experiments.reliability.resume_check")
    out = script.main(["--config", "configs/clip_scenes.py:smoke", "--half", "2", "--repeat",
                       "--set", f"input.data_dir={clip_smoke_run.data_dir}"])
    assert out["resume_exact"] and out["steps"] == 4 and out["stopped_at"] == 2
    assert out["resumed_continues"] and out["resumed_from"] == 2
    assert out["repeat"] == {"max_loss_difference": 0.0, "first_differing_step": None}
    assert len(set(out["param_checksums"].values())) == 1
    a, b = {1: 1.0, 2: 2.0, 3: 3.0}, {1: 1.0, 2: 2.5, 3: 2.0}
    assert script.compare(a, b, range(1, 4)) == {"max_loss_difference": 1.0, "first_differing_step": 2}


def test_a_second_run_that_starts_over_is_not_an_exact_resume(monkeypatch):
    """A "resumed" run that found no checkpoint trains steps 1..4 again and equals the straight run at
    every step; merged with the stopped run's steps it would read as an exact resume."""
    script = importlib.import_module("experiments.reliability.resume_check")

    def train(config, workdir, stop_at=None):  # deterministic: every run that starts at 0 logs the same losses
        steps = range(1, (stop_at or config["steps"]) + 1)
        return {"history": [{"step": s, "loss": 1.0 / s} for s in steps], "param_checksum": 7.0}

    monkeypatch.setattr(script, "load_config", lambda path, sets, steps, log_every: {"steps": steps})
    monkeypatch.setattr(script.trainer, "train", train)
    out = script.main(["--config", "unused.py", "--half", "2"])
    assert out["resumed_after_stop"]["first_differing_step"] is None  # the losses alone cannot tell
    assert not out["resumed_continues"] and out["resumed_from"] == 0
    assert not out["resume_exact"]
