"""Neighbour merging: Qwen2-VL's ``patch_merger`` and InternVL's ``pixel_shuffle``.

Both concatenate k×k neighbouring patch tokens (k = 2 in both papers: a 4× smaller budget) and
map the k²·C vector to the LM width; the budget picks k (``(h/k)·(w/k)`` tokens, so only those
budgets are reachable), or ``merge=k`` fixes it, so that images of any size (multiples of k
patches) give ``(h/k)·(w/k)`` tokens: Qwen2-VL's native resolution.
  * ``patch_merger``: LayerNorm(C) per token, merge, MLP ``k²C → k²C → D`` (GELU).
  * ``pixel_shuffle``: merge, LayerNorm(k²C), MLP ``k²C → D → D`` (GELU). The merge keeps the
    image's orientation (InternVL's ``ps_version='v2'``; 'v1' transposed the image).
"""

from __future__ import annotations

import flax.linen as nn

from vitmm.models.connectors.base import MLP, check_tokens, space_to_depth
from vitmm.models.connectors.budget import merge_factor


class PatchMerger(nn.Module):
    out_dim: int
    budget: int | None = None
    hidden: int | None = None  # the MLP's hidden width (defaults below)
    merge: int | None = None  # a fixed k (native resolution); otherwise the budget picks it

    @staticmethod
    def tokens(budget, grid, merge=None, **settings):
        k = merge_factor(budget, grid, "patch_merger", merge)
        return (grid[0] // k) * (grid[1] // k)

    @staticmethod
    def token_grid(budget, grid, merge=None, **settings):
        k = merge_factor(budget, grid, "patch_merger", merge)
        return grid[0] // k, grid[1] // k

    @nn.compact
    def __call__(self, x, grid):
        check_tokens(x, grid)
        k = merge_factor(self.budget, grid, "patch_merger", self.merge)
        x = nn.LayerNorm(epsilon=1e-6, name="ln_q")(x)
        x = space_to_depth(x, grid, k)
        return MLP(self.out_dim, 2, hidden=self.hidden or x.shape[-1], name="mlp")(x)


class PixelShuffle(nn.Module):
    out_dim: int
    budget: int | None = None
    hidden: int | None = None  # the MLP's hidden width (defaults below)
    merge: int | None = None  # a fixed k (native resolution); otherwise the budget picks it
    # InternVL's: a LayerNorm and a two-layer MLP; Idefics3's (SmolVLM's): norm=False, depth=1, use_bias=False
    norm: bool = True
    depth: int = 2
    use_bias: bool = True

    @staticmethod
    def tokens(budget, grid, merge=None, **settings):
        k = merge_factor(budget, grid, "pixel_shuffle", merge)
        return (grid[0] // k) * (grid[1] // k)

    @staticmethod
    def token_grid(budget, grid, merge=None, **settings):
        k = merge_factor(budget, grid, "pixel_shuffle", merge)
        return grid[0] // k, grid[1] // k

    @nn.compact
    def __call__(self, x, grid):
        check_tokens(x, grid)
        k = merge_factor(self.budget, grid, "pixel_shuffle", self.merge)
        x = space_to_depth(x, grid, k)
        if self.norm:
            x = nn.LayerNorm(epsilon=1e-5, name="norm")(x)  # torch default, as InternVL
        return MLP(self.out_dim, self.depth, hidden=self.hidden, use_bias=self.use_bias, name="mlp")(x)
