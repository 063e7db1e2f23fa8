"""The optimizer update every training loop in vitmm shares.

``loss_and_grads`` (with optional gradient accumulation over micro-batches) and ``apply``
make up the trainer's step (``trainer.make_train_step`` adds device reduction and metrics);
``update_step(loss_fn, tx)`` is the plain ``(params, opt_state, *args) -> (params, opt_state,
loss)`` step that the experiments and benchmarks time and train with.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax


def loss_and_grads(loss_fn: Callable, params, batch, rng, accum_steps: int = 1, trainable=None,
                   weight: str | None = None):
    """``(loss, aux, grads)`` of ``loss_fn(params, batch, rng) -> (loss, aux)``. With
    ``accum_steps = k`` the batch is split into k micro-batches (micro-batch i gets
    ``fold_in(rng, i)``) whose losses and gradients are averaged; ``aux`` is the last one's.
    Micro-batch i holds rows i, i + k, i + 2k, ...: a batch sharded over devices in contiguous
    blocks then gives each device its own rows of every micro-batch (contiguous micro-batches lie
    on some devices only, and under jit XLA gathers them: no memory saved, k times the compute).

    ``weight`` names an ``aux`` count the loss is a mean over (a VLM's answer tokens): the
    micro-batches are then weighted by it, so the loss and gradients are the mean over every token
    of the batch whatever ``k`` (a plain mean of micro-batch means weighs a short answer's tokens
    more); ``aux`` is weighted alike, and ``aux[weight]`` is the batch's total.

    ``trainable`` (booleans shaped like ``params``, e.g. ``optim.trainable_mask``): only those
    parameters are differentiated, and ``grads`` holds ``None`` for the others. A frozen LM or
    tower then costs its forward and its input gradients only: differentiating every parameter
    and dropping the frozen ones' gradients in the optimizer still computes them whenever anything
    else reads them (a gradient norm, a cross-device mean)."""
    if trainable is None:
        wrt, whole = params, lambda w: w
    else:
        wrt = jax.tree.map(lambda p, t: p if t else None, params, trainable)
        whole = lambda w: jax.tree.map(lambda x, p: p if x is None else x, w, params,  # noqa: E731
                                       is_leaf=lambda x: x is None)
    grad_fn = jax.value_and_grad(lambda w, b, r: loss_fn(whole(w), b, r), has_aux=True)
    if accum_steps == 1:
        (loss, aux), grads = grad_fn(wrt, batch, rng)
        return loss, aux, grads
    micro = jax.tree.map(lambda x: jnp.swapaxes(x.reshape(x.shape[0] // accum_steps, accum_steps, *x.shape[1:]), 0, 1),
                         batch)

    def body(carry, inputs):
        mb, i = inputs
        (loss, aux), grads = grad_fn(wrt, mb, jax.random.fold_in(rng, i))
        if weight is None:
            return jax.tree.map(jnp.add, carry, (loss, grads)), aux
        w = aux[weight].astype(jnp.float32)
        return jax.tree.map(lambda c, x: c + w * x.astype(jnp.float32), carry, (loss, grads, aux)), w

    if weight is None:
        zero = (jnp.zeros(()), jax.tree.map(jnp.zeros_like, wrt))
        (loss, grads), aux = jax.lax.scan(body, zero, (micro, jnp.arange(accum_steps)))
        grads = jax.tree.map(lambda g: g / accum_steps, grads)
        return loss / accum_steps, jax.tree.map(lambda a: a[-1], aux), grads
    first = jax.tree.map(lambda x: x[0], micro)
    aux_shape = jax.eval_shape(lambda: grad_fn(wrt, first, rng)[0][1])
    shapes = (jnp.zeros(()), wrt, aux_shape)  # the sums in float32: a bf16 count rounds past 256
    zero = jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), shapes)
    sums, weights = jax.lax.scan(body, zero, (micro, jnp.arange(accum_steps)))
    total = weights.sum()
    loss, grads, aux = jax.tree.map(lambda m, a: m.astype(a.dtype), weighted_mean(sums, total), shapes)
    return loss, {**aux, weight: total}, grads


def weighted_mean(sums, total):
    """``sums / total`` leaf by leaf (zeros where ``total`` is 0: nothing was weighed)."""
    return jax.tree.map(lambda x: x / jnp.where(total > 0, total, 1).astype(x.dtype), sums)


def apply(tx: optax.GradientTransformation, grads, opt_state, params):
    """``(params, opt_state, updates)`` after one optimizer update. ``None`` gradients (the
    parameters ``loss_and_grads`` did not differentiate) reach ``tx`` as zeros: a frozen
    parameter's transform ignores them."""
    grads = jax.tree.map(lambda g, p: jnp.zeros_like(p) if g is None else g, grads, params,
                         is_leaf=lambda x: x is None)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, updates


def update_step(loss_fn: Callable, tx: optax.GradientTransformation) -> Callable:
    """``step(params, opt_state, *args) -> (params, opt_state, loss)`` for a scalar
    ``loss_fn(params, *args)``; jit it as the caller needs (e.g. donating params and state)."""

    def step(params, opt_state, *args):
        loss, grads = jax.value_and_grad(loss_fn)(params, *args)
        params, opt_state, _ = apply(tx, grads, opt_state, params)
        return params, opt_state, loss

    return step
