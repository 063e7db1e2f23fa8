"""Shared test settings, applied before JAX starts.

* Four virtual CPU devices, so that data-parallel code (pmap, meshes, shard_map collectives)
  is tested on every run; single-device code still runs on device 0.
* float32 matmuls at full precision, so that tolerances mean what they say.
* One persistent XLA compilation cache for the session, shared by both xdist workers and every
  subprocess a test starts (through the environment): many tests compile the very same smoke
  train step (the trainer's resume test alone compiles it three times: 78 s without the cache,
  53 s cold, 33 s warm). Programs are keyed by their HLO, options and the JAX version, so a hit
  is the same executable. ``VITMM_TEST_XLA_CACHE=`` (empty) turns it off.
"""

import os
import tempfile

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
).strip()

_cache = os.environ.get("VITMM_TEST_XLA_CACHE", os.path.join(tempfile.gettempdir(), f"vitmm-test-xla-{os.getuid()}"))
if _cache:
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _cache)
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
