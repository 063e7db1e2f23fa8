"""Hugging Face transformers ViT and DINOv2 backbones (``ViTModel``, ``Dinov2Model``,
``Dinov2WithRegistersModel``) → vitmm ``ViT``."""

from __future__ import annotations

import pathlib
import re

import jax.numpy as jnp

from vitmm.interop import io
from vitmm.interop.common import (
    StateDict,
    conv_kernel,
    finish,
    grid_table,
    resize,
)
from vitmm.interop.hf.layers import encoder_params, hf_activation, key_name, layer_count

# Backbone loaders skip what is not the backbone: ViTModel's tanh pooler, the masked-modelling
# mask token and an image-classification head (documented in load_vit).
BACKBONE_SKIP = re.compile(r"^(pooler\..*|embeddings\.mask_token|classifier\..*)$")
VIT_TYPES = {"vit": 1e-12, "dinov2": 1e-6, "dinov2_with_registers": 1e-6}
# Each model's interpolate_pos_encoding: F.interpolate bicubic, with antialias=True only for
# DINOv2 with registers (transformers 5.24).
RESAMPLE = {"vit": "torch_bicubic", "dinov2": "torch_bicubic", "dinov2_with_registers": "bicubic_aa"}


def load_vit(src: str | pathlib.Path, image_size: int | tuple[int, int] | None = None) -> tuple[dict, dict]:
    """``(ViT kwargs, params)`` of a transformers ``ViTModel``, ``Dinov2Model`` or
    ``Dinov2WithRegistersModel`` (also their ``*ForImageClassification`` backbones), in the
    transformers 5.x key layout or the legacy hub one.

    HF ``last_hidden_state`` (after the final LayerNorm) = vitmm ``out["encoded"]``; Dinov2's
    ``pooler_output`` (normed CLS) = vitmm's pooled output. Not loaded: ViTModel's ``pooler``
    (a tanh dense layer on CLS, which only ``ViTModel(add_pooling_layer=True)`` uses), the
    ``mask_token`` of masked pretraining and any classification head. Dinov2's registers take no
    position, as in vitmm. ``image_size`` resamples the position grid once (Dinov2 checkpoints
    are trained at 518 px; transformers re-interpolates on every call instead).
    """
    from vitmm.models.vit import ViT

    tensors, config = io.read_tensors(src), io.read_json(src)
    kind = config.get("model_type")
    if kind not in VIT_TYPES:
        raise ValueError(f"{src}: model_type {kind!r} is not one of {sorted(VIT_TYPES)}; for CLIP use load_clip.")
    for head in ("vit.", "dinov2.", "dinov2_with_registers."):
        if any(k.startswith(head) for k in tensors):
            tensors = {k[len(head):] if k.startswith(head) else k: v for k, v in tensors.items()}
    tensors = {k: v for k, v in tensors.items() if not BACKBONE_SKIP.match(k)}
    blocks = "layers" if any(k.startswith("layers.") for k in tensors) else "encoder.layer"
    sd = StateDict(tensors, str(src))
    patch = tensors["embeddings.patch_embeddings.projection.weight"]
    width, channels, ph, pw = patch.shape
    depth = layer_count(tensors, blocks)
    fc1 = key_name(sd, f"{blocks}.0", "fc1") + ".weight"
    if fc1 not in tensors:
        raise ValueError(f"{src}: no MLP weights at {fc1}; SwiGLU FFNs (Dinov2 giant) are not supported.")
    registers = tensors["embeddings.register_tokens"].shape[1] if "embeddings.register_tokens" in tensors else 0
    kwargs = dict(width=width, depth=depth, mlp_dim=tensors[fc1].shape[0], num_heads=config["num_attention_heads"],
                  patch_size=(ph, pw) if ph != pw else ph, class_token=True, num_registers=registers,
                  posemb="learn", posemb_layout="with_cls", pool="tok", posemb_resample=RESAMPLE[kind],
                  act=hf_activation(config.get("hidden_act", "gelu")),
                  norm_eps=float(config.get("layer_norm_eps", VIT_TYPES[kind])),
                  layerscale=1.0 if f"{blocks}.0.layer_scale1.lambda1" in tensors else None)
    if kwargs["num_heads"] and width % kwargs["num_heads"]:
        raise ValueError(f"width {width} is not divisible by num_attention_heads={kwargs['num_heads']}.")
    pos = sd.take("embeddings.position_embeddings")[0]
    params = {
        "cls": sd.take("embeddings.cls_token"),
        "cls_pos_embedding": pos[None, :1],
        "pos_embedding": grid_table(pos[1:], "embeddings.position_embeddings"),
        "embedding": {"kernel": conv_kernel(sd.take("embeddings.patch_embeddings.projection.weight")),
                      "bias": sd.take("embeddings.patch_embeddings.projection.bias")},
        "encoder": encoder_params(sd, blocks, depth, "layernorm"),
    }
    if registers:
        params["registers"] = sd.take("embeddings.register_tokens")
    side = params["pos_embedding"].shape[1]
    res = (side * ph, side * pw)
    params = finish(sd, ViT(**kwargs), params, (jnp.zeros((1, *res, channels)),), f"a vitmm ViT ({kind})")
    if image_size is not None:
        params = resize(params, kwargs, image_size)
    return kwargs, params
