"""A pool of single-core worker processes for experiment sweeps, with one progress bar.

``run(fn, keys, arrays, context, workers, total)`` returns ``{key: fn(key, arrays, context,
progress)}``. With ``workers > 1`` each job runs in a spawned process pinned to one core: XLA
sizes its CPU thread pool from the process's affinity when its backend starts, so pinning before
the first computation is what makes a worker single-threaded (XLA flags alone left two busy
pool threads per worker). For models this small, two single-core runs side by side beat one run
on two cores. The arrays every job reads (``{group: {name: array}}``) are written once to a
memory-mapped ``.npz``; jobs report finished steps to ``progress.update(n)``.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import sys
import tempfile

import numpy as np

_WORKER: dict = {}  # a worker process's arrays, context and progress queue (set by _init)


_PREFIX = "vitmm-workers-"  # the arrays' folder: vitmm-workers-PID-*


def _remove_stale_arrays() -> None:
    """The arrays' folders of sweeps that were killed (a signal skips the folder's cleanup: a
    default sweep leaves ~0.6 GB each time)."""
    import glob
    import shutil

    for folder in glob.glob(os.path.join(tempfile.gettempdir(), _PREFIX + "*")):
        pid = int(os.path.basename(folder)[len(_PREFIX):].split("-")[0])
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(folder, ignore_errors=True)
        except PermissionError:  # alive, another user's
            pass


def _die_with(parent: int) -> None:
    """Linux: this process is killed when the sweep's process dies (PR_SET_PDEATHSIG), so that a
    sweep stopped by a signal leaves no orphaned workers computing for nothing (their runs resume
    from their snapshots when the sweep is started again)."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the sweep died before the call above
        os._exit(1)


def _init(arrays_path: str, context: dict, queue, cores: list[int], parent: int) -> None:
    _die_with(parent)
    index = multiprocessing.current_process()._identity[0]  # consecutive numbers for the pool's workers
    os.sched_setaffinity(0, {cores[index % len(cores)]})
    data = np.load(arrays_path, mmap_mode="r", allow_pickle=False)
    arrays: dict = {}
    for name in data.files:
        group, key = name.split("/", 1)
        arrays.setdefault(group, {})[key] = data[name]
    _WORKER.update(arrays=arrays, context=context, queue=queue)


class _QueueProgress:
    """Sends finished steps to the parent's progress bar every ``every`` steps."""

    def __init__(self, queue, every: int = 25):
        self.queue, self.every, self.pending = queue, every, 0

    def update(self, n: int) -> None:
        self.pending += n
        if self.pending >= self.every:
            self.flush()

    def flush(self) -> None:
        if self.pending:
            self.queue.put(self.pending)
            self.pending = 0


def _call(fn, key):
    progress = _QueueProgress(_WORKER["queue"])
    out = fn(key, _WORKER["arrays"], _WORKER["context"], progress)
    progress.flush()
    return out


def run(fn, keys: list, arrays: dict[str, dict[str, np.ndarray]], context: dict, workers: int, total: int,
        desc: str = "runs", on_result=None) -> dict:
    """Every job, in ``keys`` order (put the most expensive first so the pool ends evenly), in
    this process (``workers <= 1``) or in ``workers`` pinned processes. ``fn`` must be a
    module-level function (it is pickled by reference); ``total`` is the steps the bar counts;
    ``on_result(key, result)`` runs here as each job finishes (e.g. to save it). A job that raises
    stops the sweep once the jobs running beside it have finished and been handed to ``on_result``."""
    from tqdm import tqdm

    results = {}
    done = on_result or (lambda key, result: None)
    with tqdm(total=total, desc=desc, unit="step", file=sys.stdout, mininterval=5) as bar:
        if workers <= 1:
            for key in keys:
                results[key] = fn(key, arrays, context, bar)
                done(key, results[key])
                bar.set_postfix(done=str(key))
            return results
        ctx = multiprocessing.get_context("spawn")
        _remove_stale_arrays()
        with tempfile.TemporaryDirectory(prefix=f"{_PREFIX}{os.getpid()}-") as tmp:
            path = os.path.join(tmp, "arrays.npz")
            np.savez(path, **{f"{group}/{name}": a for group, named in arrays.items() for name, a in named.items()})
            queue = ctx.Queue()  # handed to the workers as they start (no manager process to outlive a kill)
            cores = sorted(os.sched_getaffinity(0))
            with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init,
                                                        initargs=(path, context, queue, cores, os.getpid())) as pool:
                results.update(_collect(lambda key: pool.submit(_call, fn, key), keys, workers, queue, bar, done))
    return results


def _collect(submit, keys: list, workers: int, queue, bar, done) -> dict:
    """``{key: result}`` of every job, each handed to ``done`` as it finishes; ``submit(key)`` starts
    one (a future), at most ``workers`` at a time, in ``keys`` order. After the first job that
    fails no other starts: those running are waited for, every finished one is still handed to
    ``done``, then the failure is raised (a pool holding every job would run them all first, then
    drop their results for the traceback)."""
    todo, running, results, failed = list(keys), {}, {}, None
    while todo or running:
        while todo and len(running) < workers and failed is None:
            key = todo.pop(0)
            running[submit(key)] = key
        finished, _ = concurrent.futures.wait(running, timeout=2, return_when="FIRST_COMPLETED")
        while not queue.empty():
            bar.update(queue.get())
        for f in finished:
            key = running.pop(f)
            if f.exception() is not None:
                failed = failed or f.exception()
                continue
            results[key] = f.result()
            done(key, results[key])
            bar.set_postfix(done=str(key))
        if failed is not None:
            todo.clear()
    if failed is not None:
        raise failed
    return results
