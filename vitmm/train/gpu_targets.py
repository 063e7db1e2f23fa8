"""GPUs to compile for without one: ``--dry_run --dry_run_target=h100`` on any machine.

XLA compiles for a GPU from a description of it (``GpuTargetConfigProto``: its streaming
multiprocessors, memory, caches, compute capability) through JAX's CUDA plugin, with no device
present; ``jax.experimental.topologies`` turns one into compile-only devices that a mesh and
``jit(...).lower(...).compile()`` accept. The compiled program is the one the GPU would run
(fusions, buffer assignment, cuDNN's fused attention), so its ``memory_analysis`` is the GPU's
without the GPU. What it needs: JAX's CUDA plugin and its libraries
(``pip install "jax[cuda13]==<jax's version>"``), not a driver; nothing runs.

The descriptions are the cards' published figures (SM count, HBM size and bandwidth, L2, shared
memory per SM, clock): what XLA's GPU compiler reads to choose tilings and fusions.
"""

from __future__ import annotations

import os

# JAX's CUDA plugin checks its CUDA libraries against a driver when JAX first looks for backends and
# is not loaded when there is none; a compile needs no driver. Set on import (``dry_run`` imports
# this module), so that it is in place before that first look.
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

# name: (card, SMs, HBM bytes, HBM bytes/s, L2 bytes, shared memory per SM, per block (opt-in), clock GHz,
#        compute capability)
CARDS = {
    "h100": ("NVIDIA H100 80GB HBM3", 132, 85_520_809_984, 3.35e12, 50 * 2**20, 233_472, 232_448, 1.98, (9, 0)),
    "h200": ("NVIDIA H200", 132, 150_754_820_096, 4.8e12, 50 * 2**20, 233_472, 232_448, 1.98, (9, 0)),
    "a100": ("NVIDIA A100-SXM4-80GB", 108, 85_899_345_920, 2.039e12, 40 * 2**20, 167_936, 166_912, 1.41, (8, 0)),
}


def target_config(name: str) -> str:
    """The text ``GpuTargetConfigProto`` of card ``name`` (a key of ``CARDS``)."""
    if name not in CARDS:
        raise ValueError(f"dry_run_target={name!r} is not a GPU vitmm can compile for; choose one of {sorted(CARDS)}.")
    card, sms, memory, bandwidth, l2, smem_core, smem_block, clock, (major, minor) = CARDS[name]
    return f"""
gpu_device_info {{
  threads_per_block_limit: 1024 threads_per_warp: 32 threads_per_core_limit: 2048
  shared_memory_per_block: 49152 shared_memory_per_core: {smem_core} shared_memory_per_block_optin: {smem_block}
  core_count: {sms} fpus_per_core: 128 registers_per_core_limit: 65536 registers_per_block_limit: 65536
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: {int(bandwidth)} l2_cache_size: {l2} clock_rate_ghz: {clock} device_memory_size: {memory}
  cuda_compute_capability {{ major: {major} minor: {minor} }}
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 10 }}
device_description_str: "{card}"
"""


def devices(name: str, count: int = 1) -> list:
    """``count`` compile-only devices of card ``name`` on one host: a mesh over them compiles the
    program those GPUs would run."""
    if not isinstance(count, int) or count < 1:
        raise ValueError(f"dry_run_devices={count!r}: a number of GPUs (1 or more).")
    target = target_config(name)
    from jax.experimental import topologies

    try:
        topology = topologies.get_topology_desc("", "cuda", target_config=target, topology=f"1x1x{count}")
    except (NotImplementedError, RuntimeError) as err:
        raise ValueError(f"dry_run_target={name!r} compiles for a GPU through JAX's CUDA plugin, which is not "
                         f"loaded here ({str(err).splitlines()[0]}): pip install \"jax[cuda13]\" at JAX's version "
                         "in a fresh environment, or run --dry_run on the GPU itself.") from None
    return list(topology.devices)
