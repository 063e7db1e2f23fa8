"""Small helpers shared by the model modules: initialisers, activations, option checks."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp


def trunc_normal(std: float = 0.02) -> Callable:
    """Truncated normal at ±2σ (the ViT/timm ``trunc_normal_(std=.02)`` initialiser)."""
    return nn.initializers.truncated_normal(stddev=std)


def check_choice(name: str, value, choices: Sequence) -> None:
    if value not in choices:
        raise ValueError(f"Unknown {name}={value!r}; choose one of {tuple(choices)}.")


def quick_gelu(x: jnp.ndarray) -> jnp.ndarray:
    """OpenAI CLIP's ``x * sigmoid(1.702 x)``."""
    return x * jax.nn.sigmoid(1.702 * x)


ACTIVATIONS: dict[str, Callable[[jnp.ndarray], jnp.ndarray]] = {
    "gelu": lambda x: nn.gelu(x, approximate=False),  # PyTorch nn.GELU(), timm, HF ViT
    "gelu_tanh": lambda x: nn.gelu(x, approximate=True),  # big_vision (flax default), SigLIP
    "quick_gelu": quick_gelu,  # OpenAI CLIP
    "relu": nn.relu,
    "silu": nn.silu,
}


def activation(name: str) -> Callable[[jnp.ndarray], jnp.ndarray]:
    check_choice("activation", name, tuple(ACTIVATIONS))
    return ACTIVATIONS[name]


def count_params(tree) -> int:
    """Number of scalars in a parameter pytree (works on ``jax.eval_shape`` output too)."""
    return int(sum(x.size for x in jax.tree.leaves(tree)))
