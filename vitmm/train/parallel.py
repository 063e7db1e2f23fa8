"""Data parallelism behind one interface: ``jax.pmap`` or ``jax.jit`` over a device mesh.

The train step is written once, for the batch a device group sees; ``Parallel`` places the
state and batches and compiles the step:

* ``"pmap"``: parameters replicated per local device, ``axis_name="batch"``, batches reshaped
  to ``[local_devices, per_device, ...]``; the step reduces gradients with ``pmean``.
* ``"jit"``: one ``Mesh`` over all devices with a ``data`` axis (and a ``model`` axis of
  ``tensor_parallel`` devices); batches are global arrays sharded on ``data``; parameters are
  replicated, or with ``fsdp=True`` each large parameter (and its optimizer moments) is sharded
  along its largest divisible axis over ``data`` (ZeRO-3 style). With ``tensor_parallel > 1``
  the transformer layers are split Megatron-style over ``model``: the projections into the
  attention heads and the MLP's hidden layer (``q``, ``k``, ``v``, ``qkv``, ``gate``, ``up``,
  ``fc1``) by their output columns, the projections out of them (``o``, ``out``, ``down``,
  ``fc2``) by their input rows; FSDP then shards another axis over ``data``. XLA inserts the
  collectives (GSPMD), so the step's numbers are the unsharded step's (tested on 8 devices).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from vitmm.data import device_feed
from vitmm.train.step import weighted_mean

AXIS = "batch"  # pmap axis name
MESH_AXIS = "data"
MODEL_AXIS = "model"
KINDS = ("pmap", "jit")
COLUMNS = re.compile(r"/(q|k|v|qkv|gate|up|fc1)/(kernel|bias)$")  # split by output: each device some heads
ROWS = re.compile(r"/(o|out|down|fc2)/kernel$")  # split by input: partial sums, all-reduced by XLA


class Parallel:
    def __init__(self, kind: str = "jit", fsdp: bool = False, fsdp_min_size: int = 2**16, tensor_parallel: int = 1,
                 devices=None):
        """``devices``: the mesh's (default: all of JAX's); compile-only devices of another machine
        (``gpu_targets.devices``) make a mesh to compile for, on which batches are shapes only."""
        if kind not in KINDS:
            raise ValueError(f"Unknown parallel={kind!r}; choose one of {KINDS}.")
        self.devices = list(devices or jax.devices())
        self.abstract = devices is not None and self.devices[0] not in jax.devices()
        n = len(self.devices)
        if not isinstance(tensor_parallel, int) or tensor_parallel < 1 or n % tensor_parallel or \
                (tensor_parallel > 1 and kind != "jit"):
            raise ValueError(f"tensor_parallel={tensor_parallel!r}: a number of devices dividing the {n} there are, "
                             "with parallel=jit.")
        if fsdp and kind != "jit":  # pmap keeps a whole copy of the state on every device: nothing would be sharded
            raise ValueError(f"fsdp=True shards parameters and optimizer state over a mesh, which parallel={kind!r} "
                             "does not have (every device would hold all of it): set --config.parallel=jit, or "
                             "--config.fsdp=False.")
        local = len([d for d in self.devices if d.process_index == jax.process_index()])
        if not self.abstract and tensor_parallel > 1 and local % tensor_parallel:
            # a row of the mesh across processes would take each process's rows for the whole batch
            raise ValueError(f"tensor_parallel={tensor_parallel} must divide the {local} devices of each process: "
                             "a model split spans one host's devices.")
        self.kind, self.fsdp, self.fsdp_min_size, self.tensor_parallel = kind, fsdp, fsdp_min_size, tensor_parallel
        self._warned_whole = False  # (state_sharding's warning, once a run)
        self.mesh = jax.sharding.Mesh(np.array(self.devices).reshape(n // tensor_parallel, tensor_parallel),
                                      (MESH_AXIS, MODEL_AXIS))
        self.replicated = NamedSharding(self.mesh, P())
        self.batch_sharding = NamedSharding(self.mesh, P(MESH_AXIS))
        # pmap's inputs: leading axis over this process's devices (what pmap itself produces).
        local_mesh = jax.sharding.Mesh(np.array(jax.local_devices()), (AXIS,))
        self.local_sharding = NamedSharding(local_mesh, P(AXIS))

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    @property
    def needs_host_sync(self) -> bool:
        """XLA:CPU deadlocks after ~30 un-synced steps with collectives: block every few steps."""
        return self.devices[0].platform == "cpu" and len(self.devices) > 1

    # --- state -----------------------------------------------------------------------------
    def state_sharding(self, abstract_state):
        """NamedShardings for a state of ``ShapeDtypeStruct``s (jit path): the tensor-parallel split
        of the layers' projections (their optimizer moments alike, found by the same path), then
        FSDP's (see the module docstring). A large leaf none of whose axes divides the data axis
        (and not split over the model axis) stays whole on every device, with a warning (once)
        naming it: FSDP saves no memory on it, and on a device count that divides no axis, none."""
        whole = []

        def rule(path, x):
            shape = getattr(x, "shape", ())
            spec = [None] * len(shape)
            tp, name = self.tensor_parallel, jax.tree_util.keystr(path, simple=True, separator="/")
            if tp > 1 and shape and COLUMNS.search(name) and shape[-1] % tp == 0:
                spec[-1] = MODEL_AXIS
            elif tp > 1 and len(shape) == 2 and ROWS.search(name) and shape[0] % tp == 0:
                spec[0] = MODEL_AXIS
            if self.fsdp and int(np.prod(shape, dtype=np.int64)) >= self.fsdp_min_size:
                n = self.mesh.shape[MESH_AXIS]
                for axis in np.argsort(shape)[::-1]:
                    if spec[axis] is None and shape[axis] % n == 0:
                        spec[axis] = MESH_AXIS
                        break
                if not any(spec):  # (a leaf split over the model axis alone is still split)
                    whole.append((name, tuple(shape), np.prod(shape, dtype=np.int64) * getattr(x.dtype, "itemsize", 4)))
            return NamedSharding(self.mesh, P(*spec)) if any(spec) else self.replicated

        shardings = jax.tree_util.tree_map_with_path(rule, abstract_state)
        if whole and not self._warned_whole:
            self._warned_whole = True
            shown = ", ".join(f"{name} {shape}" for name, shape, _ in whole[:3]) + (", ..." if len(whole) > 3 else "")
            warnings.warn(f"fsdp=True: {len(whole)} leaves of the state ({sum(b for *_, b in whole) / 2**20:.1f} MiB) "
                          "stay whole on every device, as none of their axes divides the "
                          f"{self.mesh.shape[MESH_AXIS]} devices of the data axis: {shown}. Train on a number of "
                          "devices that divides them to shard them.", stacklevel=2)
        return shardings

    def put_state(self, state):
        if self.kind == "pmap":
            # One copy per local device, laid out as pmap lays out its own outputs: with
            # flax's replicate (device_put_sharded, a mesh of its own) the first step's inputs
            # differ in sharding from every later step's, and pmap traced and compiled the step twice.
            n = jax.local_device_count()
            return jax.tree.map(lambda x: jax.device_put(np.broadcast_to(to_host(x), (n, *np.shape(x))),
                                                         self.local_sharding), state)
        shardings = self.state_sharding(jax.eval_shape(lambda: state))
        return jax.device_put(state, shardings)

    def host_state(self, state):
        """The state as one copy of global arrays (what a checkpoint stores)."""
        if self.kind == "pmap":
            # Replica 0's shard, read where it lies. Indexing ``x[0]`` ran one program over all
            # local devices per leaf; a few hundred of those, queued behind a step, left
            # XLA:CPU deadlocked in an all-reduce (three replicas waiting, the fourth not launched).
            def first_replica(x):
                shard = min(x.addressable_shards, key=lambda s: s.index[0].start or 0)
                return shard.data.reshape(x.shape[1:])

            if jax.process_count() == 1:
                return jax.tree.map(first_replica, state)
            # Several processes: orbax saves global arrays only. Each local device's replica becomes
            # that device's copy of one array replicated over every device of every process.
            every = self._every_device()
            return jax.tree.map(lambda x: jax.make_array_from_single_device_arrays(
                x.shape[1:], every, [s.data.reshape(x.shape[1:]) for s in x.addressable_shards]), state)
        return state

    def _every_device(self) -> NamedSharding:
        """Replicated over all devices of all processes (pmap's state as one global array)."""
        return NamedSharding(jax.sharding.Mesh(np.array(jax.devices()), ("all",)), P())

    def abstract_for_restore(self, abstract_state):
        """``ShapeDtypeStruct``s with the shardings a restored state should land on."""
        if self.kind == "pmap":
            one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0]) if jax.process_count() == 1 else \
                self._every_device()
            shardings = jax.tree.map(lambda _: one, abstract_state)
        else:
            shardings = self.state_sharding(abstract_state)
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            abstract_state, shardings)

    # --- batches ---------------------------------------------------------------------------
    def put_batch(self, batch: dict) -> dict:
        if self.kind == "pmap":
            n = jax.local_device_count()
            out = {}
            for key, value in batch.items():
                if isinstance(value, np.ndarray) and value.dtype.kind in "biuf":
                    if value.shape[0] % n:
                        raise ValueError(f"Batch of {value.shape[0]} rows does not split over {n} devices.")
                    value = value.reshape(n, value.shape[0] // n, *value.shape[1:])
                    out[key] = jax.device_put(value, self.local_sharding)
                else:
                    out[key] = value
            return out
        if self.abstract:  # compiling for devices not here: the batch's shapes on them
            return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=self.batch_sharding)
                    if isinstance(v, np.ndarray) and v.dtype.kind in "biuf" else v for k, v in batch.items()}
        return device_feed.to_device(batch, self.batch_sharding)

    # --- compilation -----------------------------------------------------------------------
    def compile(self, step: Callable, state_example, donate: bool = True) -> Callable:
        """``step(state, batch) -> (state, metrics)``, compiled for this kind of parallelism."""
        if self.kind == "pmap":
            return jax.pmap(step, axis_name=AXIS, donate_argnums=(0,) if donate else ())
        shardings = self.state_sharding(jax.eval_shape(lambda: state_example))
        return jax.jit(step, in_shardings=(shardings, self.batch_sharding),
                       out_shardings=(shardings, self.replicated),
                       donate_argnums=(0,) if donate else ())

    def reduce(self, tree, weight=None):
        """Mean over devices of per-device values (pmap); identity for global arrays (jit). With
        ``weight`` (each device's count its values are means over, e.g. answer tokens), the mean
        weighted by it, and the devices' total: ``(tree, total)``."""
        if weight is None:
            return jax.lax.pmean(tree, AXIS) if self.kind == "pmap" else tree
        if self.kind != "pmap":
            return tree, weight
        weight = weight.astype(jnp.float32)  # summed in float32: a bf16 count rounds past 256
        total = jax.lax.psum(weight, AXIS)
        sums = jax.lax.psum(jax.tree.map(lambda x: x.astype(jnp.float32) * weight, tree), AXIS)
        return jax.tree.map(lambda m, x: m.astype(x.dtype), weighted_mean(sums, total), tree), total

    def device_rng(self, rng):
        return jax.random.fold_in(rng, jax.lax.axis_index(AXIS)) if self.kind == "pmap" else rng

    def first(self, metrics):
        """Metrics on the host: the first replica under pmap, the (replicated) value under jit."""
        if self.kind == "pmap":
            return jax.tree.map(lambda x: to_host(x)[0], metrics)
        return jax.tree.map(to_host, metrics)


def to_host(x) -> np.ndarray:
    """A numpy copy of ``x`` on this process, also for arrays that span several processes
    (replicated: the local copy; sharded: gathered from all processes)."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    if x.is_fully_replicated:
        return np.asarray(x.addressable_shards[0].data)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))

