"""Qwen-VL's position-aware cross-attention resampler ("VL adapter").

M learned queries (trunc-normal 0.02, M = side²) attend once to the patch tokens: keys and
values are projected (no bias) and LayerNorm-ed, queries LayerNorm-ed; fixed 2D sin-cos
positions (MAE frequencies, as Qwen-VL's ``get_2d_sincos_pos_embed``) are added to queries
(their side×side grid) and keys (the query grid resized to the actual patch grid as Qwen-VL's
``get_abs_pos`` does it: torch bicubic without anti-aliasing)
but not to values; one multi-head attention; then LayerNorm and a projection. No FFN, no
residual, no self-attention among queries.
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from vitmm.models import common, layers, posemb
from vitmm.models.connectors.base import check_tokens, mha
from vitmm.models.connectors.budget import square_side


class QwenResampler(nn.Module):
    out_dim: int
    budget: int = 64
    head_dim: int = 128
    width: int | None = None  # attention width; default out_dim

    @staticmethod
    def tokens(budget, grid, **settings):
        return square_side(budget, "qwen_resampler") ** 2

    @nn.compact
    def __call__(self, x, grid):
        check_tokens(x, grid)
        side = square_side(self.budget, "qwen_resampler")
        d = self.width or self.out_dim
        if d % 4:  # its 2D sin-cos positions: sin/cos x rows/cols
            raise ValueError(f"qwen_resampler needs an attention width divisible by 4 (its 2D sin-cos positions), "
                             f"got {d}: set the connector's width to a multiple of 4.")
        heads = max(d // self.head_dim, 1)
        query = self.param("query", common.trunc_normal(0.02), (side * side, d))
        pos_q = posemb.sincos_2d(side, side, d, convention="mae")
        pos_k = posemb.resample_grid(pos_q.reshape(side, side, d), grid, "torch_bicubic").reshape(grid[0] * grid[1], d)
        kv = nn.LayerNorm(epsilon=1e-6, name="ln_kv")(
            layers.Dense(d, use_bias=False, kernel_init=common.trunc_normal(0.02), name="kv_proj")(x))
        q = nn.LayerNorm(epsilon=1e-6, name="ln_q")(query)
        q = jnp.broadcast_to(q + pos_q, (x.shape[0], *q.shape))
        out = mha(q, kv + pos_k, kv, heads, "attn")
        out = nn.LayerNorm(epsilon=1e-6, name="ln_post")(out)
        return layers.Dense(self.out_dim, use_bias=False, kernel_init=common.trunc_normal(0.02), name="proj")(out)
