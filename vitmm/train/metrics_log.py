"""A run's logs: ``metrics.jsonl`` (one JSON row per logged step) and the TensorBoard events beside it.

* ``MetricWriter``: ``metrics.jsonl`` and the TensorBoard events a run appends to, after dropping
  what a killed run logged past its last checkpoint (``truncate_metrics``: after a resume from step N,
  ``metrics.jsonl`` keeps only steps ≤ N, which the resumed run logs again).
* ``rebuild_metrics``: a resume that finds ``metrics.jsonl`` gone rebuilds it from the TensorBoard
  event files written beside it (float32 values, one row per step), or says that it cannot.
* ``evaluated_at``: whether the log holds an evaluation at a step (a resume runs one it lacks).
* ``set_aside_for_restart``: a fresh start keeps an earlier log as ``metrics.before-restart[.N].jsonl``.
"""

from __future__ import annotations

import json
import pathlib
import struct
import sys


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


def logged_steps(path: pathlib.Path) -> list[int]:
    steps = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                steps.append(int(json.loads(line)["step"]))
            except (ValueError, KeyError, TypeError):
                continue  # a line cut short by a kill
    return steps


def evaluated_at(workdir: pathlib.Path, step: int, evaluators) -> bool:
    """Whether ``metrics.jsonl`` holds an evaluation row at ``step`` (a key of one of ``evaluators``,
    e.g. ``zeroshot/accuracy``)."""
    path = pathlib.Path(workdir) / "metrics.jsonl"
    prefixes = tuple(f"{name}/" for name in evaluators)
    for line in path.read_text().splitlines() if path.is_file() else ():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if row.get("step") == step and any(k.startswith(prefixes) for k in row):
            return True
    return False


def _records(path: pathlib.Path):
    """The payloads of a TFRecord file (TensorBoard's event files); stops at a record cut short."""
    data = path.read_bytes()
    at = 0
    while at + 12 <= len(data):
        (length,) = struct.unpack("<Q", data[at:at + 8])
        end = at + 12 + length + 4  # length, its CRC, payload, the payload's CRC
        if end > len(data):
            return
        yield data[at + 12:at + 12 + length]
        at = end


def tensorboard_scalars(folder: pathlib.Path) -> dict[int, dict[str, float]]:
    """``{step: {tag: value}}`` of the scalars in ``folder``'s event files, in the order they were
    written, with what a resumed writer purged (events at or after its restart step) dropped."""
    from tensorboardX.proto import event_pb2

    rows: dict[int, dict[str, float]] = {}
    for path in sorted(pathlib.Path(folder).glob("events.out.tfevents.*")):
        for payload in _records(path):
            event = event_pb2.Event.FromString(payload)
            if event.HasField("session_log") and event.session_log.status == event.session_log.START:
                rows = {s: r for s, r in rows.items() if s < event.step}
            for value in event.summary.value:
                if value.HasField("simple_value"):
                    rows.setdefault(int(event.step), {})[value.tag] = float(value.simple_value)
    return rows


def rebuild_metrics(workdir: pathlib.Path, step: int) -> str | None:
    """When a run resumes at ``step`` and ``metrics.jsonl`` is missing or empty: rebuilds its rows
    up to ``step`` from the TensorBoard events and returns what it did (None if the file is there)."""
    path = pathlib.Path(workdir) / "metrics.jsonl"
    if logged_steps(path) or step == 0:
        return None
    rows = {s: r for s, r in tensorboard_scalars(pathlib.Path(workdir) / "tensorboard").items() if s <= step}
    if not rows:
        return (f"metrics.jsonl in {workdir} is missing and no TensorBoard events are left to rebuild it from: it "
                f"will hold the steps after {step} only.")
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps({"step": s, **rows[s]}) + "\n" for s in sorted(rows)))
    tmp.replace(path)
    return (f"metrics.jsonl in {workdir} was missing: rebuilt {len(rows)} rows (steps {min(rows)}-{max(rows)}) "
            "from the TensorBoard events (float32 values, a step's training and evaluation metrics in one row).")


def set_aside_for_restart(workdir: pathlib.Path) -> pathlib.Path | None:
    """Renames ``metrics.jsonl`` to ``metrics.before-restart[.N].jsonl``; returns the new path."""
    path = pathlib.Path(workdir) / "metrics.jsonl"
    if not path.is_file():
        return None
    target, n = path.with_name("metrics.before-restart.jsonl"), 1
    while target.exists():
        target, n = path.with_name(f"metrics.before-restart.{n}.jsonl"), n + 1
    path.rename(target)
    return target


class MetricWriter:
    """``metrics.jsonl`` (one JSON object per log step) and TensorBoard event files."""

    def __init__(self, workdir: pathlib.Path, enabled: bool = True, resumed_at: int = 0):
        self.enabled = enabled
        if enabled:
            from tensorboardX import SummaryWriter

            # What a killed run logged after its last checkpoint is redone; a fresh start keeps an
            # earlier log aside instead (e.g. one that stopped before its first checkpoint).
            if resumed_at == 0 and logged_steps(workdir / "metrics.jsonl"):
                kept = set_aside_for_restart(workdir)
                print(f"Starting from step 0: the earlier metrics.jsonl of {workdir} is kept as {kept.name}.",
                      flush=True)
            truncate_metrics(workdir, resumed_at)
            self._jsonl = open(workdir / "metrics.jsonl", "a")  # noqa: SIM115 - closed in close()
            # purge_step: TensorBoard drops the earlier events at or after it.
            self._tb = SummaryWriter(str(workdir / "tensorboard"), purge_step=resumed_at + 1)

    def write(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        self._jsonl.write(json.dumps({"step": step, **{k: float(v) for k, v in metrics.items()}}) + "\n")
        self._jsonl.flush()
        for key, value in metrics.items():
            self._tb.add_scalar(key, float(value), step)
        self._tb.flush()

    def close(self) -> None:
        """Closes both; while another error propagates (e.g. a full disk met by ``write``), a failure
        to close stays behind it instead of replacing it."""
        if not self.enabled:
            return
        failing = sys.exc_info()[1] is not None
        for close in (self._jsonl.close, self._tb.close):
            try:
                close()
            except OSError:
                if not failing:
                    raise
