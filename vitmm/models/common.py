"""Small helpers shared by the model modules: initialisers, activations, option checks."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp


def trunc_normal(std: float = 0.02) -> Callable:
    """N(0, std²) truncated at ±2·std (flax's ``truncated_normal(stddev)``, as big_vision's ViT
    initialises), so the draws' standard deviation is ≈ 0.88·std. Not timm's
    ``trunc_normal_(std=.02)``: its bounds ``a=-2, b=2`` are absolute (±100σ at std .02), so timm's
    draws are effectively an untruncated N(0, std²).

    Draws conv kernels as ``[prod(leading dims), out]`` and reshapes: the same numbers (JAX's
    partitionable threefry counts elements in row-major order), compiled much faster by XLA:CPU.
    """
    draw = nn.initializers.truncated_normal(stddev=std)

    def init(key, shape, dtype=jnp.float32):
        if len(shape) <= 2:
            return draw(key, shape, dtype)
        return draw(key, (math.prod(shape[:-1]), shape[-1]), dtype).reshape(shape)

    return init


def check_choice(name: str, value, choices: Sequence) -> None:
    if value not in choices:
        raise ValueError(f"Unknown {name}={value!r}; choose one of {tuple(choices)}.")


def quick_gelu(x: jnp.ndarray) -> jnp.ndarray:
    """OpenAI CLIP's ``x * sigmoid(1.702 x)``."""
    return x * jax.nn.sigmoid(1.702 * x)


@jax.custom_jvp
def gelu(x: jnp.ndarray) -> jnp.ndarray:
    """Exact GELU ``x·Φ(x)``, written as PyTorch computes it, ``0.5·x·(1 + erf(x/√2))``.

    ``jax.nn.gelu(approximate=False)`` goes through ``erfc`` and autodiff of it, which on XLA:CPU
    cost about a third more than this form with its derivative ``Φ(x) + x·φ(x)`` written out
    (forward+backward of a ViT-S MLP activation, 6304×1536, 2 threads).
    """
    return x * _normal_cdf(x)


def _normal_cdf(x):
    return 0.5 * (1.0 + jax.lax.erf(x * (1 / math.sqrt(2))))


@gelu.defjvp
def _gelu_jvp(primals, tangents):
    (x,), (dx,) = primals, tangents
    cdf = _normal_cdf(x)
    pdf = jnp.exp(-0.5 * x * x) * (1 / math.sqrt(2 * math.pi))
    return x * cdf, (cdf + x * pdf) * dx


ACTIVATIONS: dict[str, Callable[[jnp.ndarray], jnp.ndarray]] = {
    "gelu": gelu,  # PyTorch nn.GELU(), timm, HF ViT
    "gelu_tanh": lambda x: nn.gelu(x, approximate=True),  # big_vision (flax default), SigLIP
    "quick_gelu": quick_gelu,  # OpenAI CLIP
    "relu": nn.relu,
    "silu": nn.silu,
}


def activation(name: str) -> Callable[[jnp.ndarray], jnp.ndarray]:
    check_choice("activation", name, tuple(ACTIVATIONS))
    return ACTIVATIONS[name]


def xla_flops(compiled) -> float:
    """FLOPs of a compiled program by XLA's cost analysis (``jax.jit(f).lower(...).compile()``)."""
    return _flops(compiled.cost_analysis())


def _flops(analysis) -> float:
    if isinstance(analysis, (list, tuple)):  # older JAX: one dict per device program
        analysis = analysis[0]
    return float(analysis.get("flops", 0.0))


def lowered_flops(fn: Callable, *args) -> float:
    """FLOPs of ``fn(*args)`` by XLA's cost analysis of the program lowered for the CPU, before any
    compiler pass (``args``: arrays or ``jax.ShapeDtypeStruct``s; nothing is allocated or
    compiled): the same count on every machine. A GPU's count of its compiled program leaves out
    the matmuls it hands to cuBLAS (an H200's of SmolLM2-135M's prefill: 15.4 GFLOP a sequence
    against ~166 by this count and by hand); XLA:CPU's of its compiled program is within ~2.5% of
    this one (its passes fold some elementwise work)."""
    return _flops(jax.jit(fn).trace(*args).lower(lowering_platforms=("cpu",)).cost_analysis())


def traced_cost(init: Callable, apply: Callable, *args) -> tuple[dict, float]:
    """``(parameter shapes, forward FLOPs)`` of ``apply(variables, *args)`` without allocating
    parameters or compiling: shapes from ``jax.eval_shape(init)``, FLOPs from ``lowered_flops``
    (until 2026-12-08 XLA's count of the compiled forward: wrong on a GPU, within ~2.5% on a CPU)."""
    shapes = jax.eval_shape(init, jax.random.key(0), *args)
    return shapes, lowered_flops(apply, shapes, *args)
