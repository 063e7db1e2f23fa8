"""BLIP-2's Q-Former (transformers' ``Blip2QFormerModel``), small by default, then BLIP-2's
``language_projection`` to the LM width.

``ln_vision`` normalises the image features (BLIP-2's ``ln_vision``, transformers'
``post_layernorm`` of the vision tower); the learned queries are LayerNorm-ed (the Q-Former's
``layernorm``); each layer is BERT's post-LN: self-attention among the queries, cross-attention
from the queries to the image features every ``cross_attention_freq`` layers (keys and values
projected straight from the vision width, as BLIP-2), and the queries' feed-forward (GELU).
Parity with transformers' implementation is tested on stored outputs. Not included: BLIP-2's
text input to the Q-Former (only its queries reach the LM) and dropout.
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from vitmm.models import common, layers
from vitmm.models.connectors.base import check_tokens, mha
from vitmm.models.connectors.budget import latent_count

BERT_EPS = 1e-12


class QFormer(nn.Module):
    out_dim: int
    budget: int = 32
    depth: int = 2
    width: int = 256
    head_dim: int = 64
    cross_attention_freq: int = 2
    vision_eps: float = 1e-6  # transformers' Blip2VisionConfig; LAVIS's ln_vision used 1e-5

    @staticmethod
    def tokens(budget, grid, **settings):
        return latent_count(budget, "qformer", "queries")

    @nn.compact
    def __call__(self, x, grid):
        check_tokens(x, grid)
        m = self.tokens(self.budget, grid)
        d, heads = self.width, max(self.width // self.head_dim, 1)
        img = nn.LayerNorm(epsilon=self.vision_eps, name="ln_vision")(x)
        q = self.param("queries", common.trunc_normal(0.02), (m, d))
        q = nn.LayerNorm(epsilon=BERT_EPS, name="query_norm")(jnp.broadcast_to(q, (x.shape[0], m, d)))
        for i in range(self.depth):
            q = nn.LayerNorm(epsilon=BERT_EPS, name=f"sa_norm_{i}")(q + mha(q, q, q, heads, f"self_{i}"))
            if i % self.cross_attention_freq == 0:
                q = nn.LayerNorm(epsilon=BERT_EPS, name=f"ca_norm_{i}")(q + mha(q, img, img, heads, f"cross_{i}"))
            y = layers.Dense(4 * d, name=f"ff_in_{i}")(q)
            y = layers.Dense(d, name=f"ff_out_{i}")(common.activation("gelu")(y))
            q = nn.LayerNorm(epsilon=BERT_EPS, name=f"ff_norm_{i}")(q + y)
        return layers.Dense(self.out_dim, kernel_init=common.trunc_normal(0.02), name="out_proj")(q)
