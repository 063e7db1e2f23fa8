"""timm ``VisionTransformer`` state dicts → vitmm ``ViT``.

    kwargs, params = timm_vit.load("vit_small_patch16_224/model.safetensors", num_heads=6)
    pooled, out = ViT(**kwargs).apply({"params": params}, images_nhwc)

Correspondence (checked to 1e-4 against timm 1.0 in ``tests/interop``): timm's
``forward_features`` is vitmm's ``out["encoded"]`` with registers re-inserted after CLS
(``[CLS?, registers, patches]``), ``forward_head(..., pre_logits=True)`` is ``pooled`` and the
model's output is ``logits``. timm's layout is vitmm's almost name for name (fused ``qkv``,
``proj`` = ``out``, ``fc1``/``fc2``, ``ls1``/``ls2`` LayerScale, ``norm_pre`` = ``pre_norm``,
``fc_norm``, the ``attn_pool`` = ``map_head`` with its ``q``/``kv`` split). What differs:

* ``pos_embed`` is flat: ``[1, prefix + h·w, D]`` when CLS and registers have positions
  (``no_embed_class=False``, timm's default) or ``[1, h·w, D]`` (``no_embed_class=True``). vitmm
  gives CLS a position with ``posemb_layout="with_cls"`` and registers none: a register's
  position is a constant added to a learned constant, so it is folded into the register (exact).
  The grid ``h × w`` is not in the tensors: it is the trained image size of timm's ``config.json``
  beside the weights (``model_args.img_size``, else ``pretrained_cfg.input_size``) over the patch.
  Without that file a square grid is assumed, except where the count could be read two ways: a
  model with CLS or registers whose table is a square only without prefix rows (``no_embed_class``,
  or prefix rows before a non-square grid: 1 + 8·6 = 49) is refused unless the patch count left
  after the prefix is prime, and a table that is no square either way needs the trained size;
  ``image_size`` given as that size settles both. (A model without CLS or registers trained on a
  non-square grid of a square count, 16·9 = 144, cannot be told from 12·12 without the file.)
* ``qkv_bias=False`` becomes an exact zero bias.
* No ``pos_embed`` (timm's ``pos_embed='none'``: no positions at all) is vitmm's ``posemb="none"``,
  which fits any image size (``image_size`` resamples nothing).
* The head count, activation and LayerNorm epsilon are not in a state dict. ``num_heads``, when not
  given, comes from ``config.json``'s ``model_args`` or is that of the vitmm ``VARIANTS`` tower
  with the same width, depth and MLP size (ViT-H/g/G/So400m: 16), or ``width // 64`` where every
  known tower of that width has 64-wide heads; otherwise it is refused (``common.standard_heads``):
  a wrong count loads without a shape error. ``act`` and ``norm_eps`` are read from timm's
  ``config.json`` beside the weights (the hub layout) when present: QuickGELU when its
  ``architecture`` names it (``vit_*_clip_quickgelu_*``) or ``model_args.act_layer`` says so. Else
  ``act`` is exact GELU, which is wrong for OpenAI's CLIP weights saved without their config:
  pass ``act="quick_gelu"`` (CLI ``--act quick_gelu``). ``norm_eps`` is 1e-5 for ``pre_norm``
  models (every timm model registered with ``pre_norm=True``, the CLIP towers, is built with
  ``partial(LayerNorm, eps=1e-5)``), else 1e-6, timm's ``LayerNorm`` default.
* ``global_pool`` is read from the tensors (``attn_pool`` → ``map``, ``fc_norm`` → ``avg``, a CLS
  token → ``token``, else ``avg``); pass it when a CLS model was trained with ``avg``.
  ``avgmax``/``max`` have no vitmm pooling, and ``map`` over a sequence with CLS or registers
  differs from vitmm's patch-only ``map``: both are refused with that reason.
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
    vision_only,
)

POOLS = {"token": "tok", "avg": "gap", "map": "map", "": "none"}


def _block(sd: StateDict, p: str, qk_norm: bool, layerscale: bool) -> dict:
    qkv = sd.take(f"{p}.attn.qkv.weight")
    out = {
        "norm1": norm(sd, f"{p}.norm1"),
        "attn": {"qkv": {"kernel": qkv.T}, "out": linear(sd, f"{p}.attn.proj")},
        "norm2": norm(sd, f"{p}.norm2"),
        "mlp": {"fc1": linear(sd, f"{p}.mlp.fc1"), "fc2": linear(sd, f"{p}.mlp.fc2")},
    }
    out["attn"]["qkv"]["bias"] = (sd.take(f"{p}.attn.qkv.bias") if sd.has(f"{p}.attn.qkv.bias")
                                  else np.zeros(qkv.shape[0], np.float32))
    if qk_norm:
        out["attn"]["q_norm"] = norm(sd, f"{p}.attn.q_norm")
        out["attn"]["k_norm"] = norm(sd, f"{p}.attn.k_norm")
    if layerscale:
        out["ls1"], out["ls2"] = sd.take(f"{p}.ls1.gamma"), sd.take(f"{p}.ls2.gamma")
    return out


def _grid(config: dict, patch: tuple[int, int]) -> tuple[int, int] | None:
    """The patch grid of the image size timm's ``config.json`` records (None: it records none)."""
    size = (config.get("model_args") or {}).get("img_size")
    if size is None:
        size = ((config.get("pretrained_cfg") or {}).get("input_size") or [None])[1:] or None
    if size is None:
        return None
    size = (size, size) if isinstance(size, int) else tuple(size)
    return size[0] // patch[0], size[1] // patch[1]


def _layout(rows: int, prefix: int, trained: tuple[int, int] | None, asked: tuple[int, int] | None,
            src) -> tuple[int, tuple[int, int]]:
    """``(rows belonging to CLS/registers, (h, w) patch grid)`` of a flat position table of ``rows``
    rows for ``prefix`` CLS/register tokens: the ``trained`` grid (``config.json``) when known, else
    the square reading where only one fits and nothing else could, else the ``asked`` grid
    (``image_size``) where it fits; never a guess between readings."""
    def fits(grid):
        n = grid[0] * grid[1]
        return 0 if n == rows else prefix if prefix and n == rows - prefix else None

    if trained is not None:
        if fits(trained) is None:
            raise ValueError(f"{src}: pos_embed has {rows} rows, which are neither the {trained[0]}x{trained[1]} "
                             f"grid of config.json's image size nor it plus {prefix} CLS/register rows; that "
                             "config.json is not this checkpoint's: remove it or put the right one there.")
        return fits(trained), trained
    side = lambda n: round(n ** 0.5) if n > 0 and round(n ** 0.5) ** 2 == n else None  # noqa: E731
    with_prefix, without = prefix > 0 and side(rows - prefix), side(rows)
    composite = any((rows - prefix) % d == 0 for d in range(2, int((rows - prefix) ** 0.5) + 1))
    if with_prefix and not without:  # timm's default layout, a square grid after the prefix rows
        return prefix, (with_prefix, with_prefix)
    if without and not with_prefix and not (prefix and composite):  # no prefix tokens, or a prime count left
        return 0, (without, without)
    if asked is not None and fits(asked) is not None:
        return fits(asked), asked
    if with_prefix or without:
        reading = (f"a {without}x{without} grid without the {prefix} CLS/register rows (no_embed_class) or "
                   f"those rows before a grid of {rows - prefix} patches")
    else:
        reading = f"no square grid, with or without {prefix} CLS/register rows"
    raise ValueError(f"{src}: pos_embed has {rows} rows: {reading}; the grid is not in the weights. Give the "
                     "image size the model was trained at (image_size / --image_size HxW) or put timm's "
                     "config.json beside the weights.")


def timm_config(src) -> dict:
    """timm's ``config.json`` beside the weights (``architecture``, ``pretrained_cfg``, sometimes
    ``model_args``), or {} without one."""
    path = pathlib.Path(src).expanduser()
    path = path / "config.json" if path.is_dir() else path.with_name("config.json")
    return json.loads(path.read_text()) if path.is_file() else {}


def _act(config: dict) -> str | None:
    """The MLP activation ``config`` names (None: it names none)."""
    from vitmm.models.common import ACTIVATIONS

    act = (config.get("model_args") or {}).get("act_layer")
    if act is None and "quickgelu" in str(config.get("architecture", "")):
        act = "quick_gelu"
    if act is not None and act not in ACTIVATIONS:
        raise ValueError(f"timm config.json: act_layer {act!r} has no vitmm activation; vitmm has "
                         f"{sorted(ACTIVATIONS)}.")
    return act


def _infer_pool(tensors: dict) -> str:
    if "attn_pool.latent" in tensors:
        return "map"
    if "fc_norm.weight" in tensors or "cls_token" not in tensors:
        return "avg"
    return "token"


def load_vit(src: str | pathlib.Path, num_heads: int | None = None, global_pool: str | None = None,
             act: str | None = None, norm_eps: float | None = None,
             image_size: int | tuple[int, int] | None = None) -> tuple[dict, dict]:
    """``(ViT kwargs, params)`` of a timm ``VisionTransformer`` state dict (safetensors/npz/.bin).
    ``act``/``norm_eps`` None: from timm's ``config.json`` beside the weights, else GELU and 1e-5
    (``pre_norm`` CLIP towers) or 1e-6."""
    from vitmm.models.patch_embed import to_pair
    from vitmm.models.vit import ViT

    tensors = io.read_tensors(src)
    config = timm_config(src)
    if "patch_embed.proj.weight" not in tensors or "blocks.0.attn.qkv.weight" not in tensors:
        raise ValueError(f"{src} is not a timm VisionTransformer state dict (no patch_embed.proj.weight / "
                         "blocks.0.attn.qkv.weight); hybrid (ResNet stem) and EVA/BEiT models are other classes.")
    global_pool = _infer_pool(tensors) if global_pool is None else global_pool
    if global_pool not in POOLS:
        raise ValueError(f"global_pool={global_pool!r}: vitmm has no such pooling; it maps timm's "
                         f"{sorted(POOLS)} ('' = no pooling).")
    sd = StateDict(tensors, str(src))
    width, channels, ph, pw = tensors["patch_embed.proj.weight"].shape
    depth = 1 + max(int(m.group(1)) for k in tensors if (m := re.match(r"blocks\.(\d+)\.", k)))
    has_cls = "cls_token" in tensors
    registers = tensors["reg_token"].shape[1] if "reg_token" in tensors else 0
    if global_pool == "map" and (has_cls or registers):
        raise ValueError("timm's attention pool reads CLS/register tokens too; vitmm's map pools the patch tokens "
                         "only, so this model's pooled output would differ. Not supported.")
    positions = "pos_embed" in tensors  # timm's pos_embed='none' leaves it out: no positions
    pos = sd.take("pos_embed")[0] if positions else None
    pre_norm = "norm_pre.weight" in tensors
    act = act or _act(config) or "gelu"
    norm_eps = norm_eps if norm_eps is not None else 1e-5 if pre_norm else 1e-6
    patch = (ph, pw)
    asked = None if image_size is None else tuple(
        n // p for n, p in zip(to_pair(image_size, "image_size"), patch, strict=True))
    prefix_rows, grid = (_layout(pos.shape[0], int(has_cls) + registers, _grid(config, patch), asked, src)
                         if positions else (0, None))
    qk_norm = "blocks.0.attn.q_norm.weight" in tensors
    layerscale = "blocks.0.ls1.gamma" in tensors
    fc_norm = "fc_norm.weight" in tensors
    mlp_dim = tensors["blocks.0.mlp.fc1.weight"].shape[0]
    num_heads = (num_heads or (config.get("model_args") or {}).get("num_heads")
                 or standard_heads(width, depth, mlp_dim, src, "num_heads (--num_heads)"))
    kwargs = dict(width=width, depth=depth, mlp_dim=mlp_dim, num_heads=int(num_heads),
                  patch_size=ph if ph == pw else (ph, pw), class_token=has_cls, num_registers=registers,
                  posemb="learn" if positions else "none",
                  posemb_layout="with_cls" if has_cls and prefix_rows else "patches", pool=POOLS[global_pool],
                  pre_norm=pre_norm, fc_norm=fc_norm, qk_norm=qk_norm, layerscale=1.0 if layerscale else None,
                  act=act, norm_eps=norm_eps,
                  embed_bias="patch_embed.proj.bias" in tensors, posemb_resample="bicubic_aa")
    params = {"embedding": {"kernel": conv_kernel(sd.take("patch_embed.proj.weight"))},
              "encoder": {f"block_{i:02d}": _block(sd, f"blocks.{i}", qk_norm, layerscale) for i in range(depth)}}
    if positions:
        params["pos_embedding"] = grid_table(pos[prefix_rows:], "pos_embed", grid)
    if fc_norm:
        params["fc_norm"] = norm(sd, "fc_norm")
    else:
        params["encoder"]["encoder_norm"] = norm(sd, "norm")
    if kwargs["embed_bias"]:
        params["embedding"]["bias"] = sd.take("patch_embed.proj.bias")
    if has_cls:
        params["cls"] = sd.take("cls_token")
        if prefix_rows:
            params["cls_pos_embedding"] = pos[None, :1]
    if registers:
        reg = sd.take("reg_token")
        if prefix_rows:
            reg = reg + pos[None, int(has_cls):int(has_cls) + registers]
        params["registers"] = reg
    if kwargs["pre_norm"]:
        params["pre_norm"] = norm(sd, "norm_pre")
    if global_pool == "map":
        kv = sd.take("attn_pool.kv.weight"), sd.take("attn_pool.kv.bias")
        params["map_head"] = {"probe": sd.take("attn_pool.latent"),
                              "attn": {"q": linear(sd, "attn_pool.q"), "kv": {"kernel": kv[0].T, "bias": kv[1]},
                                       "out": linear(sd, "attn_pool.proj")},
                              "norm": norm(sd, "attn_pool.norm"),
                              "mlp": {"fc1": linear(sd, "attn_pool.mlp.fc1"), "fc2": linear(sd, "attn_pool.mlp.fc2")}}
    if sd.has("head.weight"):
        kwargs["num_classes"] = tensors["head.weight"].shape[0]
        params["head"] = linear(sd, "head")
    grid = grid or (2, 2)  # without positions any grid fits
    res = (grid[0] * ph, grid[1] * pw)
    params = finish(sd, ViT(**kwargs), params, (jnp.zeros((1, *res, channels)),), "a vitmm ViT (timm)")
    if image_size is not None and positions:
        params = resize(params, kwargs, image_size)
    return kwargs, params


def load(src: str | pathlib.Path, *, tower: str = "both", image_size: int | tuple[int, int] | None = None,
         num_heads: int | None = None, global_pool: str | None = None, act: str | None = None,
         norm_eps: float | None = None) -> tuple[dict, dict]:
    """``(TwoTowers kwargs, params)`` with the ViT as the only tower (``tower`` both or vision)."""
    kwargs, img = load_vit(src, num_heads=num_heads, global_pool=global_pool, act=act, norm_eps=norm_eps,
                           image_size=image_size)
    return pick_tower(*vision_only(kwargs, img), tower, src)
