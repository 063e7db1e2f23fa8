"""Flamingo's Perceiver resampler: M latents attend to [patches; latents], ``depth`` layers.

Each layer: LayerNorm the media and the latents, latents query keys/values from their
concatenation, residual; then a bias-free FFN (LayerNorm → Dense 4D → GELU → Dense D),
residual. A final LayerNorm. Latents start as standard normals (Flamingo's ``randn``). The
patches are first projected to the LM width D. No spatial positions (as in OpenFlamingo).
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from vitmm.models import common, layers
from vitmm.models.connectors.base import check_tokens, mha


class Perceiver(nn.Module):
    out_dim: int
    budget: int = 64
    depth: int = 2
    head_dim: int = 64
    ff_mult: int = 4

    @staticmethod
    def tokens(budget, grid):
        from vitmm.models.connectors.base import BudgetError

        if not isinstance(budget, int) or budget < 1:
            raise BudgetError(f"perceiver needs a positive integer number of latents, got {budget!r}.")
        return budget

    @nn.compact
    def __call__(self, x, grid):
        check_tokens(x, grid)
        m = self.tokens(self.budget, grid)
        d = self.out_dim
        heads = max(d // self.head_dim, 1)
        x = layers.Dense(d, kernel_init=common.trunc_normal(0.02), name="in_proj")(x)
        latents = self.param("latents", nn.initializers.normal(1.0), (m, d))
        latents = jnp.broadcast_to(latents, (x.shape[0], m, d))
        for i in range(self.depth):
            media = nn.LayerNorm(name=f"norm_media_{i}")(x)
            lat = nn.LayerNorm(name=f"norm_latents_{i}")(latents)
            kv = jnp.concatenate([media, lat], axis=1)
            latents = latents + mha(lat, kv, kv, heads, f"attn_{i}", use_bias=False)
            y = nn.LayerNorm(name=f"ff_norm_{i}")(latents)
            y = layers.Dense(self.ff_mult * d, use_bias=False, name=f"ff_in_{i}")(y)
            y = layers.Dense(d, use_bias=False, name=f"ff_out_{i}")(common.activation("gelu")(y))
            latents = latents + y
        return nn.LayerNorm(name="norm_out")(latents)
