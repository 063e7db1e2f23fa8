"""Hugging Face transformers CLIP checkpoints ↔ vitmm ``TwoTowers`` / ``ViT`` / ``TextTransformer``.

    kwargs, params = hf.load_clip("path/to/clip")          # CLIPModel folder or file
    model = TwoTowers(**kwargs)
    zimg, ztxt, out = model.apply({"params": params}, images_nhwc, ids)

    kwargs, params = hf.load_clip_vision("path/to/clip")   # a ViT (CLIPModel or CLIPVisionModel)
    tensors, config = hf.export_clip_vision(kwargs, params)  # back to CLIPVisionModel's layout

Correspondence (checked to 1e-4 against transformers in ``tests/interop``):

* HF ``last_hidden_state`` of the vision tower is the last block's output *before*
  ``post_layernorm`` = vitmm ``out["block_{depth-1:02d}"]``; ``hidden_states[-2]`` (LLaVA's
  feature layer) = ``out["block_{depth-2:02d}"]``; ``pooler_output`` = ``post_layernorm`` of
  the CLS token = vitmm's pooled output (``pool="tok"``, the final norm being ``post_layernorm``).
* HF ``text_model`` ``last_hidden_state`` is after ``final_layer_norm`` = vitmm ``encoded``;
  ``pooler_output`` is the EOS token (first ``eos_token_id``, or ``argmax(ids)`` for legacy configs
  with ``eos_token_id == 2``) = vitmm ``pool="eot"`` with ``eos_id``.
* ``image_embeds``/``text_embeds`` are the projections L2-normalised = vitmm's ``zimg``/``ztxt``;
  ``logit_scale`` is vitmm's ``t`` (log temperature). HF ``CLIPModel`` outputs put those
  projected embeddings, not the towers' poolers, under ``image_embeds``/``text_embeds``; the
  poolers are in ``vision_model_output``/``text_model_output``.
* q/k/v projections are fused into one ``qkv`` kernel (q|k|v, head, head_dim), PyTorch linear
  weights ``[out, in]`` become ``[in, out]``, the patch conv ``[D, C, ph, pw]`` becomes
  ``[ph, pw, C, D]``, the flat position table ``[1 + h·w, D]`` splits into the CLS position and
  the grid ``[1, h, w, D]``.
"""

from __future__ import annotations

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np

from vitmm.interop import io
from vitmm.interop.common import (
    StateDict,
    conv_kernel,
    finish,
    grid_table,
    linear,
    norm,
    pick_tower,
    resize,
    text_only,
    vision_only,
)

ACTIVATIONS = {"quick_gelu": "quick_gelu", "gelu": "gelu", "gelu_new": "gelu_tanh",
               "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu", "silu": "silu"}
# transformers' CLIP defaults, for keys a saved config.json omits.
VISION_DEFAULTS = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                       num_channels=3, image_size=224, patch_size=32, hidden_act="quick_gelu", layer_norm_eps=1e-5)
TEXT_DEFAULTS = dict(vocab_size=49408, hidden_size=512, intermediate_size=2048, num_hidden_layers=12,
                     num_attention_heads=8, max_position_embeddings=77, hidden_act="quick_gelu",
                     layer_norm_eps=1e-5, eos_token_id=49407)


def _activation(name: str) -> str:
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


def _name(sd: StateDict, block: str, role: str) -> str:
    for alias in ALIASES[role]:
        if sd.has(f"{block}.{alias}.weight"):
            return f"{block}.{alias}"
    return f"{block}.{ALIASES[role][0]}"  # reported as missing


def _block(sd: StateDict, block: str) -> dict:
    q, k, v = (linear(sd, _name(sd, block, n)) for n in "qkv")
    out = {
        "norm1": norm(sd, _name(sd, block, "norm1")),
        "attn": {"qkv": {"kernel": np.concatenate([q["kernel"], k["kernel"], v["kernel"]], axis=1),
                         "bias": np.concatenate([q["bias"], k["bias"], v["bias"]])},
                 "out": linear(sd, _name(sd, block, "o"))},
        "norm2": norm(sd, _name(sd, block, "norm2")),
        "mlp": {"fc1": linear(sd, _name(sd, block, "fc1")), "fc2": linear(sd, _name(sd, block, "fc2"))},
    }
    if sd.has(f"{block}.layer_scale1.lambda1"):  # Dinov2's LayerScale
        out["ls1"] = sd.take(f"{block}.layer_scale1.lambda1")
        out["ls2"] = sd.take(f"{block}.layer_scale2.lambda1")
    return out


def _encoder(sd: StateDict, blocks: str, depth: int, final_norm: str) -> dict:
    """``blocks``: the blocks' prefix up to the index (e.g. ``vision_model.encoder.layers``)."""
    enc = {f"block_{i:02d}": _block(sd, f"{blocks}.{i}") for i in range(depth)}
    enc["encoder_norm"] = norm(sd, final_norm)
    return enc


def _depth(tensors: dict, blocks: str) -> int:
    layers = {int(m.group(1)) for k in tensors if (m := re.match(re.escape(blocks) + r"\.(\d+)\.", k))}
    return max(layers) + 1 if layers else 0


def _prefix(tensors: dict, tower: str) -> str | None:
    """``"vision_model"`` (hub and CLIPModel layout), ``""`` (a standalone CLIPVisionModel saved by
    transformers 5.x) or None when the tower is absent."""
    if any(k.startswith(f"{tower}.embeddings.") for k in tensors):
        return f"{tower}."
    if any(k.startswith("embeddings.") for k in tensors):
        return ""
    return None


def _vision_config(config: dict) -> dict:
    v = config.get("vision_config", config if config.get("model_type") == "clip_vision_model" else {})
    return {**VISION_DEFAULTS, **{k: x for k, x in v.items() if x is not None}}


def _text_config(config: dict) -> dict:
    t = config.get("text_config", config if config.get("model_type") == "clip_text_model" else {})
    return {**TEXT_DEFAULTS, **{k: x for k, x in t.items() if x is not None}}


def vision_kwargs(config: dict, tensors: dict, prefix: str) -> dict:
    """``ViT`` keyword arguments of a CLIP vision tower (shapes checked against the config)."""
    v = _vision_config(config)
    patch = tensors[f"{prefix}embeddings.patch_embedding.weight"]
    width, channels, ph, pw = patch.shape
    depth = _depth(tensors, f"{prefix}encoder.layers")
    mlp = tensors[f"{prefix}encoder.layers.0.mlp.fc1.weight"].shape[0]
    found = dict(hidden_size=width, num_channels=channels, patch_size=ph, num_hidden_layers=depth,
                 intermediate_size=mlp)
    wrong = {k: (v[k], x) for k, x in found.items() if v[k] != x}
    if wrong or ph != pw:
        raise ValueError(f"config.json and the weights disagree (config, weights): {wrong or {'patch': (ph, pw)}}.")
    return dict(width=width, depth=depth, mlp_dim=mlp, num_heads=v["num_attention_heads"], patch_size=ph,
                class_token=True, pre_norm=True, posemb="learn", posemb_layout="with_cls", pool="tok",
                posemb_resample="torch_bicubic",
                act=_activation(v["hidden_act"]), norm_eps=float(v["layer_norm_eps"]), embed_bias=False)


def text_kwargs(config: dict, tensors: dict, prefix: str) -> dict:
    """``TextTransformer`` keyword arguments of a CLIP text tower."""
    t = _text_config(config)
    vocab, width = tensors[f"{prefix}embeddings.token_embedding.weight"].shape
    max_len = tensors[f"{prefix}embeddings.position_embedding.weight"].shape[0]
    depth = _depth(tensors, f"{prefix}encoder.layers")
    mlp = tensors[f"{prefix}encoder.layers.0.mlp.fc1.weight"].shape[0]
    found = dict(vocab_size=vocab, hidden_size=width, max_position_embeddings=max_len, num_hidden_layers=depth,
                 intermediate_size=mlp)
    wrong = {k: (t[k], x) for k, x in found.items() if t[k] != x}
    if wrong:
        raise ValueError(f"config.json and the weights disagree (config, weights): {wrong}.")
    eos = t.get("eos_token_id")
    return dict(vocab_size=vocab, width=width, depth=depth, mlp_dim=mlp, num_heads=t["num_attention_heads"],
                max_len=max_len, causal=True, pool="eot", eos_id=None if eos in (None, 2) else int(eos),
                act=_activation(t["hidden_act"]), norm_eps=float(t["layer_norm_eps"]))


def vision_params(sd: StateDict, kw: dict, prefix: str) -> dict:
    patch = sd.take(f"{prefix}embeddings.patch_embedding.weight")
    pos = sd.take(f"{prefix}embeddings.position_embedding.weight")
    return {
        "cls": sd.take(f"{prefix}embeddings.class_embedding").reshape(1, 1, -1),
        "embedding": {"kernel": conv_kernel(patch)},
        "cls_pos_embedding": pos[None, :1],
        "pos_embedding": grid_table(pos[1:], f"{prefix}embeddings.position_embedding"),
        "pre_norm": norm(sd, f"{prefix}pre_layrnorm"),
        "encoder": _encoder(sd, f"{prefix}encoder.layers", kw["depth"], f"{prefix}post_layernorm"),
    }


def text_params(sd: StateDict, kw: dict, prefix: str) -> dict:
    return {
        "token_embedding": {"embedding": sd.take(f"{prefix}embeddings.token_embedding.weight")},
        "pos_embedding": sd.take(f"{prefix}embeddings.position_embedding.weight")[None],
        "encoder": _encoder(sd, f"{prefix}encoder.layers", kw["depth"], f"{prefix}final_layer_norm"),
    }


def load_clip(src: str | pathlib.Path, image_size: int | tuple[int, int] | None = None) -> tuple[dict, dict]:
    """``(TwoTowers kwargs, params)`` of a ``CLIPModel`` checkpoint (folder or weights file with
    ``config.json`` beside it). ``image_size`` resamples the position table to a new resolution."""
    from vitmm.models.two_towers import TwoTowers

    tensors, config = io.read_tensors(src), io.read_json(src)
    sd = StateDict(tensors, str(src))
    vp, tp = _prefix(tensors, "vision_model"), _prefix(tensors, "text_model")
    if vp != "vision_model." or tp != "text_model.":
        raise ValueError(f"{src} is not a CLIPModel checkpoint (needs vision_model.* and text_model.* weights); "
                         "use load_clip_vision or load_clip_text for a single tower.")
    image, text = vision_kwargs(config, tensors, vp), text_kwargs(config, tensors, tp)
    proj = tensors["visual_projection.weight"].shape[0]
    params = {"img": vision_params(sd, image, vp), "txt": text_params(sd, text, tp),
              "img_proj": linear(sd, "visual_projection", bias=False),
              "txt_proj": linear(sd, "text_projection", bias=False),
              "t": sd.take("logit_scale").reshape(1)}
    kwargs = dict(image=image, text=text, embed_dim=proj)
    res = image["patch_size"] * params["img"]["pos_embedding"].shape[1]
    model = TwoTowers(**kwargs)
    params = finish(sd, model, params, (jnp.zeros((1, res, res, 3)), jnp.zeros((1, text["max_len"]), jnp.int32)),
                     "a vitmm TwoTowers (CLIP)")
    if image_size is not None:
        params = {**params, "img": resize(params["img"], image, image_size)}
    return kwargs, params


def load_clip_vision(src: str | pathlib.Path, image_size: int | tuple[int, int] | None = None) -> tuple[dict, dict]:
    """``(ViT kwargs, params)`` of a CLIP vision tower: a ``CLIPVisionModel`` (with or without
    the ``vision_model.`` prefix) or the vision half of a ``CLIPModel``."""
    from vitmm.models.vit import ViT

    tensors, config = io.read_tensors(src), io.read_json(src)
    prefix = _prefix(tensors, "vision_model")
    if prefix is None:
        raise ValueError(f"{src} holds no CLIP vision tower (no vision_model.embeddings.* or embeddings.* weights).")
    # Only the tower's own weights count; a CLIPModel's text tower and heads are left alone.
    own = {k: v for k, v in tensors.items() if k.startswith(prefix) and (prefix or not k.startswith("text_"))}
    own = {k: v for k, v in own.items() if not k.startswith(("visual_projection", "text_projection", "logit_scale"))}
    sd = StateDict(own, str(src))
    kwargs = vision_kwargs(config, tensors, prefix)
    params = vision_params(sd, kwargs, prefix)
    res = kwargs["patch_size"] * params["pos_embedding"].shape[1]
    params = finish(sd, ViT(**kwargs), params, (jnp.zeros((1, res, res, 3)),), "a vitmm ViT (CLIP vision)")
    if image_size is not None:
        params = resize(params, kwargs, image_size)
    return kwargs, params


def load_clip_text(src: str | pathlib.Path) -> tuple[dict, dict]:
    """``(TextTransformer kwargs, params)`` of a CLIP text tower (``CLIPTextModel`` or ``CLIPModel``)."""
    from vitmm.models.text import TextTransformer

    tensors, config = io.read_tensors(src), io.read_json(src)
    prefix = "text_model." if any(k.startswith("text_model.") for k in tensors) else ""
    own = {k: v for k, v in tensors.items() if k.startswith(prefix) and not k.startswith("vision_model.")
           and not k.startswith(("visual_projection", "text_projection", "logit_scale"))}
    sd = StateDict(own, str(src))
    kwargs = text_kwargs(config, tensors, prefix)
    params = text_params(sd, kwargs, prefix)
    params = finish(sd, TextTransformer(**kwargs), params, (jnp.zeros((1, kwargs["max_len"]), jnp.int32),),
                     "a vitmm TextTransformer (CLIP text)")
    return kwargs, params


def _map_head(sd: StateDict, prefix: str, width: int) -> dict:
    """torch ``nn.MultiheadAttention`` (packed ``in_proj``) pooling head → vitmm ``MAPHead``."""
    w, b = sd.take(f"{prefix}.attention.in_proj_weight"), sd.take(f"{prefix}.attention.in_proj_bias")
    return {
        "probe": sd.take(f"{prefix}.probe"),
        "attn": {"q": {"kernel": w[:width].T, "bias": b[:width]},
                 "kv": {"kernel": w[width:].T, "bias": b[width:]},
                 "out": linear(sd, f"{prefix}.attention.out_proj")},
        "norm": norm(sd, f"{prefix}.layernorm"),
        "mlp": {"fc1": linear(sd, f"{prefix}.mlp.fc1"), "fc2": linear(sd, f"{prefix}.mlp.fc2")},
    }


def _siglip_vision(sd: StateDict, config: dict, tensors: dict, prefix: str) -> tuple[dict, dict]:
    v = {**VISION_DEFAULTS, "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6,
         **config.get("vision_config", config if config.get("model_type") == "siglip_vision_model" else {})}
    width, channels, ph, pw = tensors[f"{prefix}embeddings.patch_embedding.weight"].shape
    depth = _depth(tensors, f"{prefix}encoder.layers")
    pos = sd.take(f"{prefix}embeddings.position_embedding.weight")
    head = f"{prefix}head.probe" in tensors
    kwargs = dict(width=width, depth=depth, mlp_dim=tensors[f"{prefix}encoder.layers.0.mlp.fc1.weight"].shape[0],
                  num_heads=v["num_attention_heads"], patch_size=ph, class_token=False, posemb="learn",
                  posemb_resample="torch_bicubic",
                  pool="map" if head else "gap", act=_activation(v["hidden_act"]),
                  norm_eps=float(v["layer_norm_eps"]))
    params = {
        "embedding": {"kernel": conv_kernel(sd.take(f"{prefix}embeddings.patch_embedding.weight")),
                      "bias": sd.take(f"{prefix}embeddings.patch_embedding.bias")},
        "pos_embedding": grid_table(pos, f"{prefix}embeddings.position_embedding"),
        "encoder": _encoder(sd, f"{prefix}encoder.layers", depth, f"{prefix}post_layernorm"),
    }
    if head:
        params["map_head"] = _map_head(sd, f"{prefix}head", width)
    return kwargs, params


def load_siglip(src: str | pathlib.Path, image_size: int | tuple[int, int] | None = None) -> tuple[dict, dict]:
    """``(TwoTowers kwargs, params)`` of a transformers ``SiglipModel``.

    As in the original: the image embedding is the MAP head's output (no projection), the text
    embedding is a linear head with bias on the last token (sticky-EOS padding puts EOS there),
    ``logit_scale``/``logit_bias`` are vitmm's ``t``/``b``. Both towers use ``gelu_tanh``.
    """
    from vitmm.models.two_towers import TwoTowers

    tensors, config = io.read_tensors(src), io.read_json(src)
    if config.get("model_type") != "siglip":
        raise ValueError(f"{src}: model_type {config.get('model_type')!r} is not 'siglip'.")
    sd = StateDict(tensors, str(src))
    image, img = _siglip_vision(sd, config, tensors, "vision_model.")
    t = {**TEXT_DEFAULTS, "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6, **config.get("text_config", {})}
    vocab, width = tensors["text_model.embeddings.token_embedding.weight"].shape
    depth = _depth(tensors, "text_model.encoder.layers")
    text = dict(vocab_size=vocab, width=width, depth=depth,
                mlp_dim=tensors["text_model.encoder.layers.0.mlp.fc1.weight"].shape[0],
                num_heads=t["num_attention_heads"],
                max_len=tensors["text_model.embeddings.position_embedding.weight"].shape[0], causal=False,
                pool="last", act=_activation(t["hidden_act"]), norm_eps=float(t["layer_norm_eps"]))
    embed_dim = tensors["text_model.head.weight"].shape[0]
    if embed_dim != image["width"]:
        raise ValueError(f"The text head maps to {embed_dim} but the image embedding has {image['width']} dims.")
    params = {
        "img": img,
        "txt": {"token_embedding": {"embedding": sd.take("text_model.embeddings.token_embedding.weight")},
                "pos_embedding": sd.take("text_model.embeddings.position_embedding.weight")[None],
                "encoder": _encoder(sd, "text_model.encoder.layers", depth, "text_model.final_layer_norm")},
        "txt_proj": linear(sd, "text_model.head"),
        "t": sd.take("logit_scale").reshape(1),
        "b": sd.take("logit_bias").reshape(1),
    }
    kwargs = dict(image=image, text=text, embed_dim=embed_dim, image_proj=False, text_proj_bias=True,
                  temperature_init=10.0, bias_init=-10.0)
    res = image["patch_size"] * img["pos_embedding"].shape[1]
    example = (jnp.zeros((1, res, res, 3)), jnp.zeros((1, text["max_len"]), jnp.int32))
    params = finish(sd, TwoTowers(**kwargs), params, example, "a vitmm TwoTowers (SigLIP)")
    if image_size is not None:
        params = {**params, "img": resize(params["img"], image, image_size)}
    return kwargs, params


def load_siglip_vision(src: str | pathlib.Path, image_size: int | tuple[int, int] | None = None) -> tuple[dict, dict]:
    """``(ViT kwargs, params)`` of a SigLIP vision tower (``SiglipVisionModel`` with or without
    the ``vision_model.`` prefix, or the vision half of a ``SiglipModel``)."""
    from vitmm.models.vit import ViT

    tensors, config = io.read_tensors(src), io.read_json(src)
    prefix = _prefix(tensors, "vision_model")
    if prefix is None:
        raise ValueError(f"{src} holds no SigLIP vision tower.")
    own = {k: v for k, v in tensors.items() if k.startswith(prefix) and not k.startswith("text_model.")
           and k not in ("logit_scale", "logit_bias")}
    sd = StateDict(own, str(src))
    kwargs, params = _siglip_vision(sd, config, own, prefix)
    res = kwargs["patch_size"] * params["pos_embedding"].shape[1]
    params = finish(sd, ViT(**kwargs), params, (jnp.zeros((1, res, res, 3)),), "a vitmm ViT (SigLIP vision)")
    if image_size is not None:
        params = resize(params, kwargs, image_size)
    return kwargs, params


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
    depth = _depth(tensors, blocks)
    fc1 = _name(sd, f"{blocks}.0", "fc1") + ".weight"
    if fc1 not in tensors:
        raise ValueError(f"{src}: no MLP weights at {fc1}; SwiGLU FFNs (Dinov2 giant) are not supported.")
    registers = tensors["embeddings.register_tokens"].shape[1] if "embeddings.register_tokens" in tensors else 0
    kwargs = dict(width=width, depth=depth, mlp_dim=tensors[fc1].shape[0], num_heads=config["num_attention_heads"],
                  patch_size=(ph, pw) if ph != pw else ph, class_token=True, num_registers=registers,
                  posemb="learn", posemb_layout="with_cls", pool="tok", posemb_resample=RESAMPLE[kind],
                  act=_activation(config.get("hidden_act", "gelu")),
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
        "encoder": _encoder(sd, blocks, depth, "layernorm"),
    }
    if registers:
        params["registers"] = sd.take("embeddings.register_tokens")
    side = params["pos_embedding"].shape[1]
    res = (side * ph, side * pw)
    params = finish(sd, ViT(**kwargs), params, (jnp.zeros((1, *res, channels)),), f"a vitmm ViT ({kind})")
    if image_size is not None:
        params = resize(params, kwargs, image_size)
    return kwargs, params


def export_clip_vision(kwargs: dict, params: dict, prefix: str = "vision_model.") -> tuple[dict, dict]:
    """``(tensors, config)`` in transformers' ``CLIPVisionModel`` layout (``prefix`` as hub
    checkpoints carry it), for ``io.write_safetensors`` and a ``config.json``."""
    p = jax.tree.map(np.asarray, params)
    width, heads = kwargs["width"], kwargs["num_heads"]
    grid = p["pos_embedding"].shape[1:3]
    if grid[0] != grid[1]:
        raise ValueError(f"transformers' CLIP needs a square position grid, got {grid}.")
    out = {
        f"{prefix}embeddings.class_embedding": p["cls"].reshape(-1),
        f"{prefix}embeddings.patch_embedding.weight": p["embedding"]["kernel"].transpose(3, 2, 0, 1),
        f"{prefix}embeddings.position_embedding.weight": np.concatenate(
            [p["cls_pos_embedding"].reshape(1, width), p["pos_embedding"].reshape(-1, width)]),
        f"{prefix}pre_layrnorm.weight": p["pre_norm"]["scale"], f"{prefix}pre_layrnorm.bias": p["pre_norm"]["bias"],
        f"{prefix}post_layernorm.weight": p["encoder"]["encoder_norm"]["scale"],
        f"{prefix}post_layernorm.bias": p["encoder"]["encoder_norm"]["bias"],
    }
    for i in range(kwargs["depth"]):
        b, q = p["encoder"][f"block_{i:02d}"], f"{prefix}encoder.layers.{i}"
        kernel, bias = b["attn"]["qkv"]["kernel"], b["attn"]["qkv"]["bias"]
        for j, name in enumerate("qkv"):
            out[f"{q}.self_attn.{name}_proj.weight"] = kernel[:, j * width:(j + 1) * width].T
            out[f"{q}.self_attn.{name}_proj.bias"] = bias[j * width:(j + 1) * width]
        out[f"{q}.self_attn.out_proj.weight"] = b["attn"]["out"]["kernel"].T
        out[f"{q}.self_attn.out_proj.bias"] = b["attn"]["out"]["bias"]
        for n in (1, 2):
            out[f"{q}.layer_norm{n}.weight"] = b[f"norm{n}"]["scale"]
            out[f"{q}.layer_norm{n}.bias"] = b[f"norm{n}"]["bias"]
            out[f"{q}.mlp.fc{n}.weight"] = b["mlp"][f"fc{n}"]["kernel"].T
            out[f"{q}.mlp.fc{n}.bias"] = b["mlp"][f"fc{n}"]["bias"]
    act = {v: k for k, v in ACTIVATIONS.items() if k not in ("gelu_new",)}[kwargs.get("act", "quick_gelu")]
    config = {"model_type": "clip_vision_model", "architectures": ["CLIPVisionModel"], "hidden_size": width,
              "intermediate_size": kwargs["mlp_dim"], "num_hidden_layers": kwargs["depth"],
              "num_attention_heads": heads, "num_channels": p["embedding"]["kernel"].shape[2],
              "image_size": grid[0] * kwargs["patch_size"], "patch_size": kwargs["patch_size"],
              "hidden_act": act, "layer_norm_eps": kwargs.get("norm_eps", 1e-5)}
    return {k: np.ascontiguousarray(v, np.float32) for k, v in out.items()}, config


def load(src: str | pathlib.Path, *, tower: str = "both",
         image_size: int | tuple[int, int] | None = None) -> tuple[dict, dict]:
    """``(TwoTowers kwargs, params)`` of any transformers folder vitmm reads, by its
    ``model_type``: CLIP (``tower`` both, vision or text), SigLIP (both or vision), ViT/DINOv2
    backbones (vision)."""
    kind = io.read_json(src).get("model_type")
    if kind in VIT_TYPES:  # an image backbone: one tower
        return pick_tower(*vision_only(*load_vit(src, image_size=image_size)), tower, src)
    if kind in ("siglip", "siglip_vision_model"):
        if tower == "text":
            raise ValueError("A SigLIP text tower alone is not supported; convert both towers (tower='both').")
        if tower == "both" and kind == "siglip":
            return load_siglip(src, image_size=image_size)
        return vision_only(*load_siglip_vision(src, image_size=image_size))
    if tower == "both":
        return load_clip(src, image_size=image_size)
    if tower == "vision":
        return vision_only(*load_clip_vision(src, image_size=image_size))
    return pick_tower(*text_only(*load_clip_text(src)), tower, src)
