"""2D pooling of the patch grid by a stride s, then LLaVA's 2-layer MLP (LLaVA-OneVision's
``get_2dPool``).

Token counts (documented because they differ):
  * ``mode="bilinear"`` (LLaVA-OneVision's default): resize to ``ceil(h/s) × ceil(w/s)``;
  * ``mode="average"``: ``avg_pool2d(s, s)`` with PyTorch's default ``ceil_mode=False``:
    ``floor(h/s) × floor(w/s)`` (a ragged last row/column is dropped).
The budget picks the stride; a budget no stride reaches is an error that lists the reachable ones.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax

from vitmm.models.connectors.base import MLP, BudgetError, check_tokens

MODES = ("bilinear", "average")


def pooled_grid(grid, stride, mode):
    h, w = grid
    if mode == "bilinear":
        return math.ceil(h / stride), math.ceil(w / stride)
    return h // stride, w // stride


def pool_stride(budget, grid, mode) -> int:
    if mode not in MODES:
        raise ValueError(f"Unknown pool mode {mode!r}; choose one of {MODES}.")
    if budget in (None, "all"):
        return 1
    reachable = {}
    for s in range(1, max(grid) + 1):
        gh, gw = pooled_grid(grid, s, mode)
        if gh * gw > 0:
            reachable.setdefault(gh * gw, s)
    if budget not in reachable:
        raise BudgetError(f"pool ({mode}) on a {grid[0]}x{grid[1]} grid reaches {sorted(reachable)} tokens "
                          f"with integer strides; {budget} is not among them.")
    return reachable[budget]


class Pool(nn.Module):
    out_dim: int
    budget: int | None = None
    mode: str = "bilinear"

    @staticmethod
    def tokens(budget, grid, mode="bilinear"):
        gh, gw = pooled_grid(grid, pool_stride(budget, grid, mode), mode)
        return gh * gw

    @nn.compact
    def __call__(self, x, grid):
        check_tokens(x, grid)
        s = pool_stride(self.budget, grid, self.mode)
        b, _, c = x.shape
        img = x.reshape(b, *grid, c)
        gh, gw = pooled_grid(grid, s, self.mode)
        if self.mode == "bilinear":
            # Half-pixel centres and no anti-aliasing: F.interpolate(mode="bilinear", align_corners=False).
            img = jax.image.resize(img, (b, gh, gw, c), "bilinear", antialias=False)
        else:
            img = img[:, : gh * s, : gw * s].reshape(b, gh, s, gw, s, c).mean(axis=(2, 4))
        return MLP(self.out_dim, 2, name="mlp")(img.reshape(b, gh * gw, c))
