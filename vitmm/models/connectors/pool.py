"""2D pooling of the patch grid by a stride s, then LLaVA's 2-layer MLP (after LLaVA-OneVision's
``get_2dPool``).

Every mode but ``llava_average`` gives ``ceil(h/s) × ceil(w/s)`` tokens (LLaVA-OneVision's count);
the budget picks the stride, and a budget no stride reaches is an error that lists the
reachable ones. Modes:
  * ``"area"`` (default): each output cell averages its share of the grid (PyTorch's
    ``AdaptiveAvgPool2d`` cells, which overlap when the output does not divide the grid). Every
    patch reaches the output, for every budget.
  * ``"bilinear"``: bilinear resize with anti-aliasing (the triangle filter widened by the
    stride): every patch reaches the output too.
  * ``"llava_bilinear"``: LLaVA-OneVision exactly, ``F.interpolate(mode="bilinear",
    align_corners=False)`` without anti-aliasing. Each output samples its 2×2 nearest patches,
    so at stride ≥ 3 most patches never reach the LM (16 of 64 at 4 tokens on an 8×8 grid).
  * ``"llava_average"``: ``avg_pool2d(s, s)`` with PyTorch's default ``ceil_mode=False``:
    ``floor(h/s) × floor(w/s)`` tokens, a ragged last row/column of patches dropped (the
    largest stride that gives the budget is used, so as few as possible are).
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax

from vitmm.models.connectors.base import MLP, adaptive_avg_pool, check_tokens
from vitmm.models.connectors.budget import BudgetError

MODES = ("area", "bilinear", "llava_bilinear", "llava_average")


def pooled_grid(grid, stride, mode):
    h, w = grid
    if mode == "llava_average":
        return h // stride, w // stride
    return math.ceil(h / stride), math.ceil(w / stride)


def pool_stride(budget, grid, mode) -> int:
    if mode not in MODES:
        raise ValueError(f"Unknown pool mode {mode!r}; choose one of {MODES}.")
    if budget in (None, "all"):
        return 1
    reachable = {}
    for s in range(1, max(grid) + 1):
        gh, gw = pooled_grid(grid, s, mode)
        if gh * gw > 0:  # the largest stride per count: only llava_average depends on it (fewest dropped)
            reachable[gh * gw] = s
    if budget not in reachable:
        raise BudgetError(f"pool ({mode}) on a {grid[0]}x{grid[1]} grid reaches {sorted(reachable)} tokens "
                          f"with integer strides; {budget} is not among them.")
    return reachable[budget]


class Pool(nn.Module):
    out_dim: int
    budget: int | None = None
    mode: str = "area"
    hidden: int | None = None  # the MLP's hidden width; default the LM width

    @staticmethod
    def tokens(budget, grid, mode="area", **settings):
        gh, gw = pooled_grid(grid, pool_stride(budget, grid, mode), mode)
        return gh * gw

    @staticmethod
    def token_grid(budget, grid, mode="area", **settings):
        return pooled_grid(grid, pool_stride(budget, grid, mode), mode)

    @nn.compact
    def __call__(self, x, grid):
        check_tokens(x, grid)
        s = pool_stride(self.budget, grid, self.mode)
        b, _, c = x.shape
        gh, gw = pooled_grid(grid, s, self.mode)
        if self.mode == "area":
            pooled = adaptive_avg_pool(x, grid, (gh, gw))
        elif self.mode == "llava_average":
            img = x.reshape(b, *grid, c)[:, : gh * s, : gw * s]
            pooled = img.reshape(b, gh, s, gw, s, c).mean(axis=(2, 4)).reshape(b, gh * gw, c)
        else:  # half-pixel centres (align_corners=False); anti-aliased unless LLaVA's exact call
            pooled = jax.image.resize(x.reshape(b, *grid, c), (b, gh, gw, c), "bilinear",
                                      antialias=self.mode == "bilinear").reshape(b, gh * gw, c)
        return MLP(self.out_dim, 2, hidden=self.hidden, name="mlp")(pooled)
