"""Stopping a run on request: SIGTERM or Ctrl-C ask the loop to stop after the current step, which
is then checkpointed (``Preempted`` carries the one-line message), at the same step on every process."""

from __future__ import annotations

import pathlib
import signal
import threading

import jax
import numpy as np


class Preempted(Exception):
    """The run stopped on SIGTERM/SIGINT after saving a checkpoint at ``step``."""

    def __init__(self, step: int, workdir: pathlib.Path, signal_name: str):
        super().__init__(f"{signal_name} at step {step}: checkpoint saved in {workdir}; rerun the same command "
                         "to resume.")
        self.step, self.workdir = step, workdir


class StopRequests:
    """SIGTERM and SIGINT ask the loop to stop after the current step (a second SIGINT stops at
    once). All processes of a multi-host run stop at the same step: each step, the flag is
    gathered from every process."""

    def __init__(self):
        self.signal, self._old = None, {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)

    def _handle(self, signum, frame):
        if self.signal == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal = signum

    def requested(self) -> bool:
        stop = self.signal is not None
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            stop = bool(np.max(multihost_utils.process_allgather(np.int32(stop))))
        return stop

    @property
    def name(self) -> str:
        return signal.Signals(self.signal).name if self.signal else "a signal on another process"
