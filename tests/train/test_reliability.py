"""What a run survives: preemption, a second writer, corrupt checkpoints, failed saves, an
evaluator that fails, resumed logs, config changes, and bad input that fails in one line."""

import importlib
import json
import os
import pathlib
import re
import shutil
import socket
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from test_trainer import ROOT, smoke_config

from vitmm import checkpoint as ckpt_lib
from vitmm.train import trainer
from vitmm.train import workdir as workdir_lib


def _losses(workdir: pathlib.Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


@pytest.fixture
def straight(clip_every_step_run):
    """The smoke config logged every step and checkpointed every step, uninterrupted (trained once
    per session: read-only, tests copy it)."""
    run = clip_every_step_run
    return run.workdir, run.summary, smoke_config(run.data_dir, evals=False, log_every=1, checkpoint_every=1)


# ------------------------------------------------------------------------------------ checkpoints
@pytest.mark.parametrize("damage", ["missing_file", "truncated_file", "empty_folder"])
def test_an_unreadable_latest_checkpoint_is_skipped_for_the_previous_one(tmp_path, straight, capfd, caplog, damage):
    workdir, summary, config = straight
    shutil.copytree(workdir / "checkpoints", tmp_path / "checkpoints")
    ckpt_lib.Checkpointer(tmp_path).close()
    latest = tmp_path / "checkpoints" / "4"
    files = sorted(p for p in (latest / "state").rglob("*") if p.is_file() and p.stat().st_size > 0)
    if damage == "missing_file":
        (latest / "state" / "_METADATA").unlink()
    elif damage == "truncated_file":
        for p in files:
            p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
    else:
        shutil.rmtree(latest)
        latest.mkdir()
    resumed = trainer.train(config, tmp_path)
    out, err = capfd.readouterr()
    warning = [line for line in out.splitlines() if line.startswith("Warning:")]
    assert len(warning) == 1 and "skipping the unreadable checkpoint at step 4" in warning[0], out
    assert f"the full error is in {tmp_path / 'errors.log'})" in warning[0] and "Resumed from step 3" in out
    # TensorStore's spec dumps and asyncio's "Task exception was never retrieved" tracebacks went to
    # the console (91 lines for a truncated file); they belong in errors.log.
    printed = err + "\n".join(r.getMessage() for r in caplog.records)
    assert "Traceback" not in printed and "Task exception" not in printed and "tensorstore" not in printed.lower()
    assert resumed["final_step"] == 4
    assert resumed["param_checksum"] == pytest.approx(summary["param_checksum"], rel=1e-6)


def test_no_readable_checkpoint_stops_renames_nothing_and_only_restart_starts_afresh(tmp_path, straight, capsys):
    """Every checkpoint unreadable: the run stops and renames nothing (the fault may be the run's, not the
    files'); rerun, it still refuses; ``restart`` sets them aside, keeps the log aside and trains from step 0."""
    workdir, summary, config = straight
    for name in ("checkpoints", "metrics.jsonl"):
        (shutil.copytree if name == "checkpoints" else shutil.copy)(workdir / name, tmp_path / name)
    for step in (3, 4):  # the two it keeps
        shutil.rmtree(tmp_path / "checkpoints" / str(step))
        (tmp_path / "checkpoints" / str(step)).mkdir()
    for _ in range(2):
        with pytest.raises(ckpt_lib.NoReadableCheckpoint, match=r"No readable checkpoint in .*step 4.*step 3.*Nothing "
                           r"was restored or renamed.*--restart"):
            trainer.train(config, tmp_path)
        assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["3", "4"]
    log = (tmp_path / "metrics.jsonl").read_text()
    capsys.readouterr()
    again = trainer.train(config, tmp_path, restart=True)
    assert "Restarting from step 0" in capsys.readouterr().out
    assert {"3.unreadable", "4.unreadable"} <= {p.name for p in (tmp_path / "checkpoints").iterdir()}
    assert (tmp_path / "metrics.before-restart.jsonl").read_text() == log
    assert again["param_checksum"] == pytest.approx(summary["param_checksum"], rel=1e-6)
    assert _losses(tmp_path) == _losses(workdir)


def test_a_changed_optimizer_is_refused_in_one_line_and_no_checkpoint_is_touched(tmp_path, straight):
    """A new optimizer layout (``optim.freeze`` wraps it in a multi-transform) cannot read the saved
    state: the config check runs before any state is read, so the run is refused, not set aside."""
    workdir, _, config = straight
    shutil.copytree(workdir / "checkpoints", tmp_path / "checkpoints")
    frozen = smoke_config(config.input.data_dir, evals=False, log_every=1, checkpoint_every=1,
                          **{"optim.freeze": ("txt/.*",)})
    with pytest.raises(workdir_lib.ConfigChanged, match=r"would change optim/freeze"):
        trainer.train(frozen, tmp_path)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["3", "4"]
    with frozen.unlocked():
        frozen.allow_config_change = True  # told to go on: the optimizer state does not fit, said as such
    with pytest.raises(ckpt_lib.CheckpointMismatch, match=r"optimizer state saved at step 4 .* does not fit this "
                                                          r"run's optimizer .*optim.freeze.*init.checkpoint="):
        trainer.train(frozen, tmp_path)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["3", "4"]  # not damaged: not set aside


def test_a_log_past_the_first_checkpoints_with_no_checkpoint_is_an_earlier_run(tmp_path):
    """Logged steps past twice ``checkpoint_every`` mean a checkpoint was committed and is gone;
    earlier ones may be a run killed before its first save finished (starting over loses nothing)."""
    rows = lambda n: "".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, n + 1))  # noqa: E731
    (tmp_path / "metrics.jsonl").write_text(rows(8) + '{"step": 9, "lo')
    assert workdir_lib.history_without_checkpoint(tmp_path, 4) == []
    (tmp_path / "metrics.jsonl").write_text(rows(9))
    assert workdir_lib.history_without_checkpoint(tmp_path, 4) == ["metrics.jsonl logged up to step 9"]
    (tmp_path / "checkpoints" / "4").mkdir(parents=True)  # a step folder: the checkpoint's turn to resume or report
    assert workdir_lib.history_without_checkpoint(tmp_path, 4) == []


def test_a_resume_without_metrics_jsonl_rebuilds_it_from_tensorboard(tmp_path, straight, capsys):
    workdir, _, config = straight
    shutil.copytree(workdir, tmp_path / "w", ignore=shutil.ignore_patterns("lock"))
    (tmp_path / "w" / "metrics.jsonl").unlink()
    trainer.train(config, tmp_path / "w")  # finished at step 4: restores, then nothing to train
    assert "metrics.jsonl in" in capsys.readouterr().out
    rebuilt = [json.loads(line) for line in (tmp_path / "w" / "metrics.jsonl").read_text().splitlines()]
    original = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rebuilt] == [r["step"] for r in original] == [1, 2, 3, 4]
    for new, old in zip(rebuilt, original, strict=True):
        assert set(new) == set(old)
        np.testing.assert_allclose([new[k] for k in old], [old[k] for k in old], rtol=1e-6)  # float32 in TensorBoard


def test_a_failed_background_save_stops_the_run_naming_the_cause(tmp_path, straight, monkeypatch):
    """The save of step 3 fails in the background (as on a full disk): the run stops at once with
    the path and the cause, step 3 never becomes a checkpoint, step 2 stays intact."""
    import orbax.checkpoint as ocp

    _, _, config = straight
    real = ocp.StandardCheckpointHandler.async_save
    calls = []

    class NoSpace:
        def result(self, timeout=None):
            raise OSError(28, "No space left on device")

    async def async_save(self, directory, *args, **kwargs):
        calls.append(directory)
        futures = await real(self, directory, *args, **kwargs)
        return list(futures or []) + [NoSpace()] if len(calls) == 3 else futures

    monkeypatch.setattr(ocp.StandardCheckpointHandler, "async_save", async_save)
    with pytest.raises(ckpt_lib.SaveFailed, match=r"checkpoints failed: \[Errno 28\] No space left on device \(the "
                                                  r"full error is in .*errors.log\)\. .*step 2 is intact"):
        trainer.train(config, tmp_path)
    monkeypatch.setattr(ocp.StandardCheckpointHandler, "async_save", real)
    assert ckpt_lib.Checkpointer(tmp_path).all_steps() == [1, 2]
    assert "Traceback" in (tmp_path / "errors.log").read_text()


def test_a_failed_background_save_is_seen_before_the_next_save_and_the_intact_step_named(tmp_path, monkeypatch):
    """orbax keeps a failed commit's error in its finalize thread: it is raised as soon as that
    thread ends (not at the next save, steps later), and the message names the step still on disk
    although orbax's own list has dropped it (keep=1: the failed save was to replace it)."""
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    real = ocp.StandardCheckpointHandler.async_save

    class NoSpace:
        def result(self, timeout=None):
            raise OSError(28, "No space left on device")

    async def async_save(self, directory, *args, **kwargs):
        futures = await real(self, directory, *args, **kwargs)
        step_2 = any(part == "2" or part.startswith("2.") for part in pathlib.Path(directory).parts)  # not the
        return list(futures or []) + [NoSpace()] if step_2 else futures  # tmp path's digits ("pytest-215")

    monkeypatch.setattr(ocp.StandardCheckpointHandler, "async_save", async_save)
    checkpointer = ckpt_lib.Checkpointer(tmp_path, keep=1)
    state = {"params": {"w": jnp.ones(3)}, "step": jnp.zeros((), jnp.int32)}
    checkpointer.save(1, state, {}, {})
    checkpointer.wait()
    checkpointer.save(2, state, {}, {})
    with pytest.raises(ckpt_lib.SaveFailed, match=r"No space left on device .*The checkpoint at step 1 is intact"):
        for _ in range(200):
            checkpointer.check_saves(3)
            time.sleep(0.05)
    monkeypatch.setattr(ocp.StandardCheckpointHandler, "async_save", real)
    assert ckpt_lib.step_folders(tmp_path) == [1]


def test_the_checkpoint_is_saved_before_a_failing_evaluation(tmp_path, clip_smoke_run, monkeypatch):
    from vitmm.train import tasks

    def broken(self):
        class Broken:
            def run(self, params, **aux):
                raise RuntimeError("evaluator failed")

            def clear(self):
                pass

        return {"broken": Broken()}

    monkeypatch.setattr(tasks.ContrastiveTask, "evaluators", broken)
    with pytest.raises(RuntimeError, match="evaluator failed"):
        trainer.train(smoke_config(clip_smoke_run.data_dir), tmp_path)
    assert ckpt_lib.Checkpointer(tmp_path).all_steps() == [4]
    # The last step's evaluation, owed by a run that stopped there, is run and logged by the rerun.
    monkeypatch.undo()
    summary = trainer.train(smoke_config(clip_smoke_run.data_dir), tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "zeroshot/accuracy" in r] == [4]
    assert summary["evals"] == clip_smoke_run.summary["evals"]


# ------------------------------------------------------------------------------------ logs, config, lock
def test_a_resume_drops_the_logged_steps_it_redoes_and_writes_the_config(tmp_path, straight):
    workdir, summary, config = straight
    killed = json.dumps({"step": 1, "loss": 9.0}) + "\n"  # a run killed before its first checkpoint
    (tmp_path / "metrics.jsonl").write_text(killed)
    first = trainer.train(config, tmp_path, stop_at=2)
    assert first["final_step"] == 2
    assert (tmp_path / "metrics.before-restart.jsonl").read_text() == killed  # kept aside, not overwritten
    with open(tmp_path / "metrics.jsonl", "a") as f:  # what a run killed after step 3 had logged
        f.write(json.dumps({"step": 3, "loss": 123.0}) + "\n" + '{"step": 4, "lo')
    trainer.train(config, tmp_path)
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
    assert _losses(tmp_path) == _losses(workdir)  # bit for bit on CPU
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["optim"]["lr"] == config.optim.lr and saved["total_steps"] == 4


def test_a_resume_with_a_changed_config_says_what_changed_and_refuses_what_matters(tmp_path, straight, capsys,
                                                                                   monkeypatch):
    _, _, config = straight
    trainer.train(config, tmp_path, stop_at=2)
    changed = smoke_config(straight[2].input.data_dir, evals=False, log_every=1, checkpoint_every=1,
                           **{"optim.lr": 0.5})
    closed, close = [], ckpt_lib.Checkpointer.close
    monkeypatch.setattr(ckpt_lib.Checkpointer, "close", lambda self: (closed.append(self), close(self))[1])
    with pytest.raises(workdir_lib.ConfigChanged, match=r"would change optim/lr:\n  optim/lr: 0.001 -> 0.5"):
        trainer.train(changed, tmp_path)
    assert len(closed) == 1 and closed[0]._closed  # the refused run's checkpoint manager closed, not left open
    monkeypatch.undo()
    assert ckpt_lib.Checkpointer(tmp_path).all_steps() == [1, 2]  # nothing written
    harmless = smoke_config(straight[2].input.data_dir, evals=False, log_every=2, checkpoint_every=1)
    assert trainer.train(harmless, tmp_path, stop_at=3)["final_step"] == 3
    assert "log_every: 1 -> 2" in capsys.readouterr().out
    assert trainer.train(harmless, tmp_path, stop_at=2)["final_step"] == 3  # already past it: nothing trained
    with changed.unlocked():
        changed.allow_config_change = True
    assert trainer.train(changed, tmp_path)["final_step"] == 4


def test_what_a_stop_tells_the_user_to_change_and_where_the_run_started_may_change_on_resume():
    """A stop on bad data says to raise ``input.max_skipped_share``; a resume reads its own checkpoint
    and pinned settings, not an ``init`` folder it pinned (which may have moved)."""
    import ml_collections

    saved = {"input": {"max_skipped_share": 0.01}, "init": {"lm": "/old/lm"}, "optim": {"lr": 1e-3}}
    now = ml_collections.ConfigDict({"input": {"max_skipped_share": 0.05}, "init": {"lm": "/new/lm"},
                                     "optim": {"lr": 1e-3}})
    with pytest.raises(workdir_lib.ConfigChanged, match="would change init/lm:"):  # not pinned: it is read
        workdir_lib.check_config_change(saved, now, "ckpt")
    assert len(workdir_lib.check_config_change(saved, now, "ckpt", also_safe=["init/lm"])) == 2  # pinned
    now.optim.lr = 0.5
    with pytest.raises(workdir_lib.ConfigChanged, match="would change optim/lr:"):
        workdir_lib.check_config_change(saved, now, "ckpt", also_safe=["init/lm"])


def test_a_full_disk_stops_the_command_in_one_line(tmp_path, monkeypatch, capsys):
    """An OSError the run meets outside a checkpoint save (the metrics log on a full disk) is one
    line naming the file and what to do, exit 1; its traceback goes to errors.log."""
    from vitmm.train import __main__ as cli

    log = tmp_path / "w" / "metrics.jsonl"

    def full_disk(*args, **kwargs):
        (tmp_path / "w").mkdir()
        raise OSError(28, "No space left on device", str(log))

    monkeypatch.setattr(cli.trainer, "train", full_disk)
    cli.parse_flags(["vitmm.train", f"--config={ROOT / 'configs/clip_scenes.py'}:smoke", f"--workdir={log.parent}"])
    with pytest.raises(SystemExit) as stop:
        cli.main([])
    assert stop.value.code == 1
    assert capsys.readouterr().err.splitlines() == [
        f"python -m vitmm.train: [Errno 28] No space left on device: '{log}'; the full error is in "
        f"{log.parent / 'errors.log'}. Free space or fix the path, then rerun the same command (a run resumes "
        "from its last checkpoint)."]
    assert "Traceback" in (log.parent / "errors.log").read_text()


def test_restart_sets_the_old_log_aside_only_once_the_run_is_checked(tmp_path, straight, monkeypatch):
    _, _, config = straight
    rows = "".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 10))
    (tmp_path / "metrics.jsonl").write_text(rows)

    def bad_data(*args, **kwargs):
        raise ValueError("input.data_path=typo: no such file")

    monkeypatch.setattr(trainer.inputs, "make", bad_data)
    with pytest.raises(ValueError, match="typo"):
        trainer.train(config, tmp_path, restart=True)
    assert (tmp_path / "metrics.jsonl").read_text() == rows and not list(tmp_path.glob("metrics.before*"))


def test_a_setting_added_to_the_configs_at_none_is_no_change():
    """A checkpoint from before a key existed resumes under a config holding it at None (e.g. the kernel
    keys, ``configs/common.py:kernels``); at any other value it is a change."""
    saved = {"model": {"lm": {"width": 8}}, "seed": 0}
    assert workdir_lib.config_differences(saved, {"model": {"lm": {"width": 8, "attn_impl": None}}, "seed": 0}) == []
    assert workdir_lib.config_differences(saved, {"model": {"lm": {"width": 8, "attn_impl": "cudnn"}}, "seed": 0}) == \
        [("model/lm/attn_impl", "<absent>", "cudnn")]
    assert workdir_lib.config_differences({**saved, "seed": None}, {"model": {"lm": {"width": 8}}}) == []
    assert workdir_lib.config_differences(saved, {**saved, "deterministic": False}) == \
        [("deterministic", "<absent>", False)]  # reported; SAFE_TO_CHANGE lets it through


def test_one_writer_per_workdir_and_a_stale_lock_is_taken_over(tmp_path, straight, capsys):
    lock = workdir_lib.Lock(tmp_path)
    lock.acquire()
    with pytest.raises(workdir_lib.WorkdirLocked, match=rf"in use by pid {os.getpid()} on "):
        trainer.train(straight[2], tmp_path)
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "metrics.jsonl").exists()
    lock.release()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / "lock").write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid, "started": "x"}))
    second = workdir_lib.Lock(tmp_path)
    second.acquire()
    assert f"stale lock of pid {dead.pid}" in capsys.readouterr().out
    assert json.loads((tmp_path / "lock").read_text())["pid"] == os.getpid()
    second.release()
    assert not (tmp_path / "lock").exists()
    # A file naming a live pid (ours: a restarted container reuses pids) whose run holds no lock is stale too.
    (tmp_path / "lock").write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": "x"}))
    third = workdir_lib.Lock(tmp_path)
    third.acquire()
    third.release()
    # Another process holding it (on any host: the lock is the file system's) is refused until it dies, kill -9 too.
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, json, os, sys, time
        fd = os.open({str(tmp_path / "lock")!r}, os.O_CREAT | os.O_RDWR)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, json.dumps({{"host": "elsewhere", "pid": 12345, "started": "y"}}).encode())
        print("held", flush=True)
        time.sleep(60)""")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(workdir_lib.WorkdirLocked, match=r"in use by pid 12345 on elsewhere"):
            workdir_lib.Lock(tmp_path).acquire()
    finally:
        holder.kill()
        holder.wait()
    fourth = workdir_lib.Lock(tmp_path)
    fourth.acquire()
    fourth.release()


# ------------------------------------------------------------------------------------ preemption
def _train_command(workdir, data_dir, *overrides, config="configs/clip_scenes.py:smoke"):
    return [sys.executable, "-m", "vitmm.train", "--config", config, "--workdir", str(workdir),
            f"--config.input.data_dir={data_dir}", *overrides]


# ``python -m vitmm.train`` with the training input wrapped so that the process sends itself the
# signal while it fetches batch 3: a real signal, delivered at a known step.
SIGNALLING = f"""
import sys
sys.path.insert(0, {str(pathlib.Path(__file__).resolve().parent)!r})
from absl import app
from vitmm import xla_flags
xla_flags.use_vitmm_defaults()
import signalling
from vitmm.train import __main__ as cli
signalling.send_at_batch(3, "{{sig}}")
sys.argv = ["vitmm.train"] + sys.argv[1:]
app.run(cli.main, flags_parser=cli.parse_flags)
"""


def test_ctrl_c_twice_stops_at_once_in_one_line(tmp_path, straight):
    script = tmp_path / "signalling.py"
    script.write_text(SIGNALLING.replace("{sig}", "SIGINT,SIGINT"))
    env = dict(os.environ, XLA_FLAGS=os.environ["VITMM_TEST_XLA_FLAGS_4_DEVICES"])
    run = subprocess.run([sys.executable, str(script), "--config", "configs/clip_scenes.py:smoke", "--workdir",
                          str(tmp_path / "run"), f"--config.input.data_dir={straight[2].input.data_dir}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 130 and "Traceback" not in run.stderr, run.stderr[-3000:]
    assert [line for line in run.stderr.splitlines() if line.startswith("python -m vitmm.train:")] == [
        "python -m vitmm.train: Ctrl-C twice: stopped at once, the checkpoint of this step perhaps unfinished; "
        "rerun the same command to resume from the last one saved."]


def test_a_signal_saves_the_current_step_and_the_resumed_run_matches(tmp_path, straight):
    """SIGINT (Ctrl-C) at a known step. SIGTERM takes the same handler and is sent at a known step
    by the multi-host test (both processes save, the pair resumed from a checkpoint matches); at random
    moments by ``experiments/reliability/preemption_loop.py`` (results/reliability)."""
    workdir, summary, config = straight
    sig = "SIGINT"
    script = tmp_path / "signalling.py"
    script.write_text(SIGNALLING.replace("{sig}", sig))
    args = [f"--config.input.data_dir={config.input.data_dir}", "--config.log_every=1", "--config.checkpoint_every=100"]
    run = tmp_path / "run"
    env = dict(os.environ, XLA_FLAGS=os.environ["VITMM_TEST_XLA_FLAGS_4_DEVICES"])  # as the straight run had
    first = subprocess.run([sys.executable, str(script), "--config", "configs/clip_scenes.py:smoke", "--workdir",
                            str(run), *args], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert first.returncode == 75, first.stderr[-3000:]
    message = [line for line in first.stderr.splitlines() if line.startswith("python -m vitmm.train:")]
    assert message == [f"python -m vitmm.train: {sig} at step 3: checkpoint saved in {run}; rerun the same "
                       "command to resume."]
    assert ckpt_lib.Checkpointer(run).all_steps() == [3] and not (run / "lock").exists()
    again = subprocess.run(_train_command(run, config.input.data_dir, *args[1:]), cwd=ROOT, capture_output=True,
                           text=True, timeout=300, env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    # A quiet console: the bar and the run's own lines; none of the libraries' routine warnings
    # (absl's "W1206 12:00:00.0 ..." lines: TFDS's custom configuration, grain's OpenCV note).
    noise = [line for line in again.stderr.replace("\r", "\n").splitlines()
             if re.match(r"[IWEF]\d{4} |WARNING|Traceback", line)]
    assert noise == [], noise
    assert _losses(run) == _losses(workdir)  # the resumed loss curve equals the uninterrupted one, bit for bit
    import jax

    final, expected = ckpt_lib.load_params(run), ckpt_lib.load_params(workdir)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(final), jax.tree.leaves(expected), strict=True))


# ------------------------------------------------------------------------------------ bad input
def test_a_missing_config_file_fails_in_one_line_and_writes_nothing(tmp_path):
    result = subprocess.run([sys.executable, "-m", "vitmm.train", "--config", "configs/nope.py:smoke", "--workdir",
                             str(tmp_path / "w")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "python -m vitmm.train: --config configs/nope.py: no such file; the configs are in configs/ (listed in "
        "README.md).", "(--debug shows the traceback)"]
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize("args, message", [
    (["--config.lr=1e6"], "unknown config key 'lr'; did you mean optim.lr?"),
    (["--config.optim.lrr=1"], "unknown config key 'optim.lrr'; did you mean optim.lr?"),
    (["--config.log_every=0"], "config.log_every=0: must be a positive integer."),
    (["configs/clip_scenes.py:smoke,steps=-5"], "config.total_steps=-5: must be a positive integer."),
    (["--config.input.data.name=nope"], "Unknown dataset 'nope': TFDS has no builder of that name"),
    (["--workdir", "{tmp}/file/w"], "--workdir {tmp}/file/w: cannot write there (Not a directory); choose a folder"),
])
def test_bad_input_fails_in_one_line_with_exit_code_2_and_writes_nothing(tmp_path, data_dir, args, message):
    (tmp_path / "file").write_text("")
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    config = next((a for a in args if a.startswith("configs/")), "configs/clip_scenes.py:smoke")
    args = [a for a in args if a != config]
    result = subprocess.run(_train_command(tmp_path / "w", data_dir, *args, config=config), cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[1] == "(--debug shows the traceback)", result.stderr[-2000:]
    assert lines[0].startswith(f"python -m vitmm.train: {message.replace('{tmp}', str(tmp_path))}"), lines[0]
    assert not (tmp_path / "w").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_a_bare_word_in_the_config_arg_is_named():
    from vitmm import config_args

    with pytest.raises(ValueError, match=r"Cannot parse config arg 'smokey'.*did you mean 'smoke'"):
        config_args.load(ROOT / "configs/clip_scenes.py", "smokey")
    assert config_args.load(ROOT / "configs/frontend_demo.py", "L/14").model.variant == "L/14"  # a bare first arg


def test_a_budget_is_checked_against_the_grid_before_anything_is_allocated(tmp_path, data_dir):
    from vitmm.models.connectors import BudgetError

    c = smoke_config(data_dir, "vlm_scenes", "smoke,connector=perceiver,budget=100000", evals=False)
    start = time.perf_counter()
    with pytest.raises(BudgetError, match=r"gives 100000 visual tokens, more than the 4x4 = 16 patches"):
        trainer.train(c, tmp_path / "w")
    assert time.perf_counter() - start < 30
    assert not (tmp_path / "w").exists()  # refused: nothing written


def test_weights_files_that_cannot_be_read_are_named(tmp_path):
    from vitmm.interop import io

    src = ROOT / "tests/fixtures/interop/timm_vit/model.safetensors"
    cut = tmp_path / "model.safetensors"
    cut.write_bytes(src.read_bytes()[:1000])
    with pytest.raises(ValueError, match=rf"{cut} could not be read .*truncated"):
        io.read_tensors(cut)
    pickle = tmp_path / "pytorch_model.bin"
    pickle.write_bytes(b"not really")
    try:
        import torch  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match=r"PyTorch file; reading it needs PyTorch installed"):
            io.read_tensors(pickle)
    else:
        with pytest.raises(ValueError, match="could not be read"):
            io.read_tensors(pickle)


def test_init_vision_honours_dont_load(clip_smoke_run):
    import jax
    import jax.numpy as jnp

    from vitmm.models import vlm as vlm_lib

    vision = smoke_config(clip_smoke_run.data_dir).model.image.to_dict()
    model = vlm_lib.VLM(vision, {"name": "pool", "budget": 4}, dict(vocab_size=259, width=32, depth=1, num_heads=4))
    params = model.init(jax.random.key(0), jnp.zeros((1, 32, 32, 3)), jnp.zeros((1, 4), jnp.int32))["params"]
    loaded = ckpt_lib.init_tower_from_clip(params, clip_smoke_run.workdir, dont_load=(r"tower/embedding/.*",))
    clip = ckpt_lib.load_params(clip_smoke_run.workdir)["img"]
    np.testing.assert_array_equal(loaded["tower"]["embedding"]["kernel"], params["tower"]["embedding"]["kernel"])
    jax.tree.map(np.testing.assert_array_equal, loaded["tower"]["encoder"], clip["encoder"])


# ------------------------------------------------------------------------------------ elastic resume
RESUME_ON_TWO_DEVICES = """
import json, sys
import ml_collections
from vitmm import config_args
from vitmm.train import trainer
import jax
c = config_args.load(sys.argv[1], "smoke", **{"input.data_dir": sys.argv[2], "log_every": 1, "checkpoint_every": 1})
with c.unlocked():
    c.evals = ml_collections.ConfigDict()
summary = trainer.train(c, sys.argv[3])
print("RESULT " + json.dumps(dict(devices=jax.device_count(), checksum=summary["param_checksum"],
                                  steps=[h["step"] for h in summary["history"]])))
"""


def test_resuming_on_fewer_devices_continues_the_same_global_data_order(tmp_path, straight):
    """A run checkpointed on 4 devices resumes on 2: the same global batches (the input pipeline
    is per process, not per device), so it ends where the 4-device run ended, to float32
    reduction-order rounding."""
    workdir, summary, config = straight
    trainer.train(config, tmp_path / "run", stop_at=2)
    script = tmp_path / "resume.py"
    script.write_text(RESUME_ON_TWO_DEVICES)
    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('VITMM_TEST_XLA_FLAGS', '')} "
                                     "--xla_force_host_platform_device_count=2")
    result = subprocess.run([sys.executable, str(script), str(ROOT / "configs/clip_scenes.py"), config.input.data_dir,
                             str(tmp_path / "run")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert out["devices"] == 2 and out["steps"] == [3, 4]
    assert out["checksum"] == pytest.approx(summary["param_checksum"], rel=1e-6)
    np.testing.assert_allclose([_losses(tmp_path / "run")[s] for s in (3, 4)], [_losses(workdir)[s] for s in (3, 4)],
                               rtol=1e-5)


@pytest.mark.slow  # ~19 s: its parts each have a cheaper test (a resume equals the straight run: test_trainer's
# test_resume_continues_exactly; the rows past the checkpoint dropped: test_a_resume_drops_the_logged_steps_...)
def test_a_sigkill_at_a_random_step_ends_where_an_uninterrupted_run_ends(tmp_path, data_dir):
    loop = importlib.import_module("experiments.reliability.preemption_loop")
    # One SIGKILL at a random step (SIGTERM at a known step: the multi-host test; SIGINT, which takes
    # the same handler: the test above): each kill costs a trainer process of its own.
    result = loop.main(["--steps", "12", "--checkpoint_every", "4", "--kills", "1", "--data_dir", data_dir,
                        "--out", str(tmp_path)])
    assert [r["signal"] for r in result["interruptions"]] == ["SIGKILL"]
    # A kill before the first finished save restarts from step 0 and would pass the checks below
    # trivially: the rerun must have restored a checkpoint (step, optimizer state, data position).
    [kill] = result["interruptions"]
    assert kill["returncode"] == -9 and kill["resumed_from"] > 0, kill
    assert result["every_interruption_resumed"]
    assert result["parameters_equal"] and result["each_step_logged_once"] and result["losses_equal"]
    assert (tmp_path / "preemption_loop.md").is_file()


def test_a_save_failing_while_another_error_stops_the_run_is_said_beside_it(tmp_path, monkeypatch, capsys):
    """The checkpointer closes in the loop's ``finally``: a background save failing there must not
    replace the error that stopped the run (a NaN, an evaluator's, a preemption)."""
    checkpointer = ckpt_lib.Checkpointer(tmp_path)

    def broken():
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpointer._mngr, "wait_until_finished", broken)
    with pytest.raises(FloatingPointError, match="the run's own error"):
        try:
            raise FloatingPointError("the run's own error")
        finally:
            checkpointer.close()
    assert "Warning: Saving a checkpoint to" in capsys.readouterr().out
    again = ckpt_lib.Checkpointer(tmp_path)
    monkeypatch.setattr(again._mngr, "wait_until_finished", broken)
    with pytest.raises(ckpt_lib.SaveFailed, match="No space left on device"):
        again.close()  # alone, it is the error
