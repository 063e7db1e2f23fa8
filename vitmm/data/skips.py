"""Bad examples in raw data: skipped, counted by reason, and a stop when there are too many.

A reader or a preprocessing op that meets an example it cannot use (a missing or undecodable
image, an empty conversation, ...) raises ``BadExample(reason, detail)``; ``guard`` turns that
into a ``Skipped`` marker, and ``SkippingBatches`` fills each batch with good examples only,
counting the rest. The counts and the first few ids per reason are part of the iterator's state,
so they are saved with every checkpoint and a resumed run continues them exactly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

REASONS = {
    "image_missing": "the image file does not exist",
    "image_unreadable": "the image cannot be decoded",
    "image_aspect": "the image's aspect ratio is over 200 (Qwen2-VL's limit; a shorter-side resize would be huge)",
    "empty_conversation": "the conversation has no turns",
    "turns_not_alternating": "the turns are not user/assistant pairs after an optional system turn",
    "unknown_role": "a turn's 'from' is not human, gpt or system",
    "image_tag_mismatch": "the number of <image> tags differs from the number of images",
    "too_many_images": "more images than the model takes per example",
    "too_long": "even the first exchange does not fit model.max_len",
    "too_long_for_row": "with its images' tokens the example does not fit a row of input.sequences",
    "answer_not_rendered": "the chat template does not render an assistant turn's text as given",
    "caption_missing": "no caption (no .txt, or an empty caption)",
    "shard_truncated": "the tar shard ends inside this example",
    "shard_unreadable": "a stretch of the tar shard whose headers are damaged (its examples are lost)",
    "bad_record": "the record is not valid JSON or lacks a required field",
}
SHOW_IDS = 5  # ids kept per reason (for the log and the stop message)


class BadExample(Exception):
    """An example that cannot be used: skipped and counted under ``reason`` (a key of ``REASONS``)."""

    def __init__(self, reason: str, detail: str = ""):
        if reason not in REASONS:
            raise ValueError(f"Unknown skip reason {reason!r}; add it to vitmm.data.skips.REASONS.")
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.detail = reason, detail

    def __reduce__(self):  # from an input worker process to the trainer as it was raised
        return BadExample, (self.reason, self.detail)


@dataclasses.dataclass(frozen=True)
class Skipped:
    """What a skipped example becomes in the stream."""

    reason: str
    id: str
    detail: str = ""


def example_id(example) -> str:
    return str(example.get("_id", "?")) if isinstance(example, dict) else "?"


def guard(fn: Callable) -> Callable:
    """``fn(example, rng)`` (e.g. a parsed pp) that passes ``Skipped`` through and turns a
    ``BadExample`` into one; any other error is a bug and propagates."""

    def guarded(example, rng):
        if isinstance(example, Skipped):
            return example
        try:
            return fn(example, rng)
        except BadExample as bad:
            return Skipped(bad.reason, example_id(example), bad.detail)

    return guarded


ADVICE = ("List every bad example with `python -m vitmm.data check` and fix or drop them, or raise "
          "input.max_skipped_share.")
ALL_BAD = 10_000  # bad examples in a row that stop a run whatever its limit: data that is all bad


class TooManySkipped(ValueError):
    pass


def report(state: dict) -> str:
    """``read N, skipped K (p%): reason k (first ids: ...), ...`` for an iterator state."""
    read, counts = state["read"], state["skipped"]
    total = sum(counts.values())
    parts = [f"{reason} {n} (e.g. {', '.join(state['first'].get(reason, []))})" for reason, n in sorted(counts.items())]
    share = f"read {read}, skipped {total} ({100 * total / max(read, 1):.2f}%)"
    return share + (": " + "; ".join(parts) if parts else "")


def local_limit(max_share: float | None, process_count: int) -> float | None:
    """The skipped share each process's own iterators stop at: the run's with one process. With
    several, none (1.0): one process stopping alone would leave the others waiting in the step's
    collectives; the trainer stops them together on their summed counts (``check_all_processes``)."""
    return max_share if max_share is None or process_count == 1 else 1.0


def check_all_processes(metrics: dict, max_share: float | None, process_count: int, min_read: int = 1000) -> None:
    """``TooManySkipped`` when the counts of every process (``metrics_of_all_processes``, the same
    on each: every process stops at the same step) pass ``max_share`` after ``min_read`` examples."""
    read, skipped = metrics.get("data/read", 0), metrics.get("data/skipped", 0)
    if max_share is None or read < min_read or skipped <= max_share * read:
        return
    reasons = "; ".join(f"{k.rsplit('/', 1)[-1]} {int(v)}" for k, v in sorted(metrics.items())
                        if k.startswith("data/skipped/"))
    raise TooManySkipped(
        f"Too much bad data over the {process_count} processes: read {int(read)}, skipped {int(skipped)} "
        f"({100 * skipped / read:.2f}%){': ' + reasons if reasons else ''}, more than "
        f"input.max_skipped_share={max_share}. {ADVICE}")


class SkippingBatches:
    """Batches of ``batch_size`` good examples from an iterator of examples and ``Skipped``.

    ``max_share``: the run stops (``TooManySkipped``) when the skipped share of the examples read
    passes it, judged once ``min_read`` examples have been read (fewer would make one bad example
    among the first few a stop). ``get_state``/``set_state`` cover the examples' iterator and the
    counts; the state is JSON.
    """

    def __init__(self, examples, batch_size: int, collate: Callable, max_share: float = 0.01,
                 min_read: int = 1000):
        if not 0 <= max_share <= 1:
            raise ValueError(f"input.max_skipped_share={max_share!r}: must be a fraction in [0, 1].")
        self._it, self._batch_size, self._collate = examples, batch_size, collate
        self.max_share, self.min_read = max_share, min_read
        self._counts = self._fresh()

    @staticmethod
    def _fresh() -> dict:
        return {"read": 0, "truncated": 0, "skipped": {}, "first": {}}

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        good, c, in_a_row = [], self._counts, 0
        while len(good) < self._batch_size:
            example = next(self._it)
            c["read"] += 1
            if isinstance(example, Skipped):
                c["skipped"][example.reason] = c["skipped"].get(example.reason, 0) + 1
                first = c["first"].setdefault(example.reason, [])
                if len(first) < SHOW_IDS and example.id not in first:
                    first.append(example.id)
                in_a_row += 1
                self._check(in_a_row)  # while the batch fills: data that is all bad must not read forever
                continue
            c["truncated"] += int(example.pop("_truncated", 0))
            example.pop("_id", None)
            good.append(example)
            in_a_row = 0
        self._check(0)
        return self._collate(good)

    def _check(self, in_a_row: int) -> None:
        c = self._counts
        skipped = sum(c["skipped"].values())
        if c["read"] >= self.min_read and skipped > self.max_share * c["read"]:
            raise TooManySkipped(
                f"Too much bad data: {report(c)}, more than input.max_skipped_share={self.max_share}. {ADVICE}")
        if in_a_row >= ALL_BAD:  # (with several processes the share is judged on the sum, at log steps)
            raise TooManySkipped(
                f"Too much bad data: {in_a_row} examples in a row were bad ({report(c)}): check the data's paths "
                "(e.g. input.image_folder) with `python -m vitmm.data check`.")

    def get_state(self) -> dict:
        return {"examples": self._it.get_state(), "counts": _copy(self._counts)}

    def set_state(self, state: dict) -> None:
        if "examples" not in state:  # saved by another input (e.g. with worker processes): the reader says why
            self._it.set_state(state)
            raise ValueError(f"The checkpoint's data position ({sorted(state)}) is not this input's; resume with the "
                             "input settings it was saved with.")
        self._it.set_state(state["examples"])
        self._counts = _copy(state["counts"])

    def close(self) -> None:
        if hasattr(self._it, "close"):
            self._it.close()

    def counts(self) -> dict:
        return _copy(self._counts)


def _copy(counts: dict) -> dict:
    return {"read": int(counts["read"]), "truncated": int(counts.get("truncated", 0)),
            "skipped": {k: int(v) for k, v in counts["skipped"].items()},
            "first": {k: list(v) for k, v in counts["first"].items()}}


def total_counts(state) -> dict | None:
    """The counts of a ``SkippingBatches`` state, summed over every one nested in it (one per input
    worker process); None for another iterator's state."""
    found = []

    def walk(node):
        if isinstance(node, dict):
            if isinstance(node.get("counts"), dict) and "read" in node["counts"]:
                found.append(node["counts"])
            else:
                for value in node.values():
                    walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(state)
    if not found:
        return None
    total = SkippingBatches._fresh()
    for counts in found:
        total["read"] += counts["read"]
        total["truncated"] += counts.get("truncated", 0)
        for reason, n in counts["skipped"].items():
            total["skipped"][reason] = total["skipped"].get(reason, 0) + n
        for reason, ids in counts["first"].items():
            total["first"][reason] = (total["first"].get(reason, []) + list(ids))[:SHOW_IDS]
    return total


def metrics_of_all_processes(state) -> dict:
    """``metrics`` summed over every process, each of which reads its own share (a collective:
    every process calls it at the same step)."""
    import jax

    local = metrics(state)
    if jax.process_count() == 1:
        return local
    from jax.experimental import multihost_utils

    keys = ("data/read", "data/skipped", "data/truncated", *(f"data/skipped/{r}" for r in REASONS))
    counts = np.array([local.get(k, 0) for k in keys] + [bool(local)], np.int64)
    # Gathered as 31-bit halves: JAX without x64 holds int32, and a long run reads past 2**31 examples a host.
    halves = np.stack([counts >> 31, counts & (2**31 - 1)]).astype(np.int32)
    gathered = np.asarray(multihost_utils.process_allgather(halves)).astype(np.int64)
    total = ((gathered[:, 0] << 31) + gathered[:, 1]).sum(0)
    if not total[-1]:
        return {}
    return {k: np.float64(v) for k, v in zip(keys, total[:-1], strict=True) if v or not k.startswith("data/skipped/")}


def metrics(state) -> dict:
    """The numbers a log step writes (``data/read``, ``data/skipped``, ``data/skipped/<reason>``,
    ``data/truncated``) from a ``SkippingBatches`` state (or several, one per worker process);
    ``{}`` for another iterator's state."""
    counts = total_counts(state)
    if not counts:
        return {}
    out = {"data/read": counts["read"], "data/skipped": sum(counts["skipped"].values()),
           "data/truncated": counts.get("truncated", 0)}
    out.update({f"data/skipped/{reason}": n for reason, n in counts["skipped"].items()})
    return {k: np.float64(v) for k, v in out.items()}
