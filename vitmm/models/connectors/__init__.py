"""Connectors from patch tokens to language-model tokens under an explicit token budget.

    cfg = {"name": "pixel_shuffle", "budget": 16}
    connector = connectors.build(cfg, out_dim=lm_width)
    tokens = connector.apply(variables, patch_tokens, grid)      # [B, M, D]
    connectors.num_visual_tokens(cfg, grid) == tokens.shape[1]   # tested for every family

One small module per family; ``REGISTRY`` maps names to classes; ``budget.py`` holds every
rule for how many tokens a family gives (and ``reachable``/``resolve`` for sweeps). ``cost(cfg, ...)`` reports
parameters (``jax.eval_shape``) and FLOPs (XLA's cost analysis of the compiled forward).
"""

from __future__ import annotations

import jax.numpy as jnp

from vitmm import tree
from vitmm.models import common
from vitmm.models.connectors.budget import BudgetError, lookup, num_visual_tokens, reachable, resolve
from vitmm.models.connectors.c_abstractor import CAbstractor
from vitmm.models.connectors.ldp import LDP
from vitmm.models.connectors.merge import PatchMerger, PixelShuffle
from vitmm.models.connectors.perceiver import Idefics2Perceiver, Perceiver
from vitmm.models.connectors.pool import Pool
from vitmm.models.connectors.projectors import Identity, Linear, Mlp
from vitmm.models.connectors.qformer import QFormer
from vitmm.models.connectors.qwen_resampler import QwenResampler

REGISTRY = {
    "identity": Identity, "linear": Linear, "mlp": Mlp, "qwen_resampler": QwenResampler,
    "perceiver": Perceiver, "idefics2_perceiver": Idefics2Perceiver, "qformer": QFormer, "patch_merger": PatchMerger,
    "pixel_shuffle": PixelShuffle, "pool": Pool, "c_abstractor": CAbstractor, "ldp": LDP,
}

__all__ = ["REGISTRY", "BudgetError", "build", "num_visual_tokens", "reachable", "resolve", "cost"]


def build(cfg: dict, out_dim: int):
    """The connector module for ``cfg`` (``name``, ``budget`` and family options)."""
    family, settings = lookup(cfg)
    return family(out_dim=out_dim, **settings)


def cost(cfg: dict, in_dim: int, out_dim: int, grid: tuple[int, int]) -> dict:
    """Parameters and forward FLOPs per image (XLA's count of the compiled program)."""
    module = build(cfg, out_dim)
    x = jnp.zeros((1, grid[0] * grid[1], in_dim), jnp.float32)
    grid = tuple(grid)
    shapes, flops = common.traced_cost(lambda key, x: module.init(key, x, grid),
                                       lambda p, x: module.apply(p, x, grid), x)
    return {"params": tree.count(shapes.get("params", {})), "flops": flops,
            "tokens": num_visual_tokens(cfg, grid)}
