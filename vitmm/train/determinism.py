"""``deterministic=True``: a run that repeats bit for bit on a GPU, and what it gives up for it.

On a CPU vitmm's runs repeat exactly as they are (the test suite resumes runs bitwise). On a GPU,
XLA's reductions and scatters use atomics by default, so two identical runs part within a few steps
(one H200, 2026-12-04: from step 5; ``results/gpu_trainer/README.md``). With the config's
``deterministic=True`` the trainer

- adds ``--xla_gpu_deterministic_ops=true`` to ``XLA_FLAGS`` before JAX opens its backend (XLA
  reads the variable once per process; with it the same runs agreed bitwise at every step). A
  process whose GPU backend already started without it is refused in one line, as is an
  ``XLA_FLAGS`` that turns the flag off;
- runs cuDNN's fused attention (``attn_impl="cudnn"``, of the tower or the LM, from the config or
  from a loaded checkpoint's settings) as XLA's, and says so: under deterministic ops the cuDNN
  ViT-B/16 step compiled but failed when called (``IndexError`` from XLA's runtime; JAX 0.11.2, one
  H200, issue 52). XLA's attention keeps every score for the backward pass: more memory
  (``results/memory/``).

The speed this costs is measured by ``experiments/gpu/bench.py --sweep`` (its deterministic rows).
"""

from __future__ import annotations

import os

import jax

FLAG = "xla_gpu_deterministic_ops"
ATTENTION_WHY = ("cuDNN's fused attention failed under deterministic XLA ops on an H200 (JAX 0.11.2): "
                 "docs/failures.md")
_said: set[str] = set()


def requested(config) -> bool:
    return bool(config.get("deterministic", False))


def _flag_value(flags: str) -> bool | None:
    """The value ``XLA_FLAGS`` gives the flag (the last mention wins, as in XLA), or None."""
    value = None
    for word in flags.split():
        name, _, text = word.lstrip("-").partition("=")
        if name == FLAG:
            value = text.lower() not in ("false", "0")
    return value


def set_flags(config) -> None:
    """Before JAX opens a backend: deterministic GPU kernels when ``config.deterministic``."""
    if not requested(config):
        return
    flags = os.environ.get("XLA_FLAGS", "")
    value = _flag_value(flags)
    if value is False:
        raise ValueError(f"deterministic=True, but XLA_FLAGS sets --{FLAG}=false; drop one of the two.")
    if value:
        return
    if not _backends_started():
        os.environ["XLA_FLAGS"] = f"{flags} --{FLAG}=true".strip()
    elif jax.default_backend() != "cpu":  # a CPU's kernels repeat as they are
        raise ValueError(f"deterministic=True: JAX's {jax.default_backend()} backend started before the run, without "
                         f"--{FLAG}; start the process with XLA_FLAGS=--{FLAG}=true (or call vitmm.train.trainer.train "
                         "before any JAX computation).")


def _backends_started() -> bool:
    try:  # JAX's own record (private, stable since 2023); without it, the flag is set and takes effect if in time
        from jax._src.xla_bridge import backends_are_initialized
    except ImportError:
        return False
    return backends_are_initialized()


def compile_options(config) -> dict:
    """XLA options for compiling the run's step for a GPU that is not here (``--dry_run_target``)."""
    return {FLAG: True} if requested(config) else {}


def attention(settings: dict, config, part: str) -> dict:
    """``settings`` of a tower or LM (``part`` names it) with XLA's attention in place of cuDNN's
    when the run is deterministic; unchanged otherwise."""
    if not requested(config) or settings.get("attn_impl") != "cudnn":
        return settings
    if part not in _said and jax.process_index() == 0:
        _said.add(part)
        print(f"deterministic=True: {part} runs XLA's attention, not attn_impl='cudnn' ({ATTENTION_WHY}).", flush=True)
    return {**settings, "attn_impl": "xla"}
