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


def loss_and_grads(loss_fn: Callable, params, batch, rng, accum_steps: int = 1):
    """``(loss, aux, grads)`` of ``loss_fn(params, batch, rng) -> (loss, aux)``. With
    ``accum_steps = k`` the batch is split into k micro-batches (micro-batch i gets
    ``fold_in(rng, i)``) whose losses and gradients are averaged; ``aux`` is the last one's."""
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    if accum_steps == 1:
        (loss, aux), grads = grad_fn(params, batch, rng)
        return loss, aux, grads
    micro = jax.tree.map(lambda x: x.reshape(accum_steps, x.shape[0] // accum_steps, *x.shape[1:]), batch)

    def body(carry, inputs):
        mb, i = inputs
        (loss, aux), grads = grad_fn(params, mb, jax.random.fold_in(rng, i))
        return jax.tree.map(jnp.add, carry, (loss, grads)), aux

    zero = (jnp.zeros(()), jax.tree.map(jnp.zeros_like, params))
    (loss, grads), aux = jax.lax.scan(body, zero, (micro, jnp.arange(accum_steps)))
    grads = jax.tree.map(lambda g: g / accum_steps, grads)
    return loss / accum_steps, jax.tree.map(lambda a: a[-1], aux), grads


def apply(tx: optax.GradientTransformation, grads, opt_state, params):
    """``(params, opt_state, updates)`` after one optimizer update."""
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
