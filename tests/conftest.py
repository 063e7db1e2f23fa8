"""Shared test settings, applied before JAX starts.

* Four virtual CPU devices, so that data-parallel code (pmap, meshes, shard_map collectives)
  is tested on every run; single-device code still runs on device 0.
* float32 matmuls at full precision, so that tolerances mean what they say.
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
).strip()

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
