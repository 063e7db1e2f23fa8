"""``experiments.common.train_run``: a study's ``python -m vitmm.train`` process, stopped with the study."""

import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

ROOT = pathlib.Path(__file__).resolve().parents[3]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_study_stopped_with_sigterm_stops_its_training_run_too(tmp_path):
    """``kill STUDY_PID`` (SIGTERM) reaches the training process, which saves its step and exits 75
    (``vitmm.train``'s preempted code); the study then says to rerun. Without forwarding, the run
    kept training as an orphan, and the rerun's trainer found the workdir locked by it. A stand-in
    for ``python -m vitmm.train`` records the signal it gets."""
    pid_file, got = tmp_path / "child.pid", tmp_path / "got"
    fake = tmp_path / "fakepython"
    fake.write_text(f"#!{sys.executable}\n" + textwrap.dedent(f"""
        import os, pathlib, signal, sys, time
        def stop(*_):
            pathlib.Path({str(got)!r}).write_text("TERM")
            sys.exit(75)
        signal.signal(signal.SIGTERM, stop)
        pathlib.Path({str(pid_file)!r}).write_text(str(os.getpid()))
        time.sleep(60)
    """))
    fake.chmod(0o755)
    study = textwrap.dedent(f"""
        import pathlib, sys
        from experiments.common import train_run
        sys.executable = {str(fake)!r}
        train_run.train("configs/x.py", pathlib.Path({str(tmp_path / "w")!r}), name="x")
    """)
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    log = (tmp_path / "study.log").open("w")  # not a pipe: an orphaned run would hold it open
    proc = subprocess.Popen([sys.executable, "-c", study], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    child = None
    try:
        for _ in range(300):
            if pid_file.is_file() and pid_file.read_text().strip():
                child = int(pid_file.read_text())
                break
            time.sleep(0.05)
        assert child is not None, (tmp_path / "study.log").read_text()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)
        err = (tmp_path / "study.log").read_text()
        for _ in range(100):
            if got.is_file() or not _alive(child):
                break
            time.sleep(0.05)
        assert got.is_file(), "the training process never got the study's SIGTERM"
        assert "x stopped (exit 75" in err and "rerun to resume it" in err, err[-2000:]
    finally:
        if child is not None and _alive(child):
            os.kill(child, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
