"""vitmm towers back to transformers' CLIP and SigLIP vision layouts (the inverse of ``clip``'s
loaders): what a layout cannot hold (``tower_problems``), and the tensors and ``config.json``
(``export_clip_vision``, ``export_siglip_vision``), with the tower's own settings, vitmm's
defaults filled in, never transformers' (``vision_settings``)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from vitmm.interop.hf.layers import ACTIVATIONS

HF_ACTIVATION = {v: k for k, v in ACTIVATIONS.items() if k not in ("gelu_new",)}  # vitmm's name → transformers'


def vision_settings(kwargs: dict) -> dict:
    """Every setting the tower ``ViT(**kwargs)`` runs with: its variant and defaults filled in (a
    run's config names only what it changes, and transformers' defaults are not vitmm's)."""
    from vitmm.models.vit import ViT

    vit = ViT(**kwargs)
    arch = vit.arch()
    settings = {f.name: getattr(vit, f.name) for f in dataclasses.fields(ViT) if f.name not in ("parent", "name")}
    return {**settings, "width": arch.width, "depth": arch.depth, "mlp_dim": arch.mlp_dim,
            "num_heads": arch.num_heads, "patch_size": arch.patch_size}


def vision_layout_problems(kwargs: dict, siglip: bool) -> list[str]:
    """Why transformers' CLIP (``siglip``: SigLIP) vision layout cannot hold the tower
    ``ViT(**kwargs)`` (empty: it can). Its head is not exported, nor needed."""
    from vitmm.models.patch_embed import to_pair

    s = vision_settings(kwargs)
    wants = {"class_token": False, "posemb": "learn", "pre_norm": False} if siglip else \
        {"class_token": True, "posemb": "learn", "posemb_layout": "with_cls", "pre_norm": True}
    wants |= {"stem": "patch", "stem_norm": False, "num_registers": 0, "layerscale": None, "qk_norm": False}
    wrong = [f"{k}={s[k]!r} (needs {v!r})" for k, v in wants.items() if s[k] != v]
    if s["act"] not in HF_ACTIVATION:
        wrong.append(f"act={s['act']!r} (transformers has {sorted(HF_ACTIVATION)})")
    if s["patch_size"][0] != s["patch_size"][1] or tuple(to_pair(s["stride"] or s["patch_size"])) != s["patch_size"] \
            or to_pair(s["padding"]) != (0, 0):
        wrong.append(f"patch {s['patch_size']} with stride {s['stride']} and padding {s['padding']} (needs square "
                     "patches, stride = patch, no padding)")
    return wrong


def tower_problems(kwargs: dict, tower: dict, siglip: bool, reads_final_norm: bool = True) -> list[str]:
    """``vision_layout_problems``, and the tower's parameters': a square position grid, no pooling
    head for SigLIP's layout (a VLM's tower: its tokens are what is exported), and a final norm when
    what the layout returns passes through it (``reads_final_norm``; LLaVA reads an earlier hidden
    state, so a tower without one gets an identity ``post_layernorm`` there)."""
    problems = [f"the tower: {p}" for p in vision_layout_problems(kwargs, siglip)]
    settings = vision_settings(kwargs)
    if reads_final_norm and not (settings["final_norm"] and not settings["fc_norm"]):
        problems.append("the tower: no final norm (final_norm=False or fc_norm=True; transformers' layout applies "
                        "post_layernorm to the output it returns)")
    grid = tower["pos_embedding"].shape[1:3] if "pos_embedding" in tower else None
    if grid is not None and grid[0] != grid[1]:
        problems.append(f"the tower: a {tuple(grid)} position grid (needs a square one)")
    if siglip and "map_head" in tower:
        problems.append("the tower: a pooling head (map_head)")
    return problems


def _layout_checked(kwargs: dict, siglip: bool) -> dict:
    problems = vision_layout_problems(kwargs, siglip)
    if problems:
        raise ValueError(f"transformers' {'SigLIP' if siglip else 'CLIP'} vision layout cannot hold this tower: "
                         + "; ".join(problems) + ".")
    s = vision_settings(kwargs)
    return {**s, "patch_size": s["patch_size"][0]}


def export_clip_vision(kwargs: dict, params: dict, prefix: str = "vision_model.") -> tuple[dict, dict]:
    """``(tensors, config)`` in transformers' ``CLIPVisionModel`` layout (``prefix`` as hub
    checkpoints carry it), for ``io.write_safetensors`` and a ``config.json``. CLIP's patch conv
    has no bias: a tower's bias (``embed_bias``, vitmm's default) is added to every patch's
    position instead, which gives the same tokens."""
    s = _layout_checked(kwargs, siglip=False)
    p = jax.tree.map(np.asarray, params)
    width, heads = s["width"], s["num_heads"]
    grid = p["pos_embedding"].shape[1:3]
    if grid[0] != grid[1]:
        raise ValueError(f"transformers' CLIP needs a square position grid, got {grid}.")
    patch_positions = p["pos_embedding"].reshape(-1, width) + (p["embedding"]["bias"] if s["embed_bias"] else 0.0)
    out = {
        f"{prefix}embeddings.class_embedding": p["cls"].reshape(-1),
        f"{prefix}embeddings.patch_embedding.weight": p["embedding"]["kernel"].transpose(3, 2, 0, 1),
        f"{prefix}embeddings.position_embedding.weight": np.concatenate(
            [p["cls_pos_embedding"].reshape(1, width), patch_positions]),
        f"{prefix}pre_layrnorm.weight": p["pre_norm"]["scale"], f"{prefix}pre_layrnorm.bias": p["pre_norm"]["bias"],
    }
    _export_encoder(p, s, prefix, out)
    config = {"model_type": "clip_vision_model", "architectures": ["CLIPVisionModel"], "hidden_size": width,
              "intermediate_size": s["mlp_dim"], "num_hidden_layers": s["depth"],
              "num_attention_heads": heads, "num_channels": p["embedding"]["kernel"].shape[2],
              "image_size": grid[0] * s["patch_size"], "patch_size": s["patch_size"],
              "hidden_act": HF_ACTIVATION[s["act"]], "layer_norm_eps": s["norm_eps"]}
    return {k: np.ascontiguousarray(v, np.float32) for k, v in out.items()}, config


def export_siglip_vision(kwargs: dict, params: dict, prefix: str = "vision_model.") -> tuple[dict, dict]:
    """``(tensors, config)`` in transformers' ``SiglipVisionModel`` layout without its pooling head
    (PaliGemma's tower): the inverse of ``_siglip_vision`` for a tower without a MAP head (a
    tower without a patch bias gets a zero one)."""
    s = _layout_checked(kwargs, siglip=True)
    p = jax.tree.map(np.asarray, params)
    width = s["width"]
    grid = p["pos_embedding"].shape[1:3]
    if grid[0] != grid[1] or "map_head" in p or "cls" in p:
        raise ValueError("transformers' SigLIP tower here needs a square grid, no class token and no pooling head.")
    bias = p["embedding"]["bias"] if s["embed_bias"] else np.zeros(width, np.float32)
    out = {f"{prefix}embeddings.patch_embedding.weight": p["embedding"]["kernel"].transpose(3, 2, 0, 1),
           f"{prefix}embeddings.patch_embedding.bias": bias,
           f"{prefix}embeddings.position_embedding.weight": p["pos_embedding"].reshape(-1, width)}
    _export_encoder(p, s, prefix, out)
    config = {"model_type": "siglip_vision_model", "hidden_size": width, "intermediate_size": s["mlp_dim"],
              "num_hidden_layers": s["depth"], "num_attention_heads": s["num_heads"],
              "num_channels": p["embedding"]["kernel"].shape[2], "image_size": grid[0] * s["patch_size"],
              "patch_size": s["patch_size"], "hidden_act": HF_ACTIVATION[s["act"]], "layer_norm_eps": s["norm_eps"],
              "vision_use_head": False}
    return {k: np.ascontiguousarray(v, np.float32) for k, v in out.items()}, config


def _export_encoder(p: dict, kwargs: dict, prefix: str, out: dict) -> None:
    """The encoder's blocks and final norm (``post_layernorm``) into ``out``, transformers' names; a
    tower without a final norm gets an identity one (for a reader that never applies it:
    ``tower_problems``' ``reads_final_norm``)."""
    width = kwargs["width"]
    identity = {"scale": np.ones(width, np.float32), "bias": np.zeros(width, np.float32)}
    norm = p["encoder"].get("encoder_norm") or identity
    out[f"{prefix}post_layernorm.weight"] = norm["scale"]
    out[f"{prefix}post_layernorm.bias"] = norm["bias"]
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
