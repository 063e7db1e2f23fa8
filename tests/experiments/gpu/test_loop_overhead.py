"""`python -m experiments.gpu loop_overhead` and `memory_check` on the session's smoke CLIP."""

import importlib
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]


def test_loop_overhead_times_the_loop_and_its_bare_step(clip_smoke_run):
    """``experiments/gpu/loop_overhead.py``: the trainer's logged speed after the skipped intervals and
    the same compiled step alone (``trainer.build``)."""
    script = importlib.import_module("experiments.gpu.loop_overhead")
    # 4 steps, the smoke's own: the step compiles to the program the session's smoke run cached.
    out = script.main(["--config", "configs/clip_scenes.py:smoke", "--steps", "4",
                       "--log_every", "1", "--set", f"input.data_dir={clip_smoke_run.data_dir}"])
    assert out["loop"]["intervals"] == 2 and out["batch_size"] == 16
    assert out["loop"]["img_per_s"] > 0 and out["bare"]["img_per_s"] > 0
    assert out["ratio"] == out["loop"]["img_per_s"] / out["bare"]["img_per_s"] and 0.2 < out["ratio"] < 2
    with pytest.raises(SystemExit, match="too few intervals"):
        script.main(["--config", "configs/clip_scenes.py:smoke", "--steps", "4", "--log_every", "2",
                     "--set", f"input.data_dir={clip_smoke_run.data_dir}"])
    bare = script.main(["--config", "configs/clip_scenes.py:smoke", "--steps", "4", "--log_every", "2",
                        "--bare_only", "--set", f"input.data_dir={clip_smoke_run.data_dir}"])
    assert bare["loop"] is None and bare["ratio"] is None and bare["bare"]["img_per_s"] > 0


def test_memory_check_plans_and_runs_the_step(clip_smoke_run, tmp_path):
    """``experiments/gpu/memory_check.py`` (the device's check of ``--dry_run``): on the CPU the plan
    and the step run, and the missing allocator statistics are said, not invented."""
    script = importlib.import_module("experiments.gpu.memory_check")
    out = script.main(["--config", "configs/clip_scenes.py:smoke", "--set", f"input.data_dir={clip_smoke_run.data_dir}",
                       "--out", str(tmp_path / "m.json")])
    assert out["planned_step_bytes"] > 0 and out["measured"] == "no allocator statistics on this backend"
    assert (tmp_path / "m.json").exists() and out["table"]["backend"] == "h100"


@pytest.mark.parametrize("script", ["session.sh", "trainer.sh", "carry.sh", "bench.sh", "site.sh"])
def test_the_device_scripts_parse(script):
    """The shell scripts a lent GPU runs once, unrehearsed there: at least they parse (``bash -n``); the
    whole session runs at smoke size with ``TINY_DATA=DIR bash experiments/gpu/session.sh --tiny`` (~4 minutes)."""
    import subprocess

    result = subprocess.run(["bash", "-n", str(ROOT / "experiments/gpu" / script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
