"""A small decoder-only language model in the Llama family.

RMSNorm before each sub-layer, rotary positions (1D RoPE, half-split pairing as Hugging Face
Llama), SwiGLU MLP, no biases, causal attention (or a prefix-LM mask), a final RMSNorm and an
untied output head. Takes token ids or ready-made input embeddings (the VLM passes visual
tokens that way).
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from vitmm.models import common, layers
from vitmm.models.attention import Attention


def rope_angles(positions: jnp.ndarray, head_dim: int, theta: float = 10_000.0) -> jnp.ndarray:
    """``[T, head_dim/2]`` rotation angles for integer positions (pairs k, k + head_dim/2)."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    return positions[:, None].astype(jnp.float32) * jnp.asarray(inv_freq, jnp.float32)[None]


def attention_mask(length: int, prefix_len: jnp.ndarray | int | None = None) -> jnp.ndarray:
    """Boolean ``[B or 1, 1, T, T]``: causal, plus full attention inside the first ``prefix_len``
    positions when given (prefix-LM: image and prompt see each other both ways)."""
    i = jnp.arange(length)
    causal = i[:, None] >= i[None, :]
    if prefix_len is None:
        return causal[None, None]
    prefix_len = jnp.asarray(prefix_len).reshape(-1, 1, 1, 1)
    both_in_prefix = (i[None, None, :, None] < prefix_len) & (i[None, None, None, :] < prefix_len)
    return causal[None, None] | both_in_prefix


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) · up(x))``, bias-free; output width ``out_dim`` (default: the input's)."""

    mlp_dim: int
    dtype_mm: str = "float32"
    out_dim: int | None = None

    @nn.compact
    def __call__(self, x):
        dense = lambda n, name: layers.Dense(n, use_bias=False, dtype=self.dtype_mm,  # noqa: E731
                                             kernel_init=common.trunc_normal(0.02), name=name)
        hidden = nn.silu(dense(self.mlp_dim, "gate")(x)) * dense(self.mlp_dim, "up")(x)
        return dense(self.out_dim or x.shape[-1], "down")(hidden)


class LMBlock(nn.Module):
    num_heads: int
    mlp_dim: int
    norm_eps: float = 1e-6
    dtype_mm: str = "float32"

    @nn.compact
    def __call__(self, x, rope, mask):
        y = nn.RMSNorm(epsilon=self.norm_eps, name="attn_norm")(x)
        x = x + Attention(self.num_heads, use_bias=False, dtype_mm=self.dtype_mm, name="attn")(
            y, rope=rope, mask=mask)
        y = nn.RMSNorm(epsilon=self.norm_eps, name="mlp_norm")(x)
        return x + SwiGLU(self.mlp_dim, self.dtype_mm, name="mlp")(y)


class LM(nn.Module):
    """``__call__(ids=None, embeds=None, prefix_len=None) -> logits [B, T, vocab]``.

    ``embed(ids)`` gives the input embeddings, so a caller can splice other tokens in.
    """

    vocab_size: int = 259
    width: int = 256
    depth: int = 4
    num_heads: int = 4
    mlp_dim: int | None = None
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-6
    dtype_mm: str = "float32"

    def setup(self):
        self.token_embedding = nn.Embed(self.vocab_size, self.width,
                                        embedding_init=common.trunc_normal(0.02))
        self.blocks = [LMBlock(self.num_heads, self.mlp_dim or int(8 * self.width / 3) // 8 * 8,
                               self.norm_eps, self.dtype_mm, name=f"block_{i:02d}")
                       for i in range(self.depth)]
        self.final_norm = nn.RMSNorm(epsilon=self.norm_eps)
        self.head = layers.Dense(self.vocab_size, use_bias=False, kernel_init=common.trunc_normal(0.02))

    def embed(self, ids: jnp.ndarray) -> jnp.ndarray:
        return self.token_embedding(ids)

    def __call__(self, ids: jnp.ndarray | None = None, embeds: jnp.ndarray | None = None,
                 prefix_len=None) -> jnp.ndarray:
        if (ids is None) == (embeds is None):
            raise ValueError("Pass exactly one of ids [B, T] or embeds [B, T, D].")
        x = self.embed(ids) if embeds is None else embeds
        t = x.shape[1]
        rope = rope_angles(jnp.arange(t), self.width // self.num_heads, self.rope_theta)
        mask = attention_mask(t, prefix_len)
        for block in self.blocks:
            x = block(x, rope, mask)
        return self.head(self.final_norm(x)).astype(jnp.float32)



def forward_flops(lm_config: dict, seq_len: int) -> float:
    """Forward FLOPs of one sequence of ``seq_len`` input embeddings through the LM (XLA's count
    of the compiled program: blocks, final norm and the vocabulary head)."""
    model = LM(**lm_config)
    x = jnp.zeros((1, seq_len, model.width), jnp.float32)
    _, flops = common.traced_cost(lambda k, x: model.init(k, embeds=x), lambda p, x: model.apply(p, embeds=x), x)
    return flops
