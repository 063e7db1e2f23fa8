"""Multi-head attention on top of ``jax.nn.dot_product_attention``.

Self-attention uses one fused ``qkv`` projection (kernel ``[D, 3·D]``, output laid out as
``(q|k|v, head, head_dim)``, the layout of timm/open_clip's ``qkv`` weight) because one large
matmul is cheaper than three small ones. Cross-attention (``kv`` given) projects queries with
``q`` and keys/values with a fused ``kv``.

The attention itself: ``implementation="matmul"`` is softmax attention written heads-first with
two batched matmuls, normalised after the second one, and a hand-written (FlashAttention-style)
backward (``heads_first_attention``); ``"xla"``/``"cudnn"`` go to ``jax.nn.dot_product_attention``.
The default (None) is ``"matmul"`` on CPU, where it is faster than ``jax.nn.dot_product_attention``'s
XLA path, and JAX's own choice elsewhere.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from vitmm.models import layers, posemb

ATTENTION_IMPLS = (None, "matmul", "xla", "cudnn")


def matmul_attention(q, k, v, mask=None, is_causal: bool = False):
    """Softmax attention, ``q: [B, T, N, H]``, ``k, v: [B, S, N, H]`` → ``[B, T, N, H]``, the
    semantics of ``jax.nn.dot_product_attention`` (scale ``H**-0.5``; ``mask`` True = attend,
    broadcastable to ``[B, N, T, S]``; ``is_causal`` aligned top-left), computed heads-first with
    two batched matmuls and a hand-written backward (``heads_first_attention``); logits and softmax
    statistics in float32."""
    qh, kh, vh = (jnp.swapaxes(a, 1, 2) for a in (q, k, v))
    return jnp.swapaxes(heads_first_attention(qh, kh, vh, mask=mask, is_causal=is_causal), 1, 2)


def heads_first_attention(q, k, v, mask=None, is_causal: bool = False):
    """``matmul_attention`` on heads-first arrays: ``q: [B, N, T, H]``, ``k, v: [B, N, S, H]`` →
    ``[B, N, T, H]``."""
    if is_causal:
        causal = jnp.tril(jnp.ones((q.shape[2], k.shape[2]), bool))
        mask = causal if mask is None else jnp.logical_and(mask, causal)
    return _heads_first(q, k, v, mask)  # the mask stays as small as it came: jnp.where broadcasts it


def _scores(q, k, mask):
    """Row-max-shifted unnormalised probabilities ``e = exp(s - max s)`` and their row sums, with
    ``s = q·kᵀ`` (``q`` already scaled).

    ``kᵀ`` is materialised behind an optimisation barrier: XLA would otherwise fold the transpose
    into the dot, and XLA:CPU's batched product contracting both operands' last axis is slower
    than the plain ``[T, H]·[H, S]`` form."""
    kt = jax.lax.optimization_barrier(jnp.swapaxes(k, -1, -2))
    logits = jnp.matmul(q, kt, preferred_element_type=jnp.float32)
    if mask is not None:
        logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
    e = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
    return e, jnp.sum(e, axis=-1, keepdims=True)


def attention_probs(q, k, mask=None, is_causal: bool = False, heads_first: bool = False):
    """The softmax attention weights ``[B, N, T, S]`` (float32) of ``q``, ``k`` in either layout
    (``[B, T, N, H]``, or ``[B, N, T, H]`` with ``heads_first``): what ``Attention`` sows as
    ``intermediates/…/attention`` when applied with ``mutable=["intermediates"]``."""
    if not heads_first:
        q, k = jnp.swapaxes(q, 1, 2), jnp.swapaxes(k, 1, 2)
    if is_causal:
        causal = jnp.tril(jnp.ones((q.shape[2], k.shape[2]), bool))
        mask = causal if mask is None else jnp.logical_and(mask, causal)
    e, z = _scores(q.astype(jnp.float32) * _scale(q), k.astype(jnp.float32), mask)
    return e / z


def _scale(q):
    return q.shape[-1] ** -0.5


@jax.custom_vjp
def _heads_first(q, k, v, mask):
    return _heads_first_fwd(q, k, v, mask)[0]


def _heads_first_fwd(q, k, v, mask):
    # The scale goes on q ([T, H]) rather than on the logits ([T, S]): one pass over the [T, S]
    # array fewer, bit-identical when it is a power of two (head dim 64: 1/8). Normalising after
    # the second matmul ([T, H] divisions instead of [T, S]) is what makes the forward fast; a
    # row with every key masked gets uniform weights, as in jax.nn.softmax.
    qs = q * jnp.asarray(_scale(q), q.dtype)
    e, denom = _scores(qs, k, mask)
    out = (jnp.matmul(e.astype(v.dtype), v, preferred_element_type=jnp.float32) / denom).astype(v.dtype)
    return out, (qs, k, v, mask, e, denom, out)


def _heads_first_bwd(res, d_out):
    # With o = e·v / l (l the row sums of e): dv = eᵀ·g with g = d_out / l, and the logits'
    # gradient is e ∘ (g·vᵀ − rowsum(g ∘ o)) — FlashAttention's backward, without the
    # [T, S] softmax Jacobian pass that autodiff of the normalised form needs. q's gradient
    # carries the scale that the forward put on q (the products use the scaled qs).
    qs, k, v, mask, e, denom, out = res
    g = d_out.astype(jnp.float32) / denom
    dv = jnp.matmul(jnp.swapaxes(e, -1, -2).astype(v.dtype), g.astype(v.dtype), preferred_element_type=jnp.float32)
    d_logits = jnp.matmul(g.astype(v.dtype), jnp.swapaxes(v, -1, -2), preferred_element_type=jnp.float32)
    d_logits = e * (d_logits - jnp.sum(g * out.astype(jnp.float32), axis=-1, keepdims=True))
    if mask is not None:  # a masked logit has no gradient (zero already, e = 0, save in a row with every key masked)
        d_logits = jnp.where(mask, d_logits, 0.0)
    d_logits = d_logits.astype(qs.dtype)
    dq = jnp.matmul(d_logits, k, preferred_element_type=jnp.float32) * _scale(qs)
    dk = jnp.matmul(jnp.swapaxes(d_logits, -1, -2), qs, preferred_element_type=jnp.float32)
    d_mask = None if mask is None else np.zeros(mask.shape, jax.dtypes.float0)
    return dq.astype(qs.dtype), dk.astype(k.dtype), dv.astype(v.dtype), d_mask


_heads_first.defvjp(_heads_first_fwd, _heads_first_bwd)


class Attention(nn.Module):
    """Multi-head dot-product attention.

    Attributes:
      num_heads: number of heads; the width must divide evenly.
      qk_norm: LayerNorm over the head dim of queries and keys (ViT-22B, timm ``qk_norm``).
      use_bias: biases on the projections.
      dtype_mm: compute dtype of the projections and the attention itself.
      is_causal: causal mask (text tower, LM).
      implementation: ``"matmul"`` (``matmul_attention``), or ``"xla"``/``"cudnn"`` for
        ``jax.nn.dot_product_attention``; None: ``"matmul"`` on CPU, JAX's choice elsewhere.
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
        dense = lambda features, name: layers.Dense(  # noqa: E731
            features, use_bias=self.use_bias, dtype=dtype, name=name,
            kernel_init=nn.initializers.xavier_uniform(),
        )
        if self.implementation not in ATTENTION_IMPLS:
            raise ValueError(f"Attention implementation {self.implementation!r} is not one of {ATTENTION_IMPLS}.")
        impl = self.implementation
        if impl is None and layers.platform() == "cpu":
            impl = "matmul"
        # "matmul" works heads-first ([B, heads, T, head_dim]); the projections are laid out
        # token-major, so it moves q, k and v there with one transpose (and its gradient back with
        # one), and the output with another. jax.nn.dot_product_attention takes [B, T, heads, hd].
        heads_first = impl == "matmul"
        b, t = x.shape[:2]

        def split(proj, tokens, parts):
            proj = proj.reshape(b, tokens, parts, self.num_heads, head_dim)
            if heads_first:
                proj = jnp.transpose(proj, (2, 0, 3, 1, 4))  # [parts, B, heads, tokens, hd]
            axis = 0 if heads_first else 2
            # split (not indexing): its transpose is one concatenate, not pads and adds
            return [jnp.squeeze(part, axis) for part in jnp.split(proj, parts, axis=axis)]

        if kv is None:
            q, k, v = split(dense(3 * width, "qkv")(x), t, 3)
        else:
            (q,) = split(dense(width, "q")(x), t, 1)
            k, v = split(dense(2 * width, "kv")(kv), kv.shape[1], 2)
        if self.qk_norm:
            q = nn.LayerNorm(epsilon=self.norm_eps, name="q_norm")(q)
            k = nn.LayerNorm(epsilon=self.norm_eps, name="k_norm")(k)
        if rope is not None:
            if kv is not None:
                raise ValueError("RoPE is only defined here for self-attention.")
            seq_axis = 2 if heads_first else 1
            q, k = posemb.apply_rope(q, rope, seq_axis=seq_axis), posemb.apply_rope(k, rope, seq_axis=seq_axis)
        q, k, v = (a.astype(dtype) for a in (q, k, v))
        if self.is_mutable_collection("intermediates"):  # the maps, only when asked for (costs nothing otherwise)
            self.sow("intermediates", "attention", attention_probs(q, k, mask, self.is_causal, heads_first))
        if heads_first:
            out = jnp.swapaxes(heads_first_attention(q, k, v, mask=mask, is_causal=self.is_causal), 1, 2)
        else:
            out = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=self.is_causal, implementation=impl)
        return dense(width, "out")(out.reshape(b, t, width))
