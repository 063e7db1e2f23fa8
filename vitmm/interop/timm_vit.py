"""timm ``VisionTransformer`` state dicts → vitmm ``ViT``.

    kwargs, params = timm_vit.load("vit_small_patch16_224.safetensors", num_heads=6)

timm's layout is vitmm's almost name for name (fused ``qkv``, ``proj``, ``fc1``/``fc2``, ``ls1``/
``ls2`` LayerScale, ``norm_pre``). The differences handled here:

* ``pos_embed`` is flat ``[1, prefix + h·w, D]`` with ``no_embed_class=False`` (CLS, and
  registers, have positions) or ``[1, h·w, D]`` with ``no_embed_class=True`` (they do not).
  vitmm gives CLS a position with ``posemb_layout="with_cls"`` and never gives registers one: a
  register's position is a constant added to a learned constant, so it is folded into the
  register token (exact).
* ``global_pool``: ``token`` → ``pool="tok"``; ``avg`` without ``fc_norm`` → ``"gap"``. timm's
  ``avg`` with ``fc_norm`` normalises *after* pooling, which vitmm's ``gap`` (pooling the normed
  tokens) does not compute, so it is refused with that reason; ``map`` is not mapped yet.
* The number of heads is not in a state dict: pass ``num_heads`` (default ``width // 64``, timm's
  ViTs' head width) and ``act`` / ``norm_eps`` if the model was built with others.
"""

from __future__ import annotations

import pathlib
import re

import jax.numpy as jnp
import numpy as np

from vitmm.interop import io
from vitmm.interop.common import StateDict, conv_kernel, finish, grid_table, linear, norm, resize


def _block(sd: StateDict, p: str, qk_norm: bool, layerscale: bool) -> dict:
    qkv = sd.take(f"{p}.attn.qkv.weight")
    out = {
        "norm1": norm(sd, f"{p}.norm1"),
        "attn": {"qkv": {"kernel": qkv.T}, "out": linear(sd, f"{p}.attn.proj")},
        "norm2": norm(sd, f"{p}.norm2"),
        "mlp": {"fc1": linear(sd, f"{p}.mlp.fc1"), "fc2": linear(sd, f"{p}.mlp.fc2")},
    }
    out["attn"]["qkv"]["bias"] = (sd.take(f"{p}.attn.qkv.bias") if sd.has(f"{p}.attn.qkv.bias")
                                  else np.zeros(qkv.shape[0], np.float32))  # qkv_bias=False: exact zeros
    if qk_norm:
        out["attn"]["q_norm"] = norm(sd, f"{p}.attn.q_norm")
        out["attn"]["k_norm"] = norm(sd, f"{p}.attn.k_norm")
    if layerscale:
        out["ls1"], out["ls2"] = sd.take(f"{p}.ls1.gamma"), sd.take(f"{p}.ls2.gamma")
    return out


def load(src: str | pathlib.Path, num_heads: int | None = None, global_pool: str = "token", act: str = "gelu",
         norm_eps: float = 1e-6, image_size: int | None = None) -> tuple[dict, dict]:
    """``(ViT kwargs, params)`` of a timm ``VisionTransformer`` state dict (safetensors/npz/.bin)."""
    from vitmm.models.vit import ViT

    tensors = io.read_tensors(src)
    if global_pool not in ("token", "avg"):
        raise ValueError(f"global_pool={global_pool!r}: vitmm maps timm's 'token' and 'avg' (without fc_norm); "
                         "timm's attention-pool head ('map') is not mapped yet.")
    if "fc_norm.weight" in tensors:
        raise ValueError("This checkpoint normalises after average pooling (timm fc_norm); vitmm's gap pools the "
                         "normed tokens instead, so the outputs would differ. Not supported.")
    sd = StateDict(tensors, str(src))
    width, channels, ph, pw = tensors["patch_embed.proj.weight"].shape
    depth = 1 + max(int(m.group(1)) for k in tensors if (m := re.match(r"blocks\.(\d+)\.", k)))
    has_cls = "cls_token" in tensors
    registers = tensors["reg_token"].shape[1] if "reg_token" in tensors else 0
    pos = sd.take("pos_embed")[0]
    n_patch_rows = pos.shape[0]
    prefix_rows = 0
    patches = round(n_patch_rows ** 0.5) ** 2
    if patches != n_patch_rows:  # prefix tokens carry positions (no_embed_class=False)
        prefix_rows = int(has_cls) + registers
    qk_norm = "blocks.0.attn.q_norm.weight" in tensors
    layerscale = "blocks.0.ls1.gamma" in tensors
    kwargs = dict(width=width, depth=depth, mlp_dim=tensors["blocks.0.mlp.fc1.weight"].shape[0],
                  num_heads=num_heads or max(width // 64, 1), patch_size=ph if ph == pw else (ph, pw),
                  class_token=has_cls, num_registers=registers, posemb="learn",
                  posemb_layout="with_cls" if has_cls and prefix_rows else "patches",
                  pool={"token": "tok", "avg": "gap"}[global_pool],
                  pre_norm="norm_pre.weight" in tensors, qk_norm=qk_norm, layerscale=1.0 if layerscale else None,
                  act=act, norm_eps=norm_eps, embed_bias="patch_embed.proj.bias" in tensors)
    params = {"embedding": {"kernel": conv_kernel(sd.take("patch_embed.proj.weight"))},
              "pos_embedding": grid_table(pos[prefix_rows:], "pos_embed"),
              "encoder": {f"block_{i:02d}": _block(sd, f"blocks.{i}", qk_norm, layerscale) for i in range(depth)}}
    params["encoder"]["encoder_norm"] = norm(sd, "norm")
    if kwargs["embed_bias"]:
        params["embedding"]["bias"] = sd.take("patch_embed.proj.bias")
    if has_cls:
        params["cls"] = sd.take("cls_token")
        if prefix_rows:
            params["cls_pos_embedding"] = pos[None, :1]
    if registers:
        reg = sd.take("reg_token")
        if prefix_rows:  # fold the registers' positions into the tokens
            reg = reg + pos[None, int(has_cls):int(has_cls) + registers]
        params["registers"] = reg
    if kwargs["pre_norm"]:
        params["pre_norm"] = norm(sd, "norm_pre")
    if "head.weight" in tensors and tensors["head.weight"].ndim == 2 and tensors["head.weight"].shape[0] > 0:
        kwargs["num_classes"] = tensors["head.weight"].shape[0]
        params["head"] = linear(sd, "head")
    res = (params["pos_embedding"].shape[1] * ph, params["pos_embedding"].shape[2] * pw)
    params = finish(sd, ViT(**kwargs), params, (jnp.zeros((1, *res, channels)),), "a vitmm ViT (timm)")
    if image_size is not None:
        params = resize(params, kwargs, image_size)
    return kwargs, params
