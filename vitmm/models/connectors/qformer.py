"""A small BLIP-2-style Q-Former: learned queries, self-attention in every layer and
cross-attention to the patches every other layer (``cross_attention_freq=2``), BERT's post-LN
residuals, then a projection to the LM width (BLIP-2's ``opt_proj``)."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from vitmm.models import common, layers
from vitmm.models.connectors.base import BudgetError, check_tokens, mha


class QFormer(nn.Module):
    out_dim: int
    budget: int = 32
    depth: int = 2
    width: int = 256
    head_dim: int = 64
    cross_attention_freq: int = 2

    @staticmethod
    def tokens(budget, grid):
        if not isinstance(budget, int) or budget < 1:
            raise BudgetError(f"qformer needs a positive integer number of queries, got {budget!r}.")
        return budget

    @nn.compact
    def __call__(self, x, grid):
        check_tokens(x, grid)
        m = self.tokens(self.budget, grid)
        d, heads = self.width, max(self.width // self.head_dim, 1)
        img = layers.Dense(d, kernel_init=common.trunc_normal(0.02), name="img_proj")(x)
        q = self.param("queries", common.trunc_normal(0.02), (m, d))
        q = jnp.broadcast_to(q, (x.shape[0], m, d))
        for i in range(self.depth):
            q = nn.LayerNorm(epsilon=1e-12, name=f"sa_norm_{i}")(q + mha(q, q, q, heads, f"self_{i}"))
            if i % self.cross_attention_freq == 0:
                q = nn.LayerNorm(epsilon=1e-12, name=f"ca_norm_{i}")(q + mha(q, img, img, heads, f"cross_{i}"))
            y = layers.Dense(4 * d, name=f"ff_in_{i}")(q)
            y = layers.Dense(d, name=f"ff_out_{i}")(common.activation("gelu")(y))
            q = nn.LayerNorm(epsilon=1e-12, name=f"ff_norm_{i}")(q + y)
        return layers.Dense(self.out_dim, kernel_init=common.trunc_normal(0.02), name="out_proj")(q)
