"""Perceiver resamplers: M learned latents attend to [patches; latents], ``depth`` layers.

``Perceiver`` is Flamingo's: each layer LayerNorms the media and the latents, the latents
query keys/values from their concatenation (residual), then a bias-free FFN (LayerNorm →
Dense 4D → GELU → Dense D, residual); a final LayerNorm (eps 1e-5). The patches are first
projected to the LM width D by one Dense layer (OpenFlamingo's resampler works at the vision
width and the LM cross-attends to it). No spatial positions (as in OpenFlamingo). Parity with
OpenFlamingo's own ``PerceiverResampler`` (after that projection) is tested on stored outputs.

``Idefics2Perceiver`` is Idefics2's connector (transformers' ``Idefics2Connector``): a SwiGLU
``modality_projection`` to D, then the same pattern with RMSNorm, grouped-query attention
(``num_kv_heads``), a bias-free SwiGLU FFN of width 4D and a final RMSNorm. Parity with
transformers' module is tested on stored outputs. One deviation: transformers initialises
every latent to 1, so at initialisation all M output tokens are equal (only the LM's
position-dependent gradients tell them apart); vitmm draws them from a standard normal, as
Flamingo does.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from vitmm.models import common, layers
from vitmm.models.connectors.base import check_tokens, mha
from vitmm.models.connectors.budget import latent_count
from vitmm.models.lm import SwiGLU


class Perceiver(nn.Module):
    out_dim: int
    budget: int = 64
    depth: int = 2
    head_dim: int = 64
    num_heads: int | None = None  # default out_dim // head_dim (attention as wide as the output); OpenFlamingo: 8
    ff_mult: int = 4
    eps: float = 1e-5  # torch's LayerNorm default, which Flamingo/OpenFlamingo use

    @staticmethod
    def tokens(budget, grid, **settings):
        return latent_count(budget, "perceiver")

    @nn.compact
    def __call__(self, x, grid):
        check_tokens(x, grid)
        m = self.tokens(self.budget, grid)
        d = self.out_dim
        heads = self.num_heads or max(d // self.head_dim, 1)
        head_dim = self.head_dim if self.num_heads else None
        x = layers.Dense(d, kernel_init=common.trunc_normal(0.02), name="in_proj")(x)
        latents = self.param("latents", nn.initializers.normal(1.0), (m, d))
        latents = jnp.broadcast_to(latents, (x.shape[0], m, d))
        for i in range(self.depth):
            media = nn.LayerNorm(epsilon=self.eps, name=f"norm_media_{i}")(x)
            lat = nn.LayerNorm(epsilon=self.eps, name=f"norm_latents_{i}")(latents)
            kv = jnp.concatenate([media, lat], axis=1)
            latents = latents + mha(lat, kv, kv, heads, f"attn_{i}", use_bias=False, head_dim=head_dim)
            y = nn.LayerNorm(epsilon=self.eps, name=f"ff_norm_{i}")(latents)
            y = layers.Dense(self.ff_mult * d, use_bias=False, name=f"ff_in_{i}")(y)
            y = layers.Dense(d, use_bias=False, name=f"ff_out_{i}")(common.activation("gelu")(y))
            latents = latents + y
        return nn.LayerNorm(epsilon=self.eps, name="norm_out")(latents)


class Idefics2Perceiver(nn.Module):
    """Defaults are Idefics2-8B's shape scaled to a small LM: 3 layers, 64-wide heads (8B: 16
    heads of 96, 4 KV heads, projection width 14336 for D = 4096)."""

    out_dim: int
    budget: int = 64
    depth: int = 3
    head_dim: int = 64
    num_heads: int | None = None  # default: out_dim // head_dim
    num_kv_heads: int | None = None  # default: num_heads (no grouping)
    proj_dim: int | None = None  # modality projection's hidden width, default 4·out_dim
    eps: float = 1e-6

    @staticmethod
    def tokens(budget, grid, **settings):
        return latent_count(budget, "idefics2_perceiver")

    @nn.compact
    def __call__(self, x, grid):
        check_tokens(x, grid)
        m = self.tokens(self.budget, grid)
        d, hd = self.out_dim, self.head_dim
        heads = self.num_heads or max(d // hd, 1)
        kv_heads = self.num_kv_heads or heads
        if heads % kv_heads:
            raise ValueError(f"idefics2_perceiver: num_heads={heads} is not a multiple of num_kv_heads={kv_heads}.")
        dense = lambda n, name: layers.Dense(n, use_bias=False, kernel_init=common.trunc_normal(0.02),  # noqa: E731
                                             name=name)
        context = SwiGLU(self.proj_dim or 4 * d, out_dim=d, name="modality_projection")(x)
        latents = self.param("latents", nn.initializers.normal(1.0), (m, d))
        latents = jnp.broadcast_to(latents, (x.shape[0], m, d))
        for i in range(self.depth):
            lat = nn.RMSNorm(epsilon=self.eps, name=f"norm_latents_{i}")(latents)
            kv = jnp.concatenate([nn.RMSNorm(epsilon=self.eps, name=f"norm_context_{i}")(context), lat], axis=1)
            split = lambda y, n: y.reshape(*y.shape[:2], n, hd)  # noqa: E731
            att = jax.nn.dot_product_attention(split(dense(heads * hd, f"attn_{i}_q")(lat), heads),
                                               split(dense(kv_heads * hd, f"attn_{i}_k")(kv), kv_heads),
                                               split(dense(kv_heads * hd, f"attn_{i}_v")(kv), kv_heads))
            latents = latents + dense(d, f"attn_{i}_out")(att.reshape(*att.shape[:2], heads * hd))
            y = nn.RMSNorm(epsilon=self.eps, name=f"ff_norm_{i}")(latents)
            latents = latents + SwiGLU(4 * d, name=f"ff_{i}")(y)
        return nn.RMSNorm(epsilon=self.eps, name="norm_out")(latents)
