"""Connectors from patch tokens to language-model tokens under an explicit token budget.

    cfg = {"name": "pixel_shuffle", "budget": 16}
    connector = connectors.build(cfg, out_dim=lm_width)
    tokens = connector.apply(variables, patch_tokens, grid)      # [B, M, D]
    connectors.num_visual_tokens(cfg, grid) == tokens.shape[1]   # tested for every family

One small module per family; ``REGISTRY`` maps names to classes; ``budget.py`` holds every
rule for how many tokens a family gives (and ``reachable``/``resolve`` for sweeps). ``cost(cfg, ...)`` reports
parameters (``jax.eval_shape``) and FLOPs (XLA's cost analysis of the compiled forward);
``size_to(cfg, params, ...)`` sets a family's size knob (``SIZE_KNOBS``) for a parameter count.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from vitmm import tree
from vitmm.models import common
from vitmm.models.connectors.budget import BudgetError, lookup, num_visual_tokens, reachable, resolve, token_grid
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

# The one setting that sizes each family at a fixed token count (``size_to``), and its candidates.
SIZE_KNOBS = {
    "mlp": "hidden", "pool": "hidden", "ldp": "hidden", "pixel_shuffle": "hidden", "patch_merger": "hidden",
    "c_abstractor": "hidden", "qwen_resampler": "width", "qformer": "width", "perceiver": "depth",
}
_CANDIDATES = {"hidden": range(8, 4097, 8), "width": range(8, 2049, 8), "depth": range(1, 17)}

__all__ = ["REGISTRY", "SIZE_KNOBS", "BudgetError", "build", "num_visual_tokens", "reachable", "resolve", "cost",
           "num_params", "size_to", "token_grid"]


def build(cfg: dict, out_dim: int):
    """The connector module for ``cfg`` (``name``, ``budget`` and family options)."""
    family, settings = lookup(cfg)
    return family(out_dim=out_dim, **settings)


def cost(cfg: dict, in_dim: int, out_dim: int, grid: tuple[int, int]) -> dict:
    """Parameters and forward FLOPs per image (XLA's count of the lowered program: ``common.lowered_flops``)."""
    module = build(cfg, out_dim)
    x = jnp.zeros((1, grid[0] * grid[1], in_dim), jnp.float32)
    grid = tuple(grid)
    shapes, flops = common.traced_cost(lambda key, x: module.init(key, x, grid),
                                       lambda p, x: module.apply(p, x, grid), x)
    return {"params": tree.count(shapes.get("params", {})), "flops": flops,
            "tokens": num_visual_tokens(cfg, grid)}


def num_params(cfg: dict, in_dim: int, out_dim: int, grid: tuple[int, int]) -> int:
    """The connector's parameter count (shapes only: nothing is compiled or run)."""
    module = build(cfg, out_dim)
    x = jax.ShapeDtypeStruct((1, grid[0] * grid[1], in_dim), jnp.float32)
    shapes = jax.eval_shape(lambda key, x: module.init(key, x, tuple(grid)), jax.random.key(0), x)
    return tree.count(shapes.get("params", {}))


def size_to(cfg: dict, params: int, in_dim: int, out_dim: int, grid: tuple[int, int]) -> tuple[dict, int]:
    """``(cfg with its family's SIZE_KNOBS setting chosen, its parameter count)``: the candidate
    value whose count is nearest ``params`` (by ratio; ties: the smaller value), found by bisection
    (counts grow with the knob). The token count is unchanged. Raises for a family without a size
    knob (``linear``: one matrix, in × out)."""
    name = cfg.get("name")
    if name not in SIZE_KNOBS:
        raise ValueError(f"Connector {name!r} has no size knob (families with one: {sorted(SIZE_KNOBS)}); "
                         "leave it out of an equal-parameter comparison or compare it at its only size.")
    knob, values, counts = SIZE_KNOBS[name], _CANDIDATES[SIZE_KNOBS[name]], {}

    def count(j):  # None for a value the family rejects (e.g. a width its heads do not divide)
        if j not in counts:
            try:
                counts[j] = num_params({**cfg, knob: values[j]}, in_dim, out_dim, grid)
            except ValueError:
                counts[j] = None
        return counts[j]

    def next_valid(i):  # the first valid index from i on; the count there grows with i
        return next((j for j in range(i, len(values)) if count(j) is not None), None)

    lo, hi = 0, len(values)  # the first index whose next valid candidate reaches params
    while lo < hi:
        mid = (lo + hi) // 2
        j = next_valid(mid)
        if j is not None and counts[j] >= params:
            hi = mid
        else:
            lo = mid + 1
    above = next_valid(lo) if lo < len(values) else None
    below = next((j for j in range(lo - 1, -1, -1) if count(j) is not None), None)
    best = min((j for j in (below, above) if j is not None), key=lambda j: (abs(math.log(counts[j] / params)), j))
    return {**cfg, knob: values[best]}, counts[best]
