"""Text transformer for two-tower models: token embedding, learned positions, pre-LN encoder.

``pool`` picks the sequence summary:
  * ``"eot"`` (CLIP): the end-of-text token, found as the first ``eos_id`` (or, with
    ``eos_id=None``, as ``argmax(ids)``, CLIP's convention that EOT has the largest id: only
    right for a vocabulary whose EOS is its last id, such as the byte tokenizer's);
  * ``"last"`` (SigLIP): the last position, which relies on "sticky" EOS padding;
  * ``"first"``, ``"mean"`` (over non-padding tokens).
CLIP uses a causal mask with ``eot``; SigLIP is bidirectional with ``last``.
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from vitmm.models import common
from vitmm.models.transformer import REMAT_NONE, Encoder, layer_flops

TEXT_POOLS = ("eot", "last", "first", "mean")


class TextTransformer(nn.Module):
    """``ids: [B, L]`` int tokens → ``(pooled [B, D], out)``.

    ``out`` holds ``embedded`` (tokens + positions), ``block_NN``, ``encoded`` ``[B, L, D]``
    (after the final norm) and ``pooled``.
    """

    vocab_size: int
    width: int = 512
    depth: int = 12
    mlp_dim: int | None = None
    num_heads: int = 8
    max_len: int = 77
    causal: bool = True
    pool: str = "eot"
    eos_id: int | None = None
    pad_id: int = 0
    act: str = "gelu"
    norm_eps: float = 1e-6
    dropout: float = 0.0
    scan: bool = False
    remat_policy: str = REMAT_NONE
    dtype_mm: str = "float32"
    dtype_residual: str | None = None  # dtype of the residual stream (see transformer.Encoder)

    @nn.compact
    def __call__(self, ids: jnp.ndarray, *, train: bool = False):
        common.check_choice("text pool", self.pool, TEXT_POOLS)
        if ids.ndim != 2:
            raise ValueError(f"Expected token ids of shape [B, L], got shape {tuple(ids.shape)}.")
        length = ids.shape[1]
        if length > self.max_len:
            raise ValueError(f"Token sequence of length {length} exceeds max_len={self.max_len}; "
                             "tokenize with a shorter max_len or build the tower longer.")
        out = {}
        x = nn.Embed(self.vocab_size, self.width, embedding_init=common.trunc_normal(0.02),
                     name="token_embedding")(ids)
        pos = self.param("pos_embedding", common.trunc_normal(0.01), (1, self.max_len, self.width))
        x = x + pos[:, :length]
        out["embedded"] = x
        x, blocks = Encoder(
            depth=self.depth, num_heads=self.num_heads, mlp_dim=self.mlp_dim or 4 * self.width,
            dropout=self.dropout, act=self.act, norm_eps=self.norm_eps, is_causal=self.causal,
            scan=self.scan, remat_policy=self.remat_policy, dtype_mm=self.dtype_mm,
            dtype_residual=self.dtype_residual, name="encoder",
        )(x, deterministic=not train)
        out.update(blocks)
        out["encoded"] = x
        if self.pool == "eot":
            where = ids == self.eos_id if self.eos_id is not None else None
            index = jnp.argmax(where, axis=1) if where is not None else jnp.argmax(ids, axis=1)
            pooled = jnp.take_along_axis(x, index[:, None, None], axis=1)[:, 0]
        elif self.pool == "last":
            pooled = x[:, -1]
        elif self.pool == "first":
            pooled = x[:, 0]
        else:
            mask = (ids != self.pad_id)[..., None].astype(x.dtype)
            pooled = (x * mask).sum(1) / jnp.maximum(mask.sum(1), 1.0)
        out["pooled"] = pooled
        return pooled, out


def forward_flops(width: int, depth: int, mlp_dim: int, length: int) -> int:
    """Analytic forward FLOPs of one text sequence of ``length`` tokens through the encoder
    (the embedding lookup, final norm and projection are ignored)."""
    return depth * layer_flops(length, width, mlp_dim)
