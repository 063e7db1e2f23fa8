"""Honeybee's C-Abstractor: residual conv blocks, adaptive average pooling to side×side,
residual conv blocks, then a Linear → SiLU → Linear readout.

A learned absolute position table (trunc-normal 0.02) is added to the input features first,
as in Honeybee (``pos_emb=True``); it is tied to the input grid the connector was built for.
Blocks are RegNet-style bottlenecks (1×1 conv, depthwise 3×3 conv, squeeze-excite, 1×1 conv)
with LayerNorm over channels and SiLU, each with a residual.
"""

from __future__ import annotations

import flax.linen as nn

from vitmm.models import common
from vitmm.models.connectors.base import MLP, DepthwiseConv, adaptive_avg_pool, check_tokens, square_side


class ResBlock(nn.Module):
    width: int

    @nn.compact
    def __call__(self, x):  # x: [B, h, w, C]
        y = nn.silu(nn.LayerNorm(name="norm1")(nn.Conv(self.width, (1, 1), name="conv1")(x)))
        y = DepthwiseConv(self.width, name="conv2")(y)
        y = nn.silu(nn.LayerNorm(name="norm2")(y))
        se = y.mean(axis=(1, 2), keepdims=True)
        se = nn.Conv(max(self.width // 4, 1), (1, 1), name="se_reduce")(se)
        se = nn.sigmoid(nn.Conv(self.width, (1, 1), name="se_expand")(nn.silu(se)))
        y = nn.LayerNorm(name="norm3")(nn.Conv(self.width, (1, 1), name="conv3")(y * se))
        if x.shape[-1] != self.width:
            x = nn.Conv(self.width, (1, 1), name="shortcut")(x)
        return nn.silu(x + y)


class CAbstractor(nn.Module):
    out_dim: int
    budget: int = 64
    hidden: int = 256
    depth: int = 3

    @staticmethod
    def tokens(budget, grid):
        return square_side(budget, "c_abstractor") ** 2

    @nn.compact
    def __call__(self, x, grid):
        check_tokens(x, grid)
        side = square_side(self.budget, "c_abstractor")
        b, n, c = x.shape
        x = x + self.param("pos_emb", common.trunc_normal(0.02), (1, n, c))
        y = x.reshape(b, *grid, c)
        for i in range(self.depth):
            y = ResBlock(self.hidden, name=f"s1_{i}")(y)
        y = adaptive_avg_pool(y.reshape(b, n, self.hidden), grid, (side, side)).reshape(b, side, side, -1)
        for i in range(self.depth):
            y = ResBlock(self.hidden, name=f"s2_{i}")(y)
        return MLP(self.out_dim, 2, act="silu", name="readout")(y.reshape(b, side * side, self.hidden))

