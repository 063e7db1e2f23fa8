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
    assert out["repeat"] == {"max_loss_difference": 0.0, "first_differing_step": None}
    assert len(set(out["param_checksums"].values())) == 1
    a, b = {1: 1.0, 2: 2.0, 3: 3.0}, {1: 1.0, 2: 2.5, 3: 2.0}
    assert script.compare(a, b, range(1, 4)) == {"max_loss_difference": 1.0, "first_differing_step": 2}
