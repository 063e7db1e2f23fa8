"""From the host's batches to the devices, and the data position a checkpoint keeps.

``DeviceIterator`` prefetches batches onto devices (``to_device``, or the mesh's own placement)
while its state stays the host iterator's right after the last batch returned: saved with a
checkpoint, it resumes at the next unseen batch. With several processes each reads its own slice
of the data, so ``gather_states`` collects every process's state for the one checkpoint the first
process writes and ``own_state`` hands each its part back.
"""

from __future__ import annotations

import collections
import json
from collections.abc import Callable

import jax
import numpy as np

from vitmm.data import pipeline


# ----------------------------------------------------------------------------------------------
# Iterator states of several processes.
# ----------------------------------------------------------------------------------------------
def gather_states(state, allgather=None) -> dict:
    """Every process's iterator state, for one checkpoint written by the first process.

    Processes that skip bad examples read different numbers of records, so their states differ
    and each must get its own back (``own_state``). ``allgather(array)`` stacks an array from every
    process (default: ``multihost_utils.process_allgather``); one process's state is a list of one,
    so a resume on another number of processes is refused, not read as everyone's."""
    if allgather is None:
        if jax.process_count() == 1:
            return {"per_process": [state]}
        from jax.experimental import multihost_utils

        allgather = multihost_utils.process_allgather
    blob = np.frombuffer(json.dumps(state).encode(), np.uint8)
    lengths = np.asarray(allgather(np.int32(len(blob)))).reshape(-1)
    padded = np.zeros(int(lengths.max()), np.uint8)
    padded[: len(blob)] = blob
    rows = np.asarray(allgather(padded))
    return {"per_process": [json.loads(bytes(row[:n])) for row, n in zip(rows, lengths, strict=True)]}


def own_state(state, process_index: int | None = None, process_count: int | None = None):
    """This process's part of a ``gather_states`` state (a bare state, as one process saved it before
    states were lists, is a list of one)."""
    index, count = pipeline.process_slot(process_index, process_count)
    states = state["per_process"] if isinstance(state, dict) and "per_process" in state else [state]
    if len(states) != count:
        saved = f"{len(states)} process" + ("es" if len(states) > 1 else "")
        raise ValueError(f"The checkpoint's data position was saved by {saved}; this run has {count}. "
                         f"Resume with {saved} (each reads its own slice of the data).")
    return states[index]


# ----------------------------------------------------------------------------------------------
# Device transfer.
# ----------------------------------------------------------------------------------------------
def to_device(batch: dict, sharding=None) -> dict:
    """Moves the numeric arrays of a host batch to devices; other fields stay on the host.

    With a ``sharding`` (e.g. ``NamedSharding(mesh, P("data"))``) each process's rows become its
    part of one global array (``jax.make_array_from_process_local_data``).
    """
    out = {}
    for key, value in batch.items():
        if isinstance(value, np.ndarray) and value.dtype.kind in "biuf":
            if sharding is None:
                out[key] = jax.device_put(value)
            else:
                out[key] = jax.make_array_from_process_local_data(sharding, value)
        else:
            out[key] = value
    return out


class DeviceIterator:
    """Prefetches ``size`` batches onto devices while keeping an exact, resumable state (``size=0``:
    none ahead, each batch put on the devices when it is taken).

    ``get_state()`` is the host iterator's state right after the last batch *returned* (not the
    ones waiting in the prefetch queue), so saving it with a checkpoint and calling ``set_state``
    later continues with the next unseen batch.
    """

    def __init__(self, host_iterator, size: int = 2, put: Callable[[dict], dict] = to_device):
        self._it, self._size, self._put = host_iterator, size, put
        self._queue: collections.deque = collections.deque()
        self._state = host_iterator.get_state()

    def _fill(self):
        while len(self._queue) < self._size:
            try:
                batch = next(self._it)
            except StopIteration:
                return
            self._queue.append((self._put(batch), self._it.get_state()))

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        self._fill()
        if self._queue:
            batch, self._state = self._queue.popleft()
        elif self._size:  # the host stream has ended
            raise StopIteration
        else:  # size 0 (input.device_prefetch=0): nothing ahead, each batch put on the devices as it is taken
            batch = self._put(next(self._it))
            self._state = self._it.get_state()
        self._fill()
        return batch

    def get_state(self):
        return self._state

    def set_state(self, state) -> None:
        self._queue.clear()
        self._it.set_state(state)
        self._state = state

    def close(self) -> None:
        """Stops the host iterator's worker processes, if it has any."""
        self._queue.clear()
        close(self._it)


def close(iterator) -> None:
    """``iterator.close()`` where it has one (worker processes to stop)."""
    if hasattr(iterator, "close"):
        iterator.close()
