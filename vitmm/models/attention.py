"""Multi-head attention on top of ``jax.nn.dot_product_attention``.

Self-attention uses one fused ``qkv`` projection (kernel ``[D, 3·D]``, output laid out as
``(q|k|v, head, head_dim)``, the layout of timm/open_clip's ``qkv`` weight) because one large
matmul is cheaper than three small ones. Cross-attention (``kv`` given) projects queries with
``q`` and keys/values with a fused ``kv``.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from vitmm.models import posemb

ATTENTION_IMPLS = (None, "xla", "cudnn")


class Attention(nn.Module):
    """Multi-head dot-product attention.

    Attributes:
      num_heads: number of heads; the width must divide evenly.
      qk_norm: LayerNorm over the head dim of queries and keys (ViT-22B, timm ``qk_norm``).
      use_bias: biases on the projections.
      dtype_mm: compute dtype of the projections and the attention itself.
      is_causal: causal mask (text tower, LM).
      implementation: passed to ``jax.nn.dot_product_attention`` (None lets JAX choose).
      norm_eps: epsilon of the qk LayerNorms.
    """

    num_heads: int
    qk_norm: bool = False
    use_bias: bool = True
    dtype_mm: str | jnp.dtype = "float32"
    is_causal: bool = False
    implementation: str | None = None
    norm_eps: float = 1e-6

    @nn.compact
    def __call__(
        self,
        x: jnp.ndarray,
        kv: jnp.ndarray | None = None,
        *,
        rope: jnp.ndarray | None = None,
        mask: jnp.ndarray | None = None,
    ) -> jnp.ndarray:
        """``x: [B, T, D]`` (queries), ``kv: [B, S, D]`` (defaults to ``x``) → ``[B, T, D]``.

        ``rope``: rotation angles ``[T, head_dim/2]`` for self-attention (see ``posemb``).
        ``mask``: boolean, broadcastable to ``[B, heads, T, S]``; True means attend.
        """
        width = x.shape[-1]
        if width % self.num_heads:
            raise ValueError(f"Width {width} is not divisible by num_heads={self.num_heads}.")
        head_dim = width // self.num_heads
        dtype = jnp.dtype(self.dtype_mm)
        dense = lambda features, name: nn.Dense(  # noqa: E731
            features, use_bias=self.use_bias, dtype=dtype, name=name,
            kernel_init=nn.initializers.xavier_uniform(),
        )
        b, t = x.shape[:2]
        if kv is None:
            qkv = dense(3 * width, "qkv")(x).reshape(b, t, 3, self.num_heads, head_dim)
            q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        else:
            s = kv.shape[1]
            q = dense(width, "q")(x).reshape(b, t, self.num_heads, head_dim)
            kv_proj = dense(2 * width, "kv")(kv).reshape(b, s, 2, self.num_heads, head_dim)
            k, v = kv_proj[:, :, 0], kv_proj[:, :, 1]
        if self.qk_norm:
            q = nn.LayerNorm(epsilon=self.norm_eps, name="q_norm")(q)
            k = nn.LayerNorm(epsilon=self.norm_eps, name="k_norm")(k)
        if rope is not None:
            if kv is not None:
                raise ValueError("RoPE is only defined here for self-attention.")
            q, k = posemb.apply_rope(q, rope), posemb.apply_rope(k, rope)
        q, k, v = (a.astype(dtype) for a in (q, k, v))
        out = jax.nn.dot_product_attention(
            q, k, v, mask=mask, is_causal=self.is_causal, implementation=self.implementation
        )
        return dense(width, "out")(out.reshape(b, t, width))
