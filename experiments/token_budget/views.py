"""The encoder-side views of the token-budget sweep's tower: fewer patches by a smaller image
(sin-cos positions recomputed) or by larger patches (the patch kernel PI-resized, FlexiViT's
rule), which the encoder-budget comparison sets against connectors on the full grid."""

from __future__ import annotations

import math

from vitmm.models.vit import ViT


def encoder_views(tower_cfg: dict, tower_params: dict, image_size: int, grid, budgets) -> dict:
    """``{tokens: {variant: (view name, tower, params, image size)}}``: the tower itself reaching
    ``tokens`` patches by a smaller image (sin-cos positions recomputed for the smaller grid; a
    learned table resampled) or by larger patches at the same image (the patch kernel PI-resized,
    FlexiViT's rule). A budget neither reaches exactly is left out."""
    from vitmm.models.patch_embed import resize_kernel
    from vitmm.models.vit_tools import resize_posemb

    n, patch = grid[0] * grid[1], tower_cfg["patch_size"]
    out = {}
    for tokens in budgets:
        scale = math.isqrt(n // tokens)
        if grid[0] != grid[1] or scale * scale * tokens != n or scale < 2:
            continue
        views = out.setdefault(tokens, {})
        small = image_size // scale
        side = grid[0] // scale
        params = (resize_posemb(tower_params, (side, side)) if "pos_embedding" in tower_params else tower_params)
        views[f"image {small} px"] = (f"res{small}", ViT(**tower_cfg), params, small)
        kernel = resize_kernel(tower_params["embedding"]["kernel"], patch * scale)
        big = {**tower_params, "embedding": {**tower_params["embedding"], "kernel": kernel}}
        views[f"patch {patch * scale}"] = (f"patch{patch * scale}", ViT(**{**tower_cfg, "patch_size": patch * scale}),
                                           resize_posemb(big, (side, side)) if "pos_embedding" in big else big,
                                           image_size)
    return out
