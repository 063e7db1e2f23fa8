"""The heads-first matmul attention (vitmm's CPU default) computes what jax.nn.dot_product_attention does."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vitmm.models.attention import Attention, matmul_attention


def _qkv(t=7, s=7, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(keys[0], (2, t, 3, 8)), jax.random.normal(keys[1], (2, s, 3, 8)),
            jax.random.normal(keys[2], (2, s, 3, 8)))


@pytest.mark.parametrize("t, s, causal, masked", [(7, 7, False, False), (5, 9, False, False), (7, 7, True, False),
                                                  (7, 7, False, True), (7, 7, True, True)])
def test_matmul_attention_equals_jax_dot_product_attention(t, s, causal, masked):
    q, k, v = _qkv(t, s)
    mask = None
    if masked:  # per-example key padding, broadcast over heads and queries
        mask = (jnp.arange(s)[None, :] < jnp.array([s, s - 3])[:, None])[:, None, None, :]
    want = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal, implementation="xla")
    got = matmul_attention(q, k, v, mask=mask, is_causal=causal)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=0)
    # Gradients too: the CPU default trains through it.
    loss = lambda f: lambda q, k, v: (f(q, k, v) ** 2).sum()  # noqa: E731
    jax_f = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal)  # noqa: E731
    mm_f = lambda q, k, v: matmul_attention(q, k, v, mask=mask, is_causal=causal)  # noqa: E731
    for a, b in zip(jax.grad(loss(mm_f), (0, 1, 2))(q, k, v), jax.grad(loss(jax_f), (0, 1, 2))(q, k, v), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)


def test_attention_module_default_is_matmul_on_cpu_and_implementations_agree():
    x = jax.random.normal(jax.random.key(1), (2, 6, 24))
    outs = {}
    for impl in (None, "matmul", "xla"):
        module = Attention(num_heads=3, implementation=impl)
        params = module.init(jax.random.key(0), x)
        outs[impl] = module.apply(params, x)
    np.testing.assert_array_equal(np.asarray(outs[None]), np.asarray(outs["matmul"]))
    np.testing.assert_allclose(np.asarray(outs["matmul"]), np.asarray(outs["xla"]), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="'flash' is not one of"):
        Attention(num_heads=3, implementation="flash").init(jax.random.key(0), x)


def test_bfloat16_inputs_stay_close():
    q, k, v = _qkv()
    want = matmul_attention(q, k, v)
    got = matmul_attention(*(a.astype(jnp.bfloat16) for a in (q, k, v)))
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=0.05)
