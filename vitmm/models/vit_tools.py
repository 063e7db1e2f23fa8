"""Parameter surgery and accounting for a ``ViT``: a learned position table resampled to a new
grid, parameter counts, the analytic forward FLOPs and the token-count table of lesson 004.

    params = vit_tools.resize_posemb(params, model.grid((384, 384)), model.posemb_resample)
    vit_tools.count_params(ViT(variant="B/16", posemb_layout="with_cls"))  # 85,798,656 (timm's)
    vit_tools.forward_flops(decode_variant("B/16"), (224, 224))   # 2 FLOPs per multiply-add
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from vitmm import tree
from vitmm.models import posemb as pe
from vitmm.models.patch_embed import grid_size
from vitmm.models.transformer import layer_flops
from vitmm.models.vit import Arch, ViT, decode_variant


def resize_posemb(params: dict, new_grid: tuple[int, int], method: str = "bicubic_aa") -> dict:
    """Returns ``params`` with the learned position table resampled to ``new_grid``.

    Use it once when loading a checkpoint at a new resolution, with the ``method`` its source
    uses (a converted model's ``posemb_resample``); the CLS position, if any, is unchanged.
    Works for non-square grids.
    """
    if "pos_embedding" not in params:
        raise ValueError(f"No learned 'pos_embedding' among the top-level params {sorted(params)}.")
    params = dict(params)
    params["pos_embedding"] = pe.resample_grid(params["pos_embedding"], tuple(new_grid), method)
    return params


def count_params(model: ViT, image_hw: Sequence[int] = (224, 224), channels: int = 3) -> int:
    """Parameter count without allocating anything (``jax.eval_shape``)."""
    shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, *image_hw, channels)))
    return tree.count(shapes["params"])


def forward_flops(arch: Arch, image_hw: Sequence[int], channels: int = 3, num_prefix_tokens: int = 1) -> int:
    """Analytic forward FLOPs per image (2 per multiply-add), the standard ViT count:

    ``2·N_p·(C·ph·pw)·D + L·layer_flops(N, D, mlp)`` with ``N_p`` patches and
    ``N = N_p + prefix`` tokens; with ``mlp = 4D`` the layer term is ``24·N·D² + 4·N²·D``.
    The head is ignored.
    """
    gh, gw = grid_size(image_hw, arch.patch_size)
    n_patch = gh * gw
    n = n_patch + num_prefix_tokens
    d = arch.width
    embed = 2 * n_patch * channels * arch.patch_size[0] * arch.patch_size[1] * d
    return embed + arch.depth * layer_flops(n, d, arch.mlp_dim)


def token_costs(name: str, resolutions: Sequence[int], patches: Sequence[int],
                num_prefix_tokens: int = 1) -> list[dict]:
    """Token counts and analytic costs of variant ``name`` (e.g. ``"B"``) per square resolution
    and patch size. Combinations whose resolution is not a multiple of the patch get
    ``tokens=None`` rather than a silently floored count.

    ``attn_pairs`` is ``N²`` (scores per head per layer); ``attn_share`` is the part of a layer's
    FLOPs spent in ``QKᵀ`` and ``AV``, ``4N²D / (8ND² + 4N·D·mlp + 4N²D)``.
    """
    rows = []
    for res in resolutions:
        for p in patches:
            row = dict(variant=f"{name}/{p}", resolution=res, patch=p, patches=None, tokens=None,
                       attn_pairs=None, gflops=None, attn_share=None)
            if res % p == 0:
                arch = decode_variant(f"{name}/{p}")
                n_patch = (res // p) ** 2
                n = n_patch + num_prefix_tokens
                d = arch.width
                attn = 4 * n * n * d
                row.update(
                    patches=n_patch, tokens=n, attn_pairs=n * n,
                    gflops=forward_flops(arch, (res, res), num_prefix_tokens=num_prefix_tokens) / 1e9,
                    attn_share=attn / (8 * n * d * d + 4 * n * d * arch.mlp_dim + attn),
                )
            rows.append(row)
    return rows
