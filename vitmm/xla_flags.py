"""The XLA settings vitmm's entry points prefer, applied before JAX opens a backend.

``python -m vitmm.train``, ``python -m vitmm.demo`` and the CPU experiments call
``use_vitmm_defaults()`` first thing. On CPU it turns off XLA's YNNPACK fusions, which ran
vitmm's ViTs slower than XLA's own kernels (measurements: ``results/benchmark/``). A YNN setting
already in ``XLA_FLAGS`` is kept; ``VITMM_XLA_CPU_DEFAULTS=0`` leaves ``XLA_FLAGS`` alone. Other
backends ignore the flag. Library code never calls this: importing vitmm has no side effects.
"""

from __future__ import annotations

import os

YNN_FLAG = "--xla_cpu_experimental_ynn_fusion_type"


def use_vitmm_defaults() -> str:
    """Adds vitmm's preferred flags to ``XLA_FLAGS`` (unless opted out) and returns its value.
    XLA reads the variable when JAX first opens a backend; later calls change nothing there."""
    flags = os.environ.get("XLA_FLAGS", "")
    if os.environ.get("VITMM_XLA_CPU_DEFAULTS", "1") != "0" and YNN_FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {YNN_FLAG}=".strip()
    return os.environ.get("XLA_FLAGS", "")
