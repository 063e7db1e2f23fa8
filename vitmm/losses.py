"""Contrastive losses against the global batch, on one device or across many.

Embeddings are L2-normalised ``[n, D]``; row ``i`` of ``zimg`` pairs with row ``i`` of ``ztxt``.
The global loss over a batch of ``B`` pairs is

* softmax (CLIP, symmetric InfoNCE): ``½ [CE(t·Zi Ztᵀ, I) + CE(t·Zt Ziᵀ, I)]``, rows averaged;
* sigmoid (SigLIP): ``-(1/B) Σ_ij log σ(ℓ_ij (t·zi·zj + b))`` with ``ℓ = 2I - 1``.

Three ways to compute it on ``N`` devices, each tested equal to the one-device loss on the
global batch, forward and gradients:

* ``jit`` over a mesh: call ``softmax_loss``/``sigmoid_loss`` on globally sharded arrays and let
  XLA gather (memory O(B²) per device);
* ``pmap`` (``*_pmap``, inside ``jax.pmap(axis_name=...)``): local rows against
  ``all_gather``-ed columns. They return the **local** loss, whose ``pmean`` is the global loss
  and whose gradients, ``pmean``-ed over devices, are the global gradients (``all_gather``
  transposes to a reduce-scatter, so every device's embeddings get their share);
* chunked sigmoid (SigLIP §3.1): text blocks travel around a ring of devices with ``ppermute``;
  each device only ever holds an ``n × n`` logit block (memory O(n²)).
  ``sigmoid_loss_chunked_pmap`` for pmap (local-loss convention as above) and
  ``sigmoid_loss_chunked`` for a mesh (``jax.shard_map``; returns the global loss).

``lm_loss`` is the masked next-token loss (answer tokens only) of the VLM.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P


# ----------------------------------------------------------------------------------------------
# One device (and jit over a mesh: the same code on global arrays).
# ----------------------------------------------------------------------------------------------
def softmax_loss(zimg: jnp.ndarray, ztxt: jnp.ndarray, t, valid: jnp.ndarray | None = None) -> jnp.ndarray:
    """``valid [n]`` (packed batches: empty image slots) keeps pairs out entirely: the loss is the
    loss of the valid pairs alone (tested)."""
    logits = t * zimg @ ztxt.T
    labels = jnp.arange(zimg.shape[0])
    if valid is not None:
        logits = jnp.where(valid[:, None] & valid[None, :], logits, jnp.finfo(logits.dtype).min)
    i2t = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    t2i = optax.softmax_cross_entropy_with_integer_labels(logits.T, labels)
    if valid is None:
        return 0.5 * (i2t.mean() + t2i.mean())
    return 0.5 * masked_mean(i2t + t2i, valid)


def _sigmoid_block(zimg, ztxt, t, b, positives_on_diagonal: bool) -> jnp.ndarray:
    """Σ over the block of ``-log σ(ℓ · logit)``; ℓ = +1 on the diagonal if it holds positives."""
    logits = t * zimg @ ztxt.T + b
    if positives_on_diagonal:
        labels = 2.0 * jnp.eye(zimg.shape[0], ztxt.shape[0]) - 1.0
    else:
        labels = -jnp.ones_like(logits)
    return -jnp.sum(jax.nn.log_sigmoid(labels * logits))


def sigmoid_loss(zimg: jnp.ndarray, ztxt: jnp.ndarray, t, b, valid: jnp.ndarray | None = None) -> jnp.ndarray:
    """``valid [n]`` keeps pairs with an empty slot out (the loss of the valid pairs alone)."""
    if valid is None:
        return _sigmoid_block(zimg, ztxt, t, b, True) / zimg.shape[0]
    logits = t * zimg @ ztxt.T + b
    labels = 2.0 * jnp.eye(zimg.shape[0]) - 1.0
    pairs = (valid[:, None] & valid[None, :]).astype(logits.dtype)
    return -jnp.sum(pairs * jax.nn.log_sigmoid(labels * logits)) / jnp.maximum(valid.sum(), 1)


# ----------------------------------------------------------------------------------------------
# pmap: local rows against gathered columns. Local-loss convention (see module docstring).
# ----------------------------------------------------------------------------------------------
def softmax_loss_pmap(zimg, ztxt, t, axis_name: str = "batch") -> jnp.ndarray:
    n = zimg.shape[0]
    all_img = jax.lax.all_gather(zimg, axis_name, tiled=True)
    all_txt = jax.lax.all_gather(ztxt, axis_name, tiled=True)
    labels = jax.lax.axis_index(axis_name) * n + jnp.arange(n)
    i2t = optax.softmax_cross_entropy_with_integer_labels(t * zimg @ all_txt.T, labels)
    t2i = optax.softmax_cross_entropy_with_integer_labels(t * ztxt @ all_img.T, labels)
    return 0.5 * (i2t.mean() + t2i.mean())


def sigmoid_loss_pmap(zimg, ztxt, t, b, axis_name: str = "batch") -> jnp.ndarray:
    """Local images against all texts (gathered): this device's rows of the global loss."""
    n = zimg.shape[0]
    all_txt = jax.lax.all_gather(ztxt, axis_name, tiled=True)
    logits = t * zimg @ all_txt.T + b
    offset = jax.lax.axis_index(axis_name) * n
    labels = 2.0 * (jnp.arange(all_txt.shape[0])[None, :] == offset + jnp.arange(n)[:, None]) - 1.0
    return -jnp.sum(jax.nn.log_sigmoid(labels * logits)) / n


def _sigmoid_ring(zimg, ztxt, t, b, axis_name: str) -> jnp.ndarray:
    """This device's rows of the global sigmoid loss, texts passed around a ring (local loss)."""
    n = zimg.shape[0]
    size = jax.lax.psum(1, axis_name)
    ring = [(j, (j + 1) % size) for j in range(size)]
    total = _sigmoid_block(zimg, ztxt, t, b, True)
    txt = ztxt
    for _ in range(size - 1):  # the device count is static and small: unrolled
        txt = jax.lax.ppermute(txt, axis_name, ring)
        total = total + _sigmoid_block(zimg, txt, t, b, False)
    return total / n


def sigmoid_loss_chunked_pmap(zimg, ztxt, t, b, axis_name: str = "batch") -> jnp.ndarray:
    return _sigmoid_ring(zimg, ztxt, t, b, axis_name)


def sigmoid_loss_chunked(zimg, ztxt, t, b, mesh: jax.sharding.Mesh, axis: str = "data") -> jnp.ndarray:
    """Global SigLIP loss for embeddings sharded over ``mesh`` axis ``axis`` (ring of ppermutes)."""

    def body(zi, zt, t_, b_):
        return jax.lax.pmean(_sigmoid_ring(zi, zt, t_, b_, axis), axis)

    fn = jax.shard_map(body, mesh=mesh, in_specs=(P(axis), P(axis), P(), P()), out_specs=P())
    return fn(zimg, ztxt, jnp.asarray(t, jnp.float32), jnp.asarray(b, jnp.float32))


# ----------------------------------------------------------------------------------------------
# Language modelling (the VLM's answer loss).
# ----------------------------------------------------------------------------------------------

def token_nll(logits: jnp.ndarray, targets: jnp.ndarray) -> jnp.ndarray:
    """Per-position negative log-likelihood ``[..., L]`` of ``targets`` under ``logits [..., L, V]``."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]


def masked_mean(x: jnp.ndarray, mask: jnp.ndarray) -> jnp.ndarray:
    """Mean of ``x`` where ``mask`` is nonzero (0 when nothing is masked in)."""
    mask = mask.astype(jnp.float32)
    return (x * mask).sum() / jnp.maximum(mask.sum(), 1.0)


def chunked_lm_loss(hidden: jnp.ndarray, targets: jnp.ndarray, mask: jnp.ndarray, head, chunk: int):
    """``lm_loss`` of ``head(hidden)`` (``hidden [B, L, D]``, ``head``: states → float32 logits) with
    the logits made ``chunk`` tokens at a time and recomputed in the backward pass rather than
    kept: a large vocabulary's ``[B, L, V]`` logits (Qwen2's 151,936 at 32 × 2,048 tokens: 40 GB in
    float32) never exist at once. The same loss, accuracy and gradients as ``lm_loss`` (1e-6)."""
    d = hidden.shape[-1]
    h, t, w = hidden.reshape(-1, d), targets.reshape(-1), mask.reshape(-1).astype(jnp.float32)
    pad = -len(t) % chunk
    h, t, w = jnp.pad(h, ((0, pad), (0, 0))), jnp.pad(t, (0, pad)), jnp.pad(w, (0, pad))

    @jax.checkpoint
    def sums(h_c, t_c, w_c):
        logits = head(h_c)
        nll = token_nll(logits, t_c)
        return jnp.stack([(nll * w_c).sum(), ((logits.argmax(-1) == t_c) * w_c).sum()])

    def body(total, xs):
        return total + sums(*xs), None

    chunks = (h.reshape(-1, chunk, d), t.reshape(-1, chunk), w.reshape(-1, chunk))
    (nll, correct), _ = jax.lax.scan(body, jnp.zeros(2, jnp.float32), chunks)
    count = jnp.maximum(w.sum(), 1.0)
    return nll / count, correct / count


def lm_loss(logits: jnp.ndarray, targets: jnp.ndarray, mask: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Mean next-token cross-entropy over positions where ``mask`` is 1, and the token accuracy.

    ``logits[:, i]`` predicts ``targets[:, i]`` (shift before calling)."""
    correct = (logits.argmax(-1) == targets).astype(jnp.float32)
    return masked_mean(token_nll(logits, targets), mask), masked_mean(correct, mask)
