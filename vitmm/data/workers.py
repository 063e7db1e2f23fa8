"""Input worker processes (``input.workers``): grain's ``mp_prefetch`` with a checked state,
``close()``, workers that leave SIGTERM to the trainer and exit when it dies, and bad-example
skipping that runs inside each worker (``SkippingBatchesDataset``)."""

from __future__ import annotations

import atexit
import os
import re
import weakref

import grain

from vitmm.data import skips


class SkippingBatchesDataset(grain.IterDataset):
    """``skips.SkippingBatches`` as a grain transformation, so that it runs inside each worker."""

    def __init__(self, parent, batch_size: int, collate, max_share: float, min_read: int):
        super().__init__(parent)
        self._settings = (batch_size, collate, max_share, min_read)

    def __iter__(self):
        return _SkippingBatchesIterator(self._parent.__iter__(), *self._settings)


class _SkippingBatchesIterator(grain.DatasetIterator):
    def __init__(self, parent, batch_size: int, collate, max_share: float, min_read: int):
        super().__init__(parent)
        self._batches = skips.SkippingBatches(parent, batch_size, collate, max_share=max_share, min_read=min_read)

    def __next__(self):
        return next(self._batches)

    def get_state(self) -> dict:
        return self._batches.get_state()

    def set_state(self, state) -> None:
        self._batches.set_state(state)


def auto_workers(threads_per_worker: int = 1) -> int:
    """Worker processes that fit the host (``input.workers=-1``): the cores this process may use (its
    CPU affinity, e.g. a container's or a SLURM job's cores, not the machine's) beyond the two the
    trainer keeps (its Python loop and the device's host threads), shared out so that workers ×
    ``threads_per_worker`` reader threads stay within them, at most 16; 0 (reading in the trainer's
    threads) when not one worker's threads fit.

    It sees this process's cores only: trainer processes that share one affinity mask on a host (one
    per GPU under a launcher that does not bind each its own cores) each take all the spare cores for
    themselves. There, give each process its own cores (``srun --cpus-per-task``, ``mpirun
    --bind-to``) or set ``input.workers`` to spare cores / processes / threads by hand."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(16, max(0, cores - 2) // max(1, threads_per_worker))


def resolve(workers, threads_per_worker: int = 1) -> int:
    """``input.workers`` as a number of processes, for every input path that takes it: -1 is
    ``auto_workers(threads_per_worker)``; other negatives and non-integers are refused."""
    if workers == -1:
        return auto_workers(threads_per_worker)
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 0:
        raise ValueError(f"input.workers={workers!r}: a number of worker processes (0: none, -1: the spare cores / "
                         "input.num_threads).")
    return workers


def in_workers(ds, workers: int, buffer: int, auto: bool = False):
    """``iter(ds)``, or its elements prepared in ``workers`` processes (``WorkerIterator``); ``auto``:
    ``workers`` is what ``input.workers=-1`` resolved to on this host (said when a resume refuses it)."""
    if not workers:
        return NoWorkers(iter(ds), auto)
    from absl import flags

    if not flags.FLAGS.is_parsed():  # grain's workers read absl flags; a library caller has not parsed any
        flags.FLAGS.mark_as_parsed()
    options = grain.MultiprocessingOptions(num_workers=workers, per_worker_buffer_size=buffer)
    return WorkerIterator(iter(ds.mp_prefetch(options, worker_init_fn=_exit_with_parent)), workers, auto)


def _exit_with_parent(worker_index: int, worker_count: int) -> None:
    """In each worker: SIGTERM and SIGINT are left to the trainer (a launcher that signals the whole
    process group must not take the input away while the trainer saves its checkpoint; the trainer
    stops its workers), and a thread ends the worker once its parent is gone, so a SIGKILLed trainer
    leaves no worker behind (the resource tracker then frees their shared memory)."""
    import multiprocessing
    import signal
    import threading
    import time

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The trainer's pid as spawning recorded it: it may have died before this worker got here.
    parent = multiprocessing.parent_process()
    parent_pid = parent.pid if parent is not None else os.getppid()

    def watch():
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, daemon=True, name="vitmm-exit-with-parent").start()


_AUTO = " (input.workers=-1 on this host's cores)"


class NoWorkers:
    """grain's iterator as it is (its state unchanged), refusing a state saved with workers."""

    def __init__(self, iterator, auto: bool = False):
        self._it, self.auto = iterator, auto

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._it)

    def get_state(self):
        return self._it.get_state()

    def set_state(self, state) -> None:
        if isinstance(state, dict) and "workers" in state:
            raise ValueError(f"The checkpoint's data position was saved with input.workers={state['workers']}; this "
                             f"run has none{_AUTO if self.auto else ''}. Resume with input.workers={state['workers']}.")
        self._it.set_state(state)


_FREE_AT_EXIT = False  # whether _free_shared_memory is registered with atexit


class WorkerIterator:
    """grain's multiprocess iterator with a checked state and ``close()``, which also lets go of it:
    its semaphores (``/dev/shm/sem.mp-*``) go at once, and grain's own ``__del__`` never runs in the
    interpreter's teardown, where it prints ``Exception ignored`` tracebacks. A process that exits
    without ``close()`` closes it on the way out (``atexit``)."""

    def __init__(self, iterator, workers: int, auto: bool = False):
        self._it, self.workers, self.auto = iterator, workers, auto
        this = weakref.ref(self)
        global _FREE_AT_EXIT
        if not _FREE_AT_EXIT:  # once, before the first close (atexit runs last in, first out): after every close,
            atexit.register(_free_shared_memory)  # what an error held
            _FREE_AT_EXIT = True
        atexit.register(lambda: this() is not None and this().close())  # (atexit runs before the teardown)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self._it)
        except RuntimeError as err:  # grain's words for a worker that died: its exit code only
            code = re.search(r"terminated unexpectedly with exit code (-?\d+)", str(err))
            if code is None:
                raise
            why = ": killed, most often by the kernel's out-of-memory killer" if code[1] == "-9" else ""
            raise RuntimeError(
                f"An input worker process died (exit code {code[1]}{why}). Each of the input.workers={self.workers} "
                "holds its own reader threads and buffers: lower input.workers, input.num_threads or input.prefetch, "
                "or read in the trainer's process with input.workers=0.") from None

    def get_state(self) -> dict:
        if self._it is None:  # closed: where it stopped
            return self._closed_state
        return {"workers": self.workers, "grain": self._it.get_state()}

    def set_state(self, state: dict) -> None:
        saved = state.get("workers") if isinstance(state, dict) else None
        if saved != self.workers:
            raise ValueError(f"The checkpoint's data position was saved with input.workers={saved or 0}; this run has "
                             f"{self.workers}{_AUTO if self.auto else ''}. Resume with input.workers={saved or 0}.")
        self._it.set_state(state["grain"])

    def close(self) -> None:
        if self._it is not None:
            it, self._it = self._it, None
            try:
                self._closed_state = {"workers": self.workers, "grain": it.get_state()}
            finally:  # (a state that cannot be read must not keep the workers)
                it.close()
                del it
                _free_shared_memory()


def _free_shared_memory() -> None:
    """Unlinks now the shared memory of the batches the workers sent that nothing holds any more.
    Batches taken from grain's iterator live in reference cycles (the trainer's steps, grain's
    buffers), whose arrays unlink their segments only when the cycle collector runs: left to the
    interpreter's exit, the resource tracker unlinks them and warns of "leaked shared_memory
    objects" at the end of every run with workers (a process that trains several runs holds them
    until the collector happens to run). grain unlinks on a thread of its own (one: its queue is
    done in order), waited for here."""
    import gc

    gc.collect()
    try:  # grain's private unlink pool: a grain without it (another version) leaves the unlinking to its own pace
        from grain._src.python.ipc import shared_memory_array

        pool = getattr(shared_memory_array.SharedMemoryArray, "_del_thread_pool", None)
        if pool is not None:
            pool.apply(int)
    except (ImportError, ValueError, RuntimeError):  # ValueError: the pool already closed, at the interpreter's exit
        pass
