"""MobileVLM's LDPv2: an MLP on each token, adaptive average pooling to side×side, then a
positional-encoding generator (PEG: depthwise 3×3 conv with a residual, as CPVT/Twins)."""

from __future__ import annotations

import flax.linen as nn

from vitmm.models.connectors.base import MLP, DepthwiseConv, adaptive_avg_pool, check_tokens
from vitmm.models.connectors.budget import square_side


class LDP(nn.Module):
    out_dim: int
    budget: int = 64
    hidden: int | None = None  # the MLP's hidden width; default the LM width

    @staticmethod
    def tokens(budget, grid, **settings):
        return square_side(budget, "ldp") ** 2

    @staticmethod
    def token_grid(budget, grid, **settings):
        return (square_side(budget, "ldp"),) * 2

    @nn.compact
    def __call__(self, x, grid):
        check_tokens(x, grid)
        side = square_side(self.budget, "ldp")
        b = x.shape[0]
        x = MLP(self.out_dim, 2, hidden=self.hidden, name="mlp")(x)
        x = adaptive_avg_pool(x, grid, (side, side)).reshape(b, side, side, self.out_dim)
        x = x + DepthwiseConv(self.out_dim, name="peg")(x)
        return x.reshape(b, side * side, self.out_dim)
