"""vitmm's Dense is flax's Dense (parameters, outputs, every derivative), with a bias gradient that
XLA:CPU computes as a product instead of a reduce-window tree."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vitmm.models import layers


def _both(features=24, use_bias=True, shape=(2, 40, 16), **kw):
    x = jax.random.normal(jax.random.key(0), shape)
    ours, flax_dense = layers.Dense(features, use_bias=use_bias, **kw), nn.Dense(features, use_bias=use_bias, **kw)
    params = ours.init(jax.random.key(1), x)
    # non-zero bias, so that a dropped bias cannot pass
    params = jax.tree.map(lambda p: p + 0.1 * jax.random.normal(jax.random.key(2), p.shape, p.dtype), params)
    return x, params, ours, flax_dense


@pytest.mark.parametrize("use_bias", [True, False])
@pytest.mark.parametrize("shape", [(2, 40, 16), (7, 16), (2, 3, 5, 16)])
def test_dense_is_flax_dense_forward_and_reverse(use_bias, shape):
    x, params, ours, flax_dense = _both(use_bias=use_bias, shape=shape)
    assert jax.tree.map(jnp.shape, params) == jax.tree.map(jnp.shape, flax_dense.init(jax.random.key(1), x))
    np.testing.assert_allclose(np.asarray(ours.apply(params, x)), np.asarray(flax_dense.apply(params, x)),
                               atol=1e-6, rtol=0)
    cotangent = jax.random.normal(jax.random.key(3), shape[:-1] + (24,))

    def grads(module):
        return jax.grad(lambda p, x: jnp.vdot(module.apply(p, x), cotangent), (0, 1))(params, x)

    for a, b in zip(jax.tree.leaves(grads(ours)), jax.tree.leaves(grads(flax_dense)), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-6)


def test_dense_keeps_forward_mode_and_second_derivatives():
    x, params, ours, flax_dense = _both()
    tangent = jax.tree.map(lambda p: jax.random.normal(jax.random.key(4), p.shape), params)
    dx = jax.random.normal(jax.random.key(5), x.shape)
    for want, got in zip(jax.jvp(flax_dense.apply, (params, x), (tangent, dx)), jax.jvp(ours.apply, (params, x),
                                                                                         (tangent, dx)),
                         strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)

    def hvp(module):  # grad of grad: the transposed JVP is differentiable again
        loss = lambda x: (jnp.tanh(module.apply(params, x)) ** 2).sum()  # noqa: E731
        return jax.jvp(jax.grad(loss), (x,), (dx,))[1]

    np.testing.assert_allclose(np.asarray(hvp(ours)), np.asarray(hvp(flax_dense)), atol=1e-4, rtol=1e-5)


def test_dense_bias_gradient_is_a_product_not_a_reduce_window():
    # The point of the layer: flax's bias gradient is a column sum, which XLA:CPU lowers to
    # reduce-windows (slow); vitmm's is a dot with ones. 80 tokens: enough for XLA to split the sum.
    x, params, ours, flax_dense = _both()
    cotangent = jnp.ones(x.shape[:-1] + (24,))

    def hlo(module):
        loss = lambda p, x, c: jnp.vdot(module.apply(p, x), c)  # noqa: E731
        return jax.jit(jax.grad(loss)).lower(params, x, cotangent).compile().as_text()

    assert "reduce-window" in hlo(flax_dense)  # otherwise this test checks nothing
    assert "reduce-window" not in hlo(ours)


def test_dense_bfloat16_compute_and_flax_fallbacks():
    x, params, ours, flax_dense = _both(dtype=jnp.bfloat16)
    got = ours.apply(params, x)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(flax_dense.apply(params, x), np.float32),
                               atol=0.05, rtol=0)
    grads = jax.grad(lambda p: ours.apply(p, x).astype(jnp.float32).sum())(params)
    assert jax.tree.map(lambda g: g.dtype, grads) == jax.tree.map(lambda p: p.dtype, params)
    # an explicit precision goes to flax's own code, with the same parameters
    x, params, ours, flax_dense = _both(precision=jax.lax.Precision.HIGHEST)
    np.testing.assert_array_equal(np.asarray(ours.apply(params, x)), np.asarray(flax_dense.apply(params, x)))


@pytest.mark.parametrize("shape, dtype", [((3, 4, 5, 16), jnp.float32), ((2, 7, 16), jnp.bfloat16)])
def test_layernorm_is_flax_layernorm_bit_for_bit_and_in_every_derivative(shape, dtype):
    """vitmm's LayerNorm (its scale/bias gradients as products on CPU) gives flax's outputs bit for
    bit, its gradients (input, scale, bias), forward mode and a gradient of a gradient."""
    x = jax.random.normal(jax.random.key(0), shape).astype(dtype)
    ours, theirs = layers.LayerNorm(epsilon=1e-5), nn.LayerNorm(epsilon=1e-5)
    params = jax.tree.map(lambda p: p + 0.1 * jax.random.normal(jax.random.key(2), p.shape, p.dtype),
                          ours.init(jax.random.key(1), x))
    assert jax.tree.map(jnp.shape, params) == jax.tree.map(jnp.shape, theirs.init(jax.random.key(1), x))
    out = ours.apply(params, x)
    assert out.dtype == theirs.apply(params, x).dtype and np.array_equal(out, theirs.apply(params, x))
    r = jax.random.normal(jax.random.key(3), shape)
    loss = lambda f: lambda p, x: (f.apply(p, x).astype(jnp.float32) * r).sum()  # noqa: E731
    for a, b in zip(jax.tree.leaves(jax.grad(loss(ours), argnums=(0, 1))(params, x)),
                    jax.tree.leaves(jax.grad(loss(theirs), argnums=(0, 1))(params, x)), strict=True):
        np.testing.assert_allclose(np.float32(a), np.float32(b), atol=1e-2 if dtype == jnp.bfloat16 else 1e-5)
    tangents = jax.tree.map(lambda p: jax.random.normal(jax.random.key(4), p.shape, p.dtype), (params, x))
    for a, b in zip(jax.jvp(ours.apply, (params, x), tangents), jax.jvp(theirs.apply, (params, x), tangents),
                    strict=True):
        np.testing.assert_allclose(np.float32(a), np.float32(b), atol=1e-2 if dtype == jnp.bfloat16 else 1e-5)
    second = lambda f: jax.grad(lambda x: (jax.grad(loss(f))(params, x)["params"]["scale"] ** 2).sum())(x)  # noqa: E731
    np.testing.assert_allclose(np.float32(second(ours)), np.float32(second(theirs)),
                               atol=5e-2 if dtype == jnp.bfloat16 else 1e-4)
