"""Hugging Face transformers CLIP and SigLIP checkpoints ↔ vitmm ``TwoTowers`` / ``ViT`` / ``TextTransformer``.

    kwargs, params = hf.load_clip("path/to/clip")          # CLIPModel folder or file
    model = TwoTowers(**kwargs)
    zimg, ztxt, out = model.apply({"params": params}, images_nhwc, ids)

    kwargs, params = hf.load_clip_vision("path/to/clip")   # a ViT (CLIPModel or CLIPVisionModel)
    tensors, config = hf.export_clip_vision(kwargs, params)  # back to CLIPVisionModel's layout (clip_export)

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

import jax.numpy as jnp

from vitmm.interop import io
from vitmm.interop.common import (
    StateDict,
    conv_kernel,
    finish,
    grid_table,
    linear,
    norm,
    resize,
)
from vitmm.interop.hf.layers import encoder_params, hf_activation, layer_count, tower_prefix

# transformers' CLIP defaults, for keys a saved config.json omits.
VISION_DEFAULTS = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                       num_channels=3, image_size=224, patch_size=32, hidden_act="quick_gelu", layer_norm_eps=1e-5)
TEXT_DEFAULTS = dict(vocab_size=49408, hidden_size=512, intermediate_size=2048, num_hidden_layers=12,
                     num_attention_heads=8, max_position_embeddings=77, hidden_act="quick_gelu",
                     layer_norm_eps=1e-5, eos_token_id=49407)


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
    depth = layer_count(tensors, f"{prefix}encoder.layers")
    mlp = tensors[f"{prefix}encoder.layers.0.mlp.fc1.weight"].shape[0]
    found = dict(hidden_size=width, num_channels=channels, patch_size=ph, num_hidden_layers=depth,
                 intermediate_size=mlp)
    wrong = {k: (v[k], x) for k, x in found.items() if v[k] != x}
    if wrong or ph != pw:
        raise ValueError(f"config.json and the weights disagree (config, weights): {wrong or {'patch': (ph, pw)}}.")
    return dict(width=width, depth=depth, mlp_dim=mlp, num_heads=v["num_attention_heads"], patch_size=ph,
                class_token=True, pre_norm=True, posemb="learn", posemb_layout="with_cls", pool="tok",
                posemb_resample="torch_bicubic",
                act=hf_activation(v["hidden_act"]), norm_eps=float(v["layer_norm_eps"]), embed_bias=False)


def text_kwargs(config: dict, tensors: dict, prefix: str) -> dict:
    """``TextTransformer`` keyword arguments of a CLIP text tower."""
    t = _text_config(config)
    vocab, width = tensors[f"{prefix}embeddings.token_embedding.weight"].shape
    max_len = tensors[f"{prefix}embeddings.position_embedding.weight"].shape[0]
    depth = layer_count(tensors, f"{prefix}encoder.layers")
    mlp = tensors[f"{prefix}encoder.layers.0.mlp.fc1.weight"].shape[0]
    found = dict(vocab_size=vocab, hidden_size=width, max_position_embeddings=max_len, num_hidden_layers=depth,
                 intermediate_size=mlp)
    wrong = {k: (t[k], x) for k, x in found.items() if t[k] != x}
    if wrong:
        raise ValueError(f"config.json and the weights disagree (config, weights): {wrong}.")
    eos = t.get("eos_token_id")
    return dict(vocab_size=vocab, width=width, depth=depth, mlp_dim=mlp, num_heads=t["num_attention_heads"],
                max_len=max_len, causal=True, pool="eot", eos_id=None if eos in (None, 2) else int(eos),
                act=hf_activation(t["hidden_act"]), norm_eps=float(t["layer_norm_eps"]))


def vision_params(sd: StateDict, kw: dict, prefix: str) -> dict:
    patch = sd.take(f"{prefix}embeddings.patch_embedding.weight")
    pos = sd.take(f"{prefix}embeddings.position_embedding.weight")
    return {
        "cls": sd.take(f"{prefix}embeddings.class_embedding").reshape(1, 1, -1),
        "embedding": {"kernel": conv_kernel(patch)},
        "cls_pos_embedding": pos[None, :1],
        "pos_embedding": grid_table(pos[1:], f"{prefix}embeddings.position_embedding"),
        "pre_norm": norm(sd, f"{prefix}pre_layrnorm"),
        "encoder": encoder_params(sd, f"{prefix}encoder.layers", kw["depth"], f"{prefix}post_layernorm"),
    }


def text_params(sd: StateDict, kw: dict, prefix: str) -> dict:
    return {
        "token_embedding": {"embedding": sd.take(f"{prefix}embeddings.token_embedding.weight")},
        "pos_embedding": sd.take(f"{prefix}embeddings.position_embedding.weight")[None],
        "encoder": encoder_params(sd, f"{prefix}encoder.layers", kw["depth"], f"{prefix}final_layer_norm"),
    }


def load_clip(src: str | pathlib.Path, image_size: int | tuple[int, int] | None = None) -> tuple[dict, dict]:
    """``(TwoTowers kwargs, params)`` of a ``CLIPModel`` checkpoint (folder or weights file with
    ``config.json`` beside it). ``image_size`` resamples the position table to a new resolution."""
    from vitmm.models.two_towers import TwoTowers

    tensors, config = io.read_tensors(src), io.read_json(src)
    sd = StateDict(tensors, str(src))
    vp, tp = tower_prefix(tensors, "vision_model"), tower_prefix(tensors, "text_model")
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
    prefix = tower_prefix(tensors, "vision_model")
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
    if f"{prefix}embeddings.token_embedding.weight" not in tensors:
        raise ValueError(f"{src} holds no CLIP text tower (a CLIPTextModel's or CLIPModel's); for its vision tower "
                         "pass --tower vision.")
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


# SigLIP's and Idefics3's vision configs: their own defaults for what a saved config leaves out.
SIGLIP_DEFAULTS = {
    "siglip_vision_model": dict(VISION_DEFAULTS, patch_size=16, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6),
    "idefics3_vision": dict(VISION_DEFAULTS, hidden_size=1152, num_attention_heads=16, hidden_act="gelu_pytorch_tanh",
                            layer_norm_eps=1e-6),
}


def _siglip_vision(sd: StateDict, config: dict, tensors: dict, prefix: str) -> tuple[dict, dict]:
    v = config.get("vision_config", config if config.get("model_type") == "siglip_vision_model" else {})
    v = {**SIGLIP_DEFAULTS.get(v.get("model_type"), SIGLIP_DEFAULTS["siglip_vision_model"]), **v}
    width, channels, ph, pw = tensors[f"{prefix}embeddings.patch_embedding.weight"].shape
    depth = layer_count(tensors, f"{prefix}encoder.layers")
    pos = sd.take(f"{prefix}embeddings.position_embedding.weight")
    head = f"{prefix}head.probe" in tensors
    kwargs = dict(width=width, depth=depth, mlp_dim=tensors[f"{prefix}encoder.layers.0.mlp.fc1.weight"].shape[0],
                  num_heads=v["num_attention_heads"], patch_size=ph, class_token=False, posemb="learn",
                  posemb_resample="torch_bicubic",
                  pool="map" if head else "gap", act=hf_activation(v["hidden_act"]),
                  norm_eps=float(v["layer_norm_eps"]))
    params = {
        "embedding": {"kernel": conv_kernel(sd.take(f"{prefix}embeddings.patch_embedding.weight")),
                      "bias": sd.take(f"{prefix}embeddings.patch_embedding.bias")},
        "pos_embedding": grid_table(pos, f"{prefix}embeddings.position_embedding"),
        "encoder": encoder_params(sd, f"{prefix}encoder.layers", depth, f"{prefix}post_layernorm"),
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
    depth = layer_count(tensors, "text_model.encoder.layers")
    text = dict(vocab_size=vocab, width=width, depth=depth,
                mlp_dim=tensors["text_model.encoder.layers.0.mlp.fc1.weight"].shape[0],
                num_heads=t["num_attention_heads"],
                max_len=tensors["text_model.embeddings.position_embedding.weight"].shape[0], causal=False,
                pool="last", act=hf_activation(t["hidden_act"]), norm_eps=float(t["layer_norm_eps"]))
    embed_dim = tensors["text_model.head.weight"].shape[0]
    if embed_dim != image["width"]:
        raise ValueError(f"The text head maps to {embed_dim} but the image embedding has {image['width']} dims.")
    params = {
        "img": img,
        "txt": {"token_embedding": {"embedding": sd.take("text_model.embeddings.token_embedding.weight")},
                "pos_embedding": sd.take("text_model.embeddings.position_embedding.weight")[None],
                "encoder": encoder_params(sd, "text_model.encoder.layers", depth, "text_model.final_layer_norm")},
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
    prefix = tower_prefix(tensors, "vision_model")
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
