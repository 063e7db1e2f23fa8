"""open_clip ``CLIP`` state dicts → vitmm ``TwoTowers``.

    kwargs, params = openclip.load("open_clip_model.safetensors", quick_gelu=True)   # OpenAI weights

The model's shape (widths, depths, patch, context length, vocabulary, embedding size) is read
from the tensors. What is not in a state dict is read from the ``open_clip_config.json`` beside
the weights (the hub layout) when present, else from the arguments: the head counts (image:
``width // head_width``, open_clip's default ``head_width`` 64 under a config; without one, the
heads of the vitmm ``VARIANTS`` tower of the same width, depth and MLP size — ViT-H/14's
``head_width`` is 80, g/14's 88, bigG/14's 104 — else refused: pass ``head_width``; text:
``text_heads``, default ``width // 64`` as in every released config) and whether the MLPs use
QuickGELU (OpenAI's weights, ``*-quickgelu`` models: ``quick_gelu=True``; without a config it must
be given).

Layout: fused ``in_proj`` attention = vitmm's ``qkv``; ``visual.proj``/``text_projection`` are
``[D, E]`` matrices applied as ``x @ proj`` (no transpose); no patch bias; ``ln_pre`` = vitmm
``pre_norm``; ``ln_post`` = the image tower's final norm, ``ln_final`` the text tower's. Text
pooling follows ``text_cfg.pool_type``: ``argmax`` (default: the end-of-text token has the largest
id) = vitmm ``pool="eot"``; ``eos`` (MetaCLIP 2's worldwide models) = ``pool="eot"`` with
``eos_id`` (the first such token); ``first``/``last`` = those pools. ``final_ln_after_pool`` is
exact as is: a LayerNorm acts on each token, so normalizing the pooled token equals pooling the
normalized ones. Any other setting the config gives that vitmm's towers do not implement
(``no_causal_mask``, ``embed_cls``, ``proj_bias``, a vision ``pool_type`` other than ``tok``,
``attentional_pool``, ``no_ln_pre``, ``act_kwargs``, ``norm_kwargs``, LayerScale, custom attention
blocks, ...) is refused, naming the field: the weights alone would load into another function.
"""

from __future__ import annotations

import json
import pathlib
import re

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
    standard_heads,
)


def _resblocks(sd: StateDict, prefix: str, depth: int, final: str) -> dict:
    enc = {}
    for i in range(depth):
        p = f"{prefix}.resblocks.{i}"
        enc[f"block_{i:02d}"] = {
            "norm1": norm(sd, f"{p}.ln_1"),
            "attn": {"qkv": {"kernel": sd.take(f"{p}.attn.in_proj_weight").T,
                             "bias": sd.take(f"{p}.attn.in_proj_bias")},
                     "out": linear(sd, f"{p}.attn.out_proj")},
            "norm2": norm(sd, f"{p}.ln_2"),
            "mlp": {"fc1": linear(sd, f"{p}.mlp.c_fc"), "fc2": linear(sd, f"{p}.mlp.c_proj")},
        }
    enc["encoder_norm"] = norm(sd, final)
    return enc


def _depth(tensors: dict, prefix: str) -> int:
    return 1 + max(int(m.group(1)) for k in tensors if (m := re.match(re.escape(prefix) + r"\.resblocks\.(\d+)\.", k)))


def _model_cfg(src) -> dict | None:
    """``model_cfg`` of the ``open_clip_config.json`` beside the weights (the hub layout), if any."""
    path = pathlib.Path(src).expanduser()
    path = path / "open_clip_config.json" if path.is_dir() else path.with_name("open_clip_config.json")
    return json.loads(path.read_text()).get("model_cfg", {}) if path.is_file() else None


# Config fields vitmm's towers do not implement, with open_clip's default (a value equal to it is fine).
UNSUPPORTED = {
    "vision_cfg": {"attentional_pool": False, "no_ln_pre": False, "pos_embed_type": "learnable", "pool_type": "tok",
                   "act_kwargs": None, "norm_kwargs": None, "ls_init_value": None, "block_type": None,
                   "qk_norm": False, "scaled_cosine_attn": False, "scale_heads": False, "scale_attn_inner": False,
                   "scale_attn": False, "scale_fc": False, "timm_model_name": None},
    "text_cfg": {"text_arch": "clip", "no_causal_mask": False, "embed_cls": False, "proj_bias": False,
                 "proj_type": "linear", "act_kwargs": None, "norm_kwargs": None, "ls_init_value": None,
                 "block_type": None, "qk_norm": False, "scaled_cosine_attn": False, "scale_heads": False,
                 "scale_attn_inner": False, "scale_attn": False, "scale_fc": False, "hf_model_name": None},
}
TEXT_POOLS = {"argmax": "eot", "eos": "eot", "first": "first", "last": "last"}  # open_clip → vitmm


def _check_config(cfg: dict, src) -> None:
    """One ``ValueError`` naming the first config field whose value vitmm's towers do not implement."""
    for tower, fields in UNSUPPORTED.items():
        for field, default in fields.items():
            value = (cfg.get(tower) or {}).get(field, default)
            if value != default and not (default is None and not value):  # {} kwargs are the default too
                raise ValueError(f"{src}: open_clip_config.json sets {tower}.{field}={value!r}, which vitmm's "
                                 f"towers do not implement (open_clip's default is {default!r}); this model "
                                 "cannot be converted.")
    pool = (cfg.get("text_cfg") or {}).get("pool_type", "argmax")
    if pool not in TEXT_POOLS:
        raise ValueError(f"{src}: open_clip_config.json sets text_cfg.pool_type={pool!r}; vitmm reads "
                         f"{sorted(TEXT_POOLS)}.")
    if pool == "eos" and (cfg.get("text_cfg") or {}).get("eos_id") is None:
        raise ValueError(f"{src}: open_clip_config.json sets text_cfg.pool_type='eos' without text_cfg.eos_id; "
                         "add the tokenizer's end-of-sequence id there.")


def load_two_towers(src: str | pathlib.Path, quick_gelu: bool | None = None, head_width: int | None = None,
                    text_heads: int | None = None,
                    image_size: int | tuple[int, int] | None = None) -> tuple[dict, dict]:
    """``(TwoTowers kwargs, params)`` of an open_clip ``CLIP`` (ViT image tower, text transformer)."""
    from vitmm.models.two_towers import TwoTowers

    tensors = io.read_tensors(src)
    if "visual.conv1.weight" not in tensors:
        raise ValueError(f"{src} is not an open_clip ViT CLIP state dict (no visual.conv1.weight); ModifiedResNet "
                         "and timm-tower models are not supported.")
    cfg = _model_cfg(src)
    if quick_gelu is None and cfg is not None:
        quick_gelu = bool(cfg.get("quick_gelu", False))
    if quick_gelu is None:
        raise ValueError("Whether this model uses QuickGELU is not in its weights: pass quick_gelu=True (OpenAI "
                         "weights, *-quickgelu models) or False, or put open_clip_config.json beside the weights.")
    act = "quick_gelu" if quick_gelu else "gelu"
    cfg = cfg or {}
    _check_config(cfg, src)
    text_pool = (cfg.get("text_cfg") or {}).get("pool_type", "argmax")
    sd = StateDict(tensors, str(src))
    width, channels, patch, _ = tensors["visual.conv1.weight"].shape
    vdepth = _depth(tensors, "visual.transformer")
    vmlp = tensors["visual.transformer.resblocks.0.mlp.c_fc.weight"].shape[0]
    head_width = head_width or ("vision_cfg" in cfg and cfg["vision_cfg"].get("head_width", 64))  # open_clip's default
    heads = width // head_width if head_width else standard_heads(width, vdepth, vmlp, src, "head_width (--head_width)")
    vpos = sd.take("visual.positional_embedding")
    image = dict(width=width, depth=vdepth, mlp_dim=vmlp, num_heads=max(heads, 1), patch_size=patch,
                 class_token=True, pre_norm=True, posemb="learn", posemb_layout="with_cls", pool="tok", act=act,
                 norm_eps=1e-5, embed_bias=False, posemb_resample="bicubic_aa")
    vocab, twidth = tensors["token_embedding.weight"].shape
    if not text_heads and "text_cfg" not in cfg and twidth % 64:
        raise ValueError(f"{src}: the text tower's head count is not in the weights and its width {twidth} is no "
                         "multiple of 64; pass text_heads (--text_heads) or put open_clip_config.json beside it.")
    tdepth = _depth(tensors, "transformer")
    tpos = sd.take("positional_embedding")
    text = dict(vocab_size=vocab, width=twidth, depth=tdepth,
                mlp_dim=tensors["transformer.resblocks.0.mlp.c_fc.weight"].shape[0],
                num_heads=text_heads or (cfg["text_cfg"].get("heads", 8) if "text_cfg" in cfg  # open_clip's default
                                         else max(twidth // 64, 1)),
                max_len=tpos.shape[0], causal=True, pool=TEXT_POOLS[text_pool],
                eos_id=int(cfg["text_cfg"]["eos_id"]) if text_pool == "eos" else None, act=act, norm_eps=1e-5)
    params = {
        "img": {"embedding": {"kernel": conv_kernel(sd.take("visual.conv1.weight"))},
                "cls": sd.take("visual.class_embedding").reshape(1, 1, -1),
                "cls_pos_embedding": vpos[None, :1],
                "pos_embedding": grid_table(vpos[1:], "visual.positional_embedding"),
                "pre_norm": norm(sd, "visual.ln_pre"),
                "encoder": _resblocks(sd, "visual.transformer", vdepth, "visual.ln_post")},
        "txt": {"token_embedding": {"embedding": sd.take("token_embedding.weight")}, "pos_embedding": tpos[None],
                "encoder": _resblocks(sd, "transformer", tdepth, "ln_final")},
        "img_proj": {"kernel": sd.take("visual.proj")},
        "txt_proj": {"kernel": sd.take("text_projection")},
        "t": np.asarray(sd.take("logit_scale")).reshape(1),
    }
    kwargs = dict(image=image, text=text, embed_dim=tensors["visual.proj"].shape[1])
    if "logit_bias" in tensors:  # open_clip's SigLIP-style CustomTextCLIP has a bias
        params["b"] = sd.take("logit_bias").reshape(1)
        kwargs["bias_init"] = -10.0
    res = patch * params["img"]["pos_embedding"].shape[1]
    example = (jnp.zeros((1, res, res, channels)), jnp.zeros((1, text["max_len"]), jnp.int32))
    params = finish(sd, TwoTowers(**kwargs), params, example, "a vitmm TwoTowers (open_clip)")
    if image_size is not None:
        params = {**params, "img": resize(params["img"], image, image_size)}
    return kwargs, params


def load(src: str | pathlib.Path, *, tower: str = "both", image_size: int | tuple[int, int] | None = None,
         quick_gelu: bool | None = None, head_width: int | None = None,
         text_heads: int | None = None) -> tuple[dict, dict]:
    """``(TwoTowers kwargs, params)``: both towers, or one (``tower`` vision or text)."""
    return pick_tower(*load_two_towers(src, quick_gelu=quick_gelu, head_width=head_width, text_heads=text_heads,
                                       image_size=image_size), tower, src)
