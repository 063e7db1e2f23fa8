"""Honeybee's C-Abstractor: residual conv blocks, adaptive average pooling to side×side,
residual conv blocks, then a Linear → SiLU → Linear readout.

A learned absolute position table (trunc-normal 0.02) is added to the input features first,
as in Honeybee (``pos_emb=True``); it is tied to the input grid the connector was built for.
Blocks are timm's RegNet ``Bottleneck`` as Honeybee builds its ``RegStage`` (bottleneck ratio 1,
depthwise 3×3, squeeze-excite to ``round(in_channels / 4)`` channels, LayerNorm over channels
with eps 1e-5, SiLU): bias-free convs, each followed by its norm, and a shortcut that is the identity or,
when the width changes, timm's ``downsample_conv`` (a bias-free 1×1 conv and its norm).
Parity with timm's ``RegStage`` is tested on stored outputs.
"""

from __future__ import annotations

import flax.linen as nn

from vitmm.models import common, layers
from vitmm.models.connectors.base import MLP, DepthwiseConv, adaptive_avg_pool, check_tokens
from vitmm.models.connectors.budget import square_side


class ResBlock(nn.Module):
    width: int

    @nn.compact
    def __call__(self, x):  # x: [B, h, w, C]
        conv = lambda n, name: nn.Conv(n, (1, 1), use_bias=False, name=name)  # noqa: E731
        # timm's ConvNormAct turns Honeybee's LayerNorm2d into LayerNormAct2d, whose eps is 1e-5.
        norm = lambda name: layers.LayerNorm(epsilon=1e-5, name=name)  # noqa: E731 - flax's, its gradient faster on CPU
        y = nn.silu(norm("norm1")(conv(self.width, "conv1")(x)))
        y = nn.silu(norm("norm2")(DepthwiseConv(self.width, use_bias=False, name="conv2")(y)))
        se = y.mean(axis=(1, 2), keepdims=True)
        se = nn.Conv(max(round(x.shape[-1] / 4), 1), (1, 1), name="se_reduce")(se)
        se = nn.sigmoid(nn.Conv(self.width, (1, 1), name="se_expand")(nn.silu(se)))
        y = norm("norm3")(conv(self.width, "conv3")(y * se))
        if x.shape[-1] != self.width:
            x = norm("shortcut_norm")(conv(self.width, "shortcut")(x))
        return nn.silu(x + y)


class CAbstractor(nn.Module):
    out_dim: int
    budget: int = 64
    hidden: int = 256
    depth: int = 3

    @staticmethod
    def tokens(budget, grid, **settings):
        return square_side(budget, "c_abstractor") ** 2

    @staticmethod
    def token_grid(budget, grid, **settings):
        return (square_side(budget, "c_abstractor"),) * 2

    @nn.compact
    def __call__(self, x, grid):
        check_tokens(x, grid)
        side = square_side(self.budget, "c_abstractor")
        b, n, c = x.shape
        if self.has_variable("params", "pos_emb") and self.get_variable("params", "pos_emb").shape[1] != n:
            built = self.get_variable("params", "pos_emb").shape[1]
            raise ValueError(f"c_abstractor's position table was built for {built} input tokens, not the {n} of grid "
                             f"{tuple(grid)}: give it images of the size it was built for, or use a connector "
                             "without one (e.g. pixel_shuffle, pool).")
        x = x + self.param("pos_emb", common.trunc_normal(0.02), (1, n, c))
        y = x.reshape(b, *grid, c)
        for i in range(self.depth):
            y = ResBlock(self.hidden, name=f"s1_{i}")(y)
        width = y.shape[-1]  # hidden, or the tower's with depth=0 (Honeybee's pooling and readout only)
        y = adaptive_avg_pool(y.reshape(b, n, width), grid, (side, side)).reshape(b, side, side, width)
        for i in range(self.depth):
            y = ResBlock(self.hidden, name=f"s2_{i}")(y)
        return MLP(self.out_dim, 2, act="silu", name="readout")(y.reshape(b, side * side, width))

