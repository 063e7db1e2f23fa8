"""Pre-LN transformer pieces shared by the ViT, the text tower and the heads.

``Encoder`` runs ``depth`` blocks either as a Python loop (parameters ``block_00`` …) or with
``nn.scan`` (parameters ``blocks/…`` stacked on a leading layer axis, one compiled block).
``stack_blocks``/``unstack_blocks`` convert parameters between the two layouts, so a checkpoint
trained one way loads the other way (tested: both give the same output).
"""

from __future__ import annotations

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from vitmm.models import common, layers
from vitmm.models.attention import Attention

REMAT_NONE = "none"


def drop_path(x: jnp.ndarray, rate, rng: jax.Array) -> jnp.ndarray:
    """Stochastic depth: drops whole residual branches per example, rescaling the survivors.

    ``rate`` may be a traced scalar (the scanned encoder gives each layer its own rate). At rate 1
    every branch is dropped and its gradient is zero (timm's ``drop_path``).
    """
    keep = 1.0 - rate
    mask = jax.random.bernoulli(rng, keep, (x.shape[0],) + (1,) * (x.ndim - 1))
    # Divide by 1 where nothing is kept: the output is 0 either way, but x / 0 would make the
    # untaken branch's gradient 0·∞ = NaN, which jnp.where passes on. (keep == 0) adds exactly 0
    # otherwise, so the survivors' scale is unchanged.
    return jnp.where(mask, x / (keep + (keep == 0)), jnp.zeros_like(x))


class MlpBlock(nn.Module):
    """``Dense(mlp_dim) → act → dropout → Dense(D)``."""

    mlp_dim: int
    dropout: float = 0.0
    act: str = "gelu"
    dtype_mm: str | jnp.dtype = "float32"

    @nn.compact
    def __call__(self, x: jnp.ndarray, deterministic: bool = True) -> jnp.ndarray:
        dtype = jnp.dtype(self.dtype_mm)
        init = nn.initializers.xavier_uniform()
        y = layers.Dense(self.mlp_dim, dtype=dtype, kernel_init=init, name="fc1")(x)
        y = common.activation(self.act)(y)
        y = nn.Dropout(self.dropout)(y, deterministic)
        return layers.Dense(x.shape[-1], dtype=dtype, kernel_init=init, name="fc2")(y)


class Block(nn.Module):
    """Pre-LN block: ``x + DropPath(LS(Attn(LN(x))))``, then ``x + DropPath(LS(MLP(LN(x))))``.

    ``layerscale`` (CaiT, DINOv2): when set, each branch is multiplied by a learned per-channel
    vector initialised to this value. ``scan_mode`` makes the block return ``(x, x)`` as
    ``nn.scan`` expects. ``drop_path_rate`` is this block's stochastic-depth rate (used only
    when ``use_drop_path``; it may be a traced scalar under scan).
    """

    num_heads: int
    mlp_dim: int
    dropout: float = 0.0
    layerscale: float | None = None
    qk_norm: bool = False
    act: str = "gelu"
    norm_eps: float = 1e-6
    is_causal: bool = False
    dtype_mm: str | jnp.dtype = "float32"
    attn_impl: str | None = None
    use_drop_path: bool = False
    scan_mode: bool = False

    @nn.compact
    def __call__(self, x, drop_path_rate=0.0, rope=None, mask=None, deterministic=True):
        width = x.shape[-1]

        def residual(branch, name):
            branch = nn.Dropout(self.dropout)(branch, deterministic)
            if self.layerscale is not None:
                gamma = self.param(name, nn.initializers.constant(self.layerscale), (width,))
                branch = branch * gamma
            if self.use_drop_path and not deterministic:
                branch = drop_path(branch, drop_path_rate, self.make_rng("dropout"))
            return (x + branch).astype(x.dtype)  # the stream keeps its dtype (Encoder.dtype_residual)

        y = nn.LayerNorm(epsilon=self.norm_eps, name="norm1")(x)
        y = Attention(
            self.num_heads, qk_norm=self.qk_norm, dtype_mm=self.dtype_mm, is_causal=self.is_causal,
            implementation=self.attn_impl, norm_eps=self.norm_eps, name="attn",
        )(y, rope=rope, mask=mask)
        x = residual(y, "ls1")
        y = nn.LayerNorm(epsilon=self.norm_eps, name="norm2")(x)
        y = MlpBlock(self.mlp_dim, self.dropout, self.act, self.dtype_mm, name="mlp")(y, deterministic)
        x = residual(y, "ls2")
        return (x, x) if self.scan_mode else x


class Encoder(nn.Module):
    """``depth`` pre-LN blocks and a final LayerNorm (``final_norm=False`` drops it: the model
    normalises later, e.g. a ViT with ``fc_norm``). Returns ``(x, out)``.

    ``out["block_NN"]`` holds each block's output ``[B, T, D]`` (before the final norm).
    Stochastic depth grows linearly from 0 at the first block to ``drop_path_rate`` at the last.
    ``remat_policy`` names a ``jax.checkpoint_policies`` entry (e.g. ``"nothing_saveable"``,
    ``"dots_with_no_batch_dims_saveable"``) or ``"none"``; it applies with and without scan.
    ``dtype_residual`` (e.g. ``"bfloat16"``) casts the input and keeps the residual stream
    between blocks in that dtype, halving the bytes of every norm and residual add (memory-bound
    on GPUs); None keeps the input's dtype (float32 in a ViT). The final norm returns float32.
    """

    depth: int
    num_heads: int
    mlp_dim: int
    dropout: float = 0.0
    drop_path_rate: float = 0.0
    layerscale: float | None = None
    qk_norm: bool = False
    act: str = "gelu"
    norm_eps: float = 1e-6
    is_causal: bool = False
    scan: bool = False
    remat_policy: str = REMAT_NONE
    dtype_mm: str | jnp.dtype = "float32"
    attn_impl: str | None = None
    final_norm: bool = True
    dtype_residual: str | None = None

    @nn.compact
    def __call__(self, x, rope=None, mask=None, deterministic=True):
        if self.dtype_residual is not None:
            x = x.astype(jnp.dtype(self.dtype_residual))
        block_kw = dict(
            num_heads=self.num_heads, mlp_dim=self.mlp_dim, dropout=self.dropout,
            layerscale=self.layerscale, qk_norm=self.qk_norm, act=self.act, norm_eps=self.norm_eps,
            is_causal=self.is_causal, dtype_mm=self.dtype_mm, attn_impl=self.attn_impl,
            use_drop_path=self.drop_path_rate > 0,
        )
        block_cls = Block
        if self.remat_policy != REMAT_NONE:
            if not hasattr(jax.checkpoint_policies, self.remat_policy):
                raise ValueError(
                    f"Unknown remat_policy={self.remat_policy!r}: use 'none' or a name in "
                    "jax.checkpoint_policies, e.g. 'nothing_saveable'."
                )
            block_cls = nn.remat(
                Block, prevent_cse=not self.scan, static_argnums=(5,),
                policy=getattr(jax.checkpoint_policies, self.remat_policy),
            )
        rates = np.linspace(0.0, self.drop_path_rate, self.depth) if self.depth > 1 else np.zeros(1)
        out = {}
        if self.scan:
            scanned = nn.scan(
                block_cls,
                variable_axes={"params": 0},
                split_rngs={"params": True, "dropout": True},
                in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast),
                length=self.depth,
            )
            x, per_block = scanned(name="blocks", scan_mode=True, **block_kw)(
                x, jnp.asarray(rates, jnp.float32), rope, mask, deterministic
            )
            for i in range(self.depth):
                out[f"block_{i:02d}"] = per_block[i]
        else:
            for i in range(self.depth):
                x = block_cls(name=f"block_{i:02d}", **block_kw)(
                    x, float(rates[i]), rope, mask, deterministic
                )
                out[f"block_{i:02d}"] = x
        if self.final_norm:
            x = nn.LayerNorm(epsilon=self.norm_eps, name="encoder_norm")(x)
        return x, out


_BLOCK_RE = re.compile(r"^block_(\d+)$")


def layer_flops(tokens: int, width: int, mlp_dim: int) -> int:
    """Analytic forward FLOPs of one pre-LN block on ``tokens`` tokens (2 per multiply-add):
    ``8·N·D²`` (q, k, v, out projections) ``+ 4·N·D·mlp`` (MLP) ``+ 4·N²·D`` (QKᵀ and AV);
    norms and softmax are ignored (well under 1%)."""
    return 8 * tokens * width * width + 4 * tokens * width * mlp_dim + 4 * tokens * tokens * width


def stack_blocks(encoder_params: dict) -> dict:
    """Loop layout (``block_00``…) → scan layout (``blocks`` with a leading layer axis)."""
    names = sorted(k for k in encoder_params if _BLOCK_RE.match(k))
    if not names:
        raise ValueError(f"No block_NN entries to stack among {sorted(encoder_params)}.")
    rest = {k: v for k, v in encoder_params.items() if not _BLOCK_RE.match(k)}
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *[encoder_params[n] for n in names])
    return {**rest, "blocks": stacked}


def unstack_blocks(encoder_params: dict) -> dict:
    """Scan layout (``blocks``) → loop layout (``block_00``…)."""
    if "blocks" not in encoder_params:
        raise ValueError(f"No 'blocks' entry to unstack among {sorted(encoder_params)}.")
    rest = {k: v for k, v in encoder_params.items() if k != "blocks"}
    depth = jax.tree.leaves(encoder_params["blocks"])[0].shape[0]
    for i in range(depth):
        rest[f"block_{i:02d}"] = jax.tree.map(lambda x, i=i: x[i], encoder_params["blocks"])
    return rest


class MAPHead(nn.Module):
    """Multihead attention pooling (Lee et al. 2019; big_vision's ``MAPHead``).

    One learned probe attends over the tokens; a residual MLP follows. ``[B, N, D] → [B, D]``.
    With ``num_queries=K`` the probe is repeated K times, each copy attending where its row of
    ``mask`` (``[B, 1, K, N]``, True = attend) allows: ``[B, N, D] → [B, K, D]``, one pooled
    vector per image of a packed sequence. The output is float32 whatever ``dtype_mm``.
    """

    num_heads: int
    mlp_dim: int
    act: str = "gelu"
    norm_eps: float = 1e-6
    dtype_mm: str | jnp.dtype = "float32"
    attn_impl: str | None = None  # as the encoder's (``Attention.implementation``)

    @nn.compact
    def __call__(self, x: jnp.ndarray, mask: jnp.ndarray | None = None, num_queries: int | None = None):
        b, _, d = x.shape
        probe = self.param("probe", nn.initializers.xavier_uniform(), (1, 1, d), jnp.float32)
        probe = jnp.broadcast_to(probe, (b, num_queries or 1, d))
        y = Attention(self.num_heads, dtype_mm=self.dtype_mm, implementation=self.attn_impl,
                      name="attn")(probe, kv=x, mask=mask)
        y = y.astype(jnp.float32)  # a float32 residual and pooled vector, as tok/gap read from the final norm
        z = nn.LayerNorm(epsilon=self.norm_eps, name="norm")(y)
        y = y + MlpBlock(self.mlp_dim, act=self.act, dtype_mm=self.dtype_mm, name="mlp")(z)
        return y if num_queries else y[:, 0]
