"""vitmm: vision encoders and multimodal connectors in JAX/Flax."""

import os

__version__ = "0.1.0"

# XLA:CPU's YNNPACK fusions (the default for dots and many elementwise ops in jaxlib 0.10) ran
# vitmm's ViTs slower than XLA's own kernels with Eigen dots on the 2-core CPU this was tuned on:
# ViT-S/16 batch 32 train step −9%, forward −15%; ViT-Ti/16 step −20% (experiments/benchmark.py,
# README "Performance"). XLA reads XLA_FLAGS when JAX first opens a backend, so this takes effect
# when vitmm is imported before any JAX computation runs. A YNN setting of your own in XLA_FLAGS
# is kept; VITMM_XLA_CPU_DEFAULTS=0 leaves XLA_FLAGS alone. Other backends ignore the flag.
_YNN_FLAG = "--xla_cpu_experimental_ynn_fusion_type"


def _set_xla_cpu_defaults() -> None:
    flags = os.environ.get("XLA_FLAGS", "")
    if os.environ.get("VITMM_XLA_CPU_DEFAULTS", "1") == "0" or _YNN_FLAG in flags:
        return
    os.environ["XLA_FLAGS"] = f"{flags} {_YNN_FLAG}=".strip()


_set_xla_cpu_defaults()
