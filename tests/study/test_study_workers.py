"""``vitmm.study.workers``: worker processes that die with their sweep."""

import os
import pathlib
import subprocess
import sys


def test_a_killed_sweep_leaves_no_workers_running_and_its_arrays_are_cleared(tmp_path):
    """kill -9 of a sweep: its worker processes die with it (they would otherwise run their jobs
    to the end for nobody, beside the restarted sweep), and the next sweep removes the arrays'
    folder the killed one left."""
    import signal
    import tempfile
    import time

    (tmp_path / "job.py").write_text(
        "import os, pathlib, time\n"
        "def job(key, arrays, context, progress):\n"
        "    pathlib.Path(context['dir'], f'{os.getpid()}.pid').write_text('')\n"
        "    time.sleep(600)\n")
    (tmp_path / "main.py").write_text(
        "import numpy as np, job\nfrom vitmm.study import workers\n"
        "if __name__ == '__main__':\n"
        f"    workers.run(job.job, [0, 1], {{'a': {{'x': np.zeros(3)}}}}, {{'dir': {str(tmp_path)!r}}}, 2, total=2)\n")
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": str(tmp_path)}
    sweep = subprocess.Popen([sys.executable, str(tmp_path / "main.py")], env=env)
    deadline = time.time() + 120
    while len(list(tmp_path.glob("*.pid"))) < 2 and time.time() < deadline and sweep.poll() is None:
        time.sleep(0.2)
    pids = [int(f.stem) for f in tmp_path.glob("*.pid")]
    assert len(pids) == 2 and len(list(tmp_path.glob("vitmm-workers-*"))) == 1
    children = [int(p.name) for p in pathlib.Path("/proc").iterdir()
                if p.name.isdigit() and _ppid(int(p.name)) == sweep.pid]
    assert set(pids) <= set(children)
    sweep.send_signal(signal.SIGKILL)
    sweep.wait()

    def alive(pid):
        try:
            return pathlib.Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] != "Z"
        except (FileNotFoundError, ProcessLookupError):
            return False

    deadline = time.time() + 20
    while any(alive(pid) for pid in pids) and time.time() < deadline:
        time.sleep(0.2)
    assert not any(alive(pid) for pid in pids)
    deadline = time.time() + 20
    while any(alive(pid) for pid in children) and time.time() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in children if alive(pid)]  # nothing the killed sweep started is left running
    from vitmm.study import workers

    old, tempfile.tempdir = tempfile.tempdir, str(tmp_path)
    try:
        workers._remove_stale_arrays()
    finally:
        tempfile.tempdir = old
    assert not list(tmp_path.glob("vitmm-workers-*"))


def _ppid(pid: int) -> int | None:
    try:
        return int(pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def test_a_failing_job_starts_no_other_keeps_every_finished_result_then_raises():
    """The first job that raises (e.g. a loss gone non-finite) stops the queue: no job starts after
    it, the one still running is waited for and kept like the one already done, and then the error
    is raised (instead of running every queued job for a traceback that drops their results)."""
    import concurrent.futures
    import queue
    import threading

    import pytest

    from vitmm.study import workers

    def future(state):
        f = concurrent.futures.Future()
        if state == "running":
            threading.Timer(0.05, f.set_result, [{"acc": 0.7}]).start()
        elif state == "done":
            f.set_result({"acc": 0.5})
        else:
            f.set_exception(FloatingPointError("loss became nan at step 3"))
        return f

    states, started = {"a": "done", "bad": "failed", "c": "running", "d": "done", "e": "done"}, []

    def submit(key):
        started.append(key)
        return future(states[key])

    class Bar:
        def update(self, n):
            pass

        def set_postfix(self, **kwargs):
            pass

    kept = {}
    with pytest.raises(FloatingPointError, match="loss became nan"):
        workers._collect(submit, list(states), 3, queue.Queue(), Bar(), kept.__setitem__)
    assert started == ["a", "bad", "c"] and kept == {"a": {"acc": 0.5}, "c": {"acc": 0.7}}
