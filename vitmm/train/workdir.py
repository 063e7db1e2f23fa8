"""A run's workdir: one writer at a time, the config it was started with, honest logs on resume.

* ``Lock``: ``WORKDIR/lock`` holds the writer's host, pid and start time, created exclusively
  before anything else is written. A second run on the same workdir is refused naming the
  holder; a lock whose pid is dead on this host is taken over with a warning. Released at exit.
* ``check_config_change``: resuming with a config that differs from the one the checkpoint was
  written with prints the differences and refuses those that change the model, the data or its
  order, or the optimisation, unless ``config.allow_config_change`` is set.
* ``write_config``: the resolved config as readable ``WORKDIR/config.json``.
* ``truncate_metrics``: after a resume from step N, ``metrics.jsonl`` keeps only steps ≤ N (the
  rows a killed run wrote after its last checkpoint would otherwise appear twice).
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import time

from vitmm import tree

# Keys that may change between a run and its resume: how often things happen, where data and
# logs are read, and how evaluation is done. Anything else changes what is computed.
SAFE_TO_CHANGE = ("log_every", "eval_every", "checkpoint_every", "keep_checkpoints", "sync_every",
                  "allow_config_change", "evals", "input/data_dir", "input/num_threads", "input/prefetch",
                  "input/device_prefetch", "multihost")


class WorkdirLocked(RuntimeError):
    """Another run holds the workdir."""


class ConfigChanged(ValueError):
    """A resume with a config that would change what the run computes."""


class Lock:
    def __init__(self, workdir: pathlib.Path):
        self.path = pathlib.Path(workdir) / "lock"
        self.held = False

    def acquire(self) -> None:
        me = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._holder()
                if holder is not None and not self._stale(holder):
                    raise WorkdirLocked(
                        f"{self.path.parent} is in use by pid {holder.get('pid')} on {holder.get('host')} "
                        f"(since {holder.get('started')}); wait for it, stop it, or use another --workdir.") from None
                print(f"Taking over the stale lock of pid {(holder or {}).get('pid')} (no longer running) "
                      f"in {self.path.parent}.", flush=True)
                self.path.unlink(missing_ok=True)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            self.held = True
            return
        raise WorkdirLocked(f"Could not take the lock {self.path}; another run started at the same moment.")

    def release(self) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False

    def _holder(self) -> dict | None:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None  # unreadable: half-written by a writer that died at once

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
    """``(key, saved value, current value)`` for every leaf that differs, keys ``a/b/c``."""
    a, b = tree.flatten(saved), tree.flatten(current)
    norm = lambda v: list(v) if isinstance(v, tuple) else v  # noqa: E731 - JSON turns tuples into lists
    return [(k, a.get(k, "<absent>"), b.get(k, "<absent>")) for k in sorted(set(a) | set(b))
            if norm(a.get(k, "<absent>")) != norm(b.get(k, "<absent>"))]


def check_config_change(saved: dict | None, config, checkpoint_dir) -> list[str]:
    """Lines describing what changed since the checkpoint's config; raises ``ConfigChanged`` for
    changes outside ``SAFE_TO_CHANGE`` unless ``config.allow_config_change``."""
    if saved is None:
        return []
    diffs = config_differences(saved, json.loads(config.to_json_best_effort()))
    lines = [f"  {k}: {old!r} -> {new!r}" for k, old, new in diffs]
    unsafe = [k for k, _, _ in diffs if not any(k == s or k.startswith(s + "/") for s in SAFE_TO_CHANGE)]
    if unsafe and not config.get("allow_config_change", False):
        raise ConfigChanged(
            f"The checkpoint in {checkpoint_dir} was written with another config; resuming would change "
            f"{', '.join(unsafe)}:\n" + "\n".join(lines)
            + "\nUse another --workdir for a new run, or pass --config.allow_config_change=True to resume anyway.")
    return lines


def write_config(workdir: pathlib.Path, config) -> None:
    path = pathlib.Path(workdir) / "config.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(json.loads(config.to_json_best_effort()), indent=1, sort_keys=True) + "\n")
    tmp.replace(path)


def truncate_metrics(workdir: pathlib.Path, step: int) -> int:
    """Drops ``metrics.jsonl`` rows after ``step`` (atomically); returns how many were dropped."""
    path = pathlib.Path(workdir) / "metrics.jsonl"
    if not path.is_file():
        return 0
    keep, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            row_step = json.loads(line).get("step", 0)
        except ValueError:
            dropped += 1  # a line cut short by a kill
            continue
        if row_step <= step:
            keep.append(line)
        else:
            dropped += 1
    if dropped:
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in keep))
        tmp.replace(path)
    return dropped
