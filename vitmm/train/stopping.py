"""Stopping a run on request: SIGTERM or Ctrl-C ask the loop to stop after the current step, which
is then checkpointed (``Preempted`` carries the one-line message), at the same step on every process;
and the message of a run stopped by a non-finite metric (``non_finite``)."""

from __future__ import annotations

import contextlib
import pathlib
import signal
import threading

import jax
import numpy as np

from vitmm import checkpoint as ckpt_lib
from vitmm.train import workdir as workdir_lib


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


def non_finite(name: str, step: int, checkpointer, checkpoint_every: int) -> FloatingPointError:
    """The error of a run whose ``name`` (loss, a gradient or a norm) went NaN/Inf at ``step``. With a
    checkpoint, resuming from it with another config needs ``allow_config_change``; without one there
    is nothing to resume: a rerun trains from step 0 (``--restart`` where the workdir's log would refuse it)."""
    with contextlib.suppress(ckpt_lib.SaveFailed):  # a save still under way counts once it is done
        checkpointer.wait()
    last = checkpointer.latest_step()
    head = f"Non-finite {name} at step {step}; the run stops. "
    if last is not None:
        return FloatingPointError(
            head + f"The last good checkpoint (step {last}) is kept in {checkpointer.directory}. Lower the learning "
            "rate, raise warmup or clip harder, then resume with --config.allow_config_change=True.")
    workdir = pathlib.Path(checkpointer.directory).parent
    restart = workdir_lib.history_without_checkpoint(workdir, checkpoint_every)
    return FloatingPointError(
        head + "No checkpoint had been written yet, so there is nothing to resume: rerun the same command with "
        + ("--restart and " if restart else "") + "a lower learning rate (--config.optim.lr), more warmup or "
        "harder clipping; it trains from step 0" + (f" ({restart[0]}: --restart keeps that log aside)." if restart
                                                      else "."))
