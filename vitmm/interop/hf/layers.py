"""The block and encoder mapping transformers' CLIP, SigLIP, ViT and DINOv2 share, and their
names for activations."""

from __future__ import annotations

import re

import numpy as np

from vitmm.interop.common import (
    StateDict,
    linear,
    norm,
)

ACTIVATIONS = {"quick_gelu": "quick_gelu", "gelu": "gelu", "gelu_new": "gelu_tanh",
               "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu", "silu": "silu"}


def hf_activation(name: str) -> str:
    if name not in ACTIVATIONS:
        raise ValueError(f"Activation {name!r} has no vitmm counterpart; supported: {sorted(ACTIVATIONS)}.")
    return ACTIVATIONS[name]


# One role, several names: CLIP, transformers 5.x ViT/Dinov2, and the legacy hub layout.
ALIASES = {
    "q": ("self_attn.q_proj", "attention.q_proj", "attention.attention.query"),
    "k": ("self_attn.k_proj", "attention.k_proj", "attention.attention.key"),
    "v": ("self_attn.v_proj", "attention.v_proj", "attention.attention.value"),
    "o": ("self_attn.out_proj", "attention.o_proj", "attention.output.dense"),
    "norm1": ("layer_norm1", "layernorm_before", "norm1"),
    "norm2": ("layer_norm2", "layernorm_after", "norm2"),
    "fc1": ("mlp.fc1", "intermediate.dense"),
    "fc2": ("mlp.fc2", "output.dense"),
}


def key_name(sd: StateDict, block: str, role: str) -> str:
    for alias in ALIASES[role]:
        if sd.has(f"{block}.{alias}.weight"):
            return f"{block}.{alias}"
    return f"{block}.{ALIASES[role][0]}"  # reported as missing


def block_params(sd: StateDict, block: str) -> dict:
    q, k, v = (linear(sd, key_name(sd, block, n)) for n in "qkv")
    out = {
        "norm1": norm(sd, key_name(sd, block, "norm1")),
        "attn": {"qkv": {"kernel": np.concatenate([q["kernel"], k["kernel"], v["kernel"]], axis=1),
                         "bias": np.concatenate([q["bias"], k["bias"], v["bias"]])},
                 "out": linear(sd, key_name(sd, block, "o"))},
        "norm2": norm(sd, key_name(sd, block, "norm2")),
        "mlp": {"fc1": linear(sd, key_name(sd, block, "fc1")), "fc2": linear(sd, key_name(sd, block, "fc2"))},
    }
    if sd.has(f"{block}.layer_scale1.lambda1"):  # Dinov2's LayerScale
        out["ls1"] = sd.take(f"{block}.layer_scale1.lambda1")
        out["ls2"] = sd.take(f"{block}.layer_scale2.lambda1")
    return out


def encoder_params(sd: StateDict, blocks: str, depth: int, final_norm: str) -> dict:
    """``blocks``: the blocks' prefix up to the index (e.g. ``vision_model.encoder.layers``)."""
    enc = {f"block_{i:02d}": block_params(sd, f"{blocks}.{i}") for i in range(depth)}
    enc["encoder_norm"] = norm(sd, final_norm)
    return enc


def layer_count(tensors: dict, blocks: str) -> int:
    layers = {int(m.group(1)) for k in tensors if (m := re.match(re.escape(blocks) + r"\.(\d+)\.", k))}
    return max(layers) + 1 if layers else 0


def tower_prefix(tensors: dict, tower: str) -> str | None:
    """``"vision_model"`` (hub and CLIPModel layout), ``""`` (a standalone CLIPVisionModel saved by
    transformers 5.x) or None when the tower is absent."""
    if any(k.startswith(f"{tower}.embeddings.") for k in tensors):
        return f"{tower}."
    if any(k.startswith("embeddings.") for k in tensors):
        return ""
    return None
