"""A run's workdir: one writer at a time, the config it was started with, honest logs on resume.

* ``Lock``: an exclusive ``flock`` on ``WORKDIR/lock``, taken before anything but the folder is
  written and held while the run lives (the kernel lets go when it dies, ``kill -9`` too); the
  file names the writer's host, pid and start time. A second run on the same workdir is refused
  naming the holder; a file a dead holder left is taken over with a note. Released at exit.
* ``check_is_workdir``: a run's ``checkpoints`` folder given as ``--workdir`` is refused, not trained in.
* ``check_config_change``: resuming with a config that differs from the one the checkpoint was
  written with prints the differences and refuses those that change the model, the data or its
  order, or the optimisation, unless ``config.allow_config_change`` is set.
* ``write_config``: the resolved config as readable ``WORKDIR/config.json``.
* ``history_without_checkpoint``: a workdir whose checkpoints were set aside as unreadable (or whose
  log goes past the point where a checkpoint must have been committed) is never trained over from
  step 0 silently: ``train(..., restart=True)`` (``--restart``) keeps its log aside and starts afresh.
* The logs themselves (``metrics.jsonl``, TensorBoard): ``metrics_log``.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import pathlib
import socket
import tempfile
import time

from vitmm import tree
from vitmm.checkpoint import step_folders
from vitmm.train.metrics_log import logged_steps

# Keys that may change between a run and its resume: how often things happen, where data and
# logs are read, how evaluation is done, when bad data stops the run, the layout (a restore
# reshards), whether a GPU's sums round in a fixed order (``deterministic``) and what only step 0
# reads (``init.dont_load``; an ``init`` folder too once its settings are pinned: ``check_config_change``'s
# ``also_safe``), and ``source`` (where an imported VLM's settings came from: a run saved before it was
# recorded resumes). Anything else changes what is computed.
SAFE_TO_CHANGE = ("log_every", "eval_every", "checkpoint_every", "keep_checkpoints", "sync_every",
                  "allow_config_change", "evals", "input/data_dir", "input/num_threads", "input/prefetch",
                  "input/device_prefetch", "input/max_skipped_share", "multihost", "fsdp", "tensor_parallel",
                  "deterministic", "init/dont_load", "init/allow_random_tower", "source")


class WorkdirLocked(RuntimeError):
    """Another run holds the workdir."""


class ConfigChanged(ValueError):
    """A resume with a config that would change what the run computes."""


class HistoryWithoutCheckpoint(ValueError):
    """A workdir that held a run which no checkpoint can resume (``restart=True`` starts afresh)."""


class NotWritable(ValueError):
    """The workdir cannot be created or written."""


class NotAWorkdir(ValueError):
    """A run's checkpoints folder (or one of its steps) given as the workdir."""


def check_is_workdir(workdir: pathlib.Path) -> None:
    """``NotAWorkdir`` for ``W/checkpoints`` or ``W/checkpoints/<step>`` of a run ``W``: the readers of
    another run take either form, but training there would start a new run from step 0 inside the
    old one's checkpoints instead of resuming it."""
    workdir = pathlib.Path(workdir).expanduser().absolute()
    for run in workdir.parents[:2]:
        if workdir.is_relative_to(run / "checkpoints") and step_folders(run):
            raise NotAWorkdir(f"--workdir {workdir} is inside the checkpoints of the run in {run}: training there "
                              f"would start a new run from step 0, not resume that one; pass --workdir {run} to "
                              "resume it.")


def make(workdir: pathlib.Path) -> pathlib.Path | None:
    """Creates ``workdir`` (and its parents); returns the topmost folder it created (None: ``workdir``
    was there), for ``remove_if_empty`` to take back. A file, an unwritable or impossible path is a
    ``NotWritable`` naming it, and nothing is left made."""
    workdir = pathlib.Path(workdir)
    if workdir.exists() and not workdir.is_dir():
        raise NotWritable(f"--workdir {workdir} is a file; choose a folder.")
    top = next((p for p in reversed((workdir, *workdir.parents)) if not p.exists()), None)
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=workdir).close()  # a writable folder, not just an existing one
    except OSError as err:
        if top is not None:
            remove_if_empty(workdir, up_to=top)
        raise NotWritable(f"--workdir {workdir}: cannot write there ({err.strerror or err}); choose a folder you "
                          "can write to.") from None
    return top


def remove_if_empty(workdir: pathlib.Path, up_to: pathlib.Path | None = None) -> None:
    """Removes ``workdir`` if it holds no file at any depth (a run refused before it wrote anything),
    then its parents up to ``up_to`` (the topmost folder ``make`` created) while they are empty."""
    workdir = pathlib.Path(workdir)
    if workdir.is_dir() and not any(p.is_file() or p.is_symlink() for p in workdir.rglob("*")):
        for sub in sorted(workdir.rglob("*"), key=lambda p: len(p.parts), reverse=True):
            sub.rmdir()
        workdir.rmdir()
    if up_to is not None and not workdir.exists() and workdir.is_relative_to(up_to):
        for parent in workdir.parents:
            if not parent.is_relative_to(up_to):
                break
            try:
                parent.rmdir()
            except OSError:  # not empty: something else was written there
                break


class Lock:
    """One writer per workdir: an exclusive ``flock`` on ``W/lock``, held while the run lives (the
    kernel lets go when the process dies, ``kill -9`` too, so a restart on the same pid, another
    host after a requeue or two runs starting at once are all decided by the lock itself); the file
    says who holds it. Where the file system has no ``flock`` (ENOLCK, ENOSYS, EOPNOTSUPP), a
    holder is judged by its pid on this host."""

    def __init__(self, workdir: pathlib.Path):
        self.path = pathlib.Path(workdir) / "lock"
        self.held, self._fd = False, None

    def acquire(self) -> None:
        me = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        for _ in range(3):  # the path may be replaced while we open it: try the file that is there now
            fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise self._locked(self._holder()) from None
            except OSError as err:
                os.close(fd)
                if err.errno not in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP):
                    raise
                return self._acquire_by_pid(me)
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # released (and removed) between our open and our lock
                os.close(fd)
                continue
            previous = self._holder()
            if previous and previous.get("pid") is not None:
                print(f"Taking over the stale lock of pid {previous.get('pid')} on {previous.get('host')} (no longer "
                      f"running) in {self.path.parent}.", flush=True)
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(me).encode(), 0)
            self._fd, self.held = fd, True
            return
        raise WorkdirLocked(f"Could not take the lock {self.path}; other runs are starting and stopping there.")

    def release(self) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)  # removed while still locked: a waiting opener sees it gone
            if self._fd is not None:
                os.close(self._fd)
            self.held, self._fd = False, None

    def _locked(self, holder: dict | None) -> WorkdirLocked:
        who = (f"pid {holder.get('pid')} on {holder.get('host')} (since {holder.get('started')})" if holder else
               "another run (starting)")
        return WorkdirLocked(f"{self.path.parent} is in use by {who}; wait for it, stop it, or use another --workdir.")

    def _acquire_by_pid(self, me: dict) -> None:
        """Without ``flock``: the file's holder, if its pid on this host is alive, keeps it."""
        holder = self._holder()
        if holder is not None and not self._stale(holder):
            raise self._locked(holder)
        if holder is not None:
            print(f"Taking over the stale lock of pid {holder.get('pid')} (no longer running) in {self.path.parent}.",
                  flush=True)
        self.path.write_text(json.dumps(me))
        self.held = True

    def _holder(self) -> dict | None:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None  # empty or unreadable: being written, or left half-written

    @staticmethod
    def _stale(holder: dict) -> bool:
        if holder.get("host") != socket.gethostname():
            return False  # cannot tell whether a process on another host is alive
        try:
            os.kill(int(holder["pid"]), 0)
        except ProcessLookupError:
            return True
        except (PermissionError, KeyError, ValueError, TypeError):
            return False
        return False


def config_differences(saved: dict, current: dict) -> list[tuple[str, object, object]]:
    """``(key, saved value, current value)`` for every leaf that differs, keys ``a/b/c``; a key one side
    lacks and the other leaves at None (a setting added to the configs since, at its default) is no difference."""
    a, b = tree.flatten(saved), tree.flatten(current)
    norm = lambda v: list(v) if isinstance(v, tuple) else v  # noqa: E731 - JSON turns tuples into lists
    return [(k, a.get(k, "<absent>"), b.get(k, "<absent>")) for k in sorted(set(a) | set(b))
            if norm(a.get(k)) != norm(b.get(k))]


def check_config_change(saved: dict | None, config, checkpoint_dir, also_safe=()) -> list[str]:
    """Lines describing what changed since the checkpoint's config; raises ``ConfigChanged`` for
    changes outside ``SAFE_TO_CHANGE`` and ``also_safe`` unless ``config.allow_config_change``."""
    if saved is None:
        return []
    diffs = config_differences(saved, json.loads(config.to_json_best_effort()))
    lines = [f"  {k}: {old!r} -> {new!r}" for k, old, new in diffs]
    unsafe = [k for k, _, _ in diffs if not any(k == s or k.startswith(s + "/") for s in (*SAFE_TO_CHANGE, *also_safe))]
    if unsafe and not config.get("allow_config_change", False):
        raise ConfigChanged(
            f"The checkpoint in {checkpoint_dir} was written with another config; resuming would change "
            f"{', '.join(unsafe)}:\n" + "\n".join(lines)
            + "\nUse another --workdir for a new run, or pass --config.allow_config_change=True to resume anyway.")
    return lines


def write_config(workdir: pathlib.Path, config, task=None) -> None:
    """``WORKDIR/config.json``: ``config`` as the run resolved it. A VLM whose tower or LM came from
    ``init.vision`` / ``init.lm`` shows there the settings they were built with (``task.vision`` /
    ``task.lm``, read from those folders: ``vlm_start.vlm_parts``), not the config's placeholder
    ``model.vision`` / ``model.lm``. (Only here: the checkpoints keep the config as given, which a
    resume compares and the ``init.*`` copies in ``W/sources/`` complete.)"""
    path = pathlib.Path(workdir) / "config.json"
    tmp = path.with_suffix(".json.tmp")
    saved = json.loads(config.to_json_best_effort())
    for key in ("vision", "lm"):
        built = getattr(task, key, None)
        if isinstance(built, dict) and (config.get("init") or {}).get(key):
            saved["model"][key] = json.loads(json.dumps(built, default=lambda v: v.item() if hasattr(v, "item")
                                                        else str(v)))
    tmp.write_text(json.dumps(saved, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)


def history_without_checkpoint(workdir: pathlib.Path, checkpoint_every: int) -> list[str]:
    """What in ``workdir`` shows an earlier run that no checkpoint folder is left to resume ([] if
    nothing, or if a step folder exists: resuming, or reporting why it cannot, is the checkpoint's
    job). Logged steps count only past ``2 * checkpoint_every``: a save runs in the background
    until the next one starts, so a run killed earlier may have logged steps with no checkpoint
    committed yet, and starting it over loses nothing."""
    folder = pathlib.Path(workdir) / "checkpoints"
    names = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
    if any(name.isdigit() for name in names):
        return []
    found = []
    aside = [name for name in names if ".unreadable" in name]
    if aside:
        found.append(f"checkpoints set aside as unreadable ({', '.join(aside)})")
    steps = logged_steps(pathlib.Path(workdir) / "metrics.jsonl")
    if steps and max(steps) > 2 * checkpoint_every:
        found.append(f"metrics.jsonl logged up to step {max(steps)}")
    return found
