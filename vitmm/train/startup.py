"""What a run checks as it starts in a workdir: an earlier run no checkpoint can resume
(``--restart``), a refusal every process shares, and an evaluation a stopped run still owes."""

from __future__ import annotations

import pathlib

import jax
import numpy as np

from vitmm.train.metrics_log import evaluated_at, set_aside_for_restart
from vitmm.train.workdir import HistoryWithoutCheckpoint, WorkdirLocked, history_without_checkpoint

REFUSALS = (WorkdirLocked, HistoryWithoutCheckpoint)


class FreshStart(Exception):  # noqa: N818 - a signal between the trainer's steps, not an error
    """No checkpoint read and ``--restart`` set them aside: the run starts again at step 0, its
    settings read from the init folders again (not the copies the earlier run pinned)."""


class ProcessZeroFailed(RuntimeError):
    """Another process's view of an unexpected error process 0 met while checking the workdir."""


def refuse_together(refusal: Exception | None, workdir: pathlib.Path) -> None:
    """Process 0 alone checks the workdir; every process stops with it, whether it refused the run
    (``REFUSALS``) or met another error there (the others would otherwise wait at the first
    checkpoint's barrier until the coordination timeout)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        kinds = (*REFUSALS, ProcessZeroFailed)
        code = 0 if refusal is None else kinds.index(type(refusal)) + 1 if type(refusal) in REFUSALS else len(kinds)
        code = int(multihost_utils.broadcast_one_to_all(np.int32(code)))
        if code and refusal is None:
            said = "refused this run" if code <= len(REFUSALS) else "failed while checking the workdir"
            raise kinds[code - 1](f"{workdir}: process 0 {said}; its output says why.")
    if refusal is not None:
        raise refusal


def check_history(workdir: pathlib.Path, config, restart: bool) -> bool:
    """Whether ``workdir`` holds an earlier run's log that ``--restart`` sets aside (``set_aside_history``,
    once the run's settings are checked); without ``restart`` such a workdir is refused."""
    found = history_without_checkpoint(workdir, config.checkpoint_every)
    if found and not restart:
        raise HistoryWithoutCheckpoint(
            f"{workdir} holds an earlier run ({'; '.join(found)}) but no checkpoint to resume it from; rerun with "
            "--restart to train it again from step 0 (its metrics.jsonl is kept aside), or use a fresh --workdir.")
    return bool(found)


def set_aside_history(workdir: pathlib.Path) -> None:
    kept = set_aside_for_restart(workdir)
    print(f"Restarting from step 0 in {workdir} (--restart)" + (f"; the earlier log is {kept.name}." if kept else "."),
          flush=True)


def evaluation_lost(workdir, start: int, total: int, config, evaluators, is_main: bool) -> bool:
    """A run stopped between saving an evaluation step and evaluating it (a kill, or a preemption at
    that step; the last step's too) resumes there: the evaluation the log lacks is run first
    (process 0 decides for all)."""
    if not evaluators or not 0 < start <= total or (start % config.eval_every and start != total):
        return False
    lost = is_main and not evaluated_at(workdir, start, evaluators)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        lost = bool(multihost_utils.broadcast_one_to_all(np.int32(lost)))
    return lost
