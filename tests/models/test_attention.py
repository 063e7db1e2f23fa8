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


def test_a_row_with_every_key_masked_gets_uniform_weights_like_jax():
    q, k, v = _qkv()
    mask = jnp.ones((2, 1, 7, 7), bool).at[0, :, 3].set(False)
    want = jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")
    got = matmul_attention(q, k, v, mask=mask)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=0)
    np.testing.assert_allclose(np.asarray(got[0, 3]), np.asarray(v[0].mean(0)), atol=1e-6, rtol=0)
    # and no gradient reaches q or the masked keys through a masked logit (the backward is hand-written)
    loss = lambda fn: lambda q, k, v: (fn(q, k, v) ** 2).sum()  # noqa: E731
    want = jax.grad(loss(lambda *a: jax.nn.dot_product_attention(*a, mask=mask, implementation="xla")), (0, 1, 2))
    got = jax.grad(loss(lambda *a: matmul_attention(*a, mask=mask)), (0, 1, 2))
    for w, g in zip(want(q, k, v), got(q, k, v), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5, rtol=0)


@pytest.mark.parametrize("kind", ["self", "cross", "qk_norm", "rope", "causal", "mask"])
def test_attention_module_default_is_matmul_on_cpu_and_implementations_agree(kind):
    """The matmul path works heads-first (one transpose in, one out); every option of the module
    must give what the [B, T, heads, hd] jax.nn.dot_product_attention path gives, gradients too."""
    x = jax.random.normal(jax.random.key(1), (2, 6, 24))
    kv = jax.random.normal(jax.random.key(2), (2, 9, 24)) if kind == "cross" else None
    call = {}
    if kind == "rope":
        call["rope"] = jax.random.uniform(jax.random.key(3), (6, 4), maxval=3.0)
    if kind == "mask":
        call["mask"] = (jnp.arange(6)[None, :] < jnp.array([6, 2])[:, None])[:, None, None, :]
    outs, grads = {}, {}
    for impl in (None, "matmul", "xla"):
        module = Attention(num_heads=3, implementation=impl, qk_norm=kind == "qk_norm", is_causal=kind == "causal")
        params = module.init(jax.random.key(0), x, kv, **call)
        outs[impl] = module.apply(params, x, kv, **call)
        grads[impl] = jax.grad(lambda p, x: (module.apply(p, x, kv, **call) ** 2).sum(), (0, 1))(params, x)  # noqa: B023
    np.testing.assert_array_equal(np.asarray(outs[None]), np.asarray(outs["matmul"]))
    np.testing.assert_allclose(np.asarray(outs["matmul"]), np.asarray(outs["xla"]), atol=1e-6, rtol=0)
    for a, b in zip(jax.tree.leaves(grads["matmul"]), jax.tree.leaves(grads["xla"]), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=0)
    with pytest.raises(ValueError, match="'flash' is not one of"):
        Attention(num_heads=3, implementation="flash").init(jax.random.key(0), x)


def test_forward_products_are_plain_matmuls_on_cpu():
    """The logits product takes kᵀ materialised ([.., H, S], contraction over its rows), not k with
    the contraction on both operands' last axis, the form XLA:CPU ran ~20% slower; and the scale
    is on q, so no [T, S]-sized multiply is left besides the softmax's own."""
    cpu = jax.devices("cpu")[0]  # the formulation is XLA:CPU's; compiled there on any machine
    q, k, v = (jax.device_put(a.swapaxes(1, 2), cpu) for a in _qkv(t=9, s=9))
    from vitmm.models.attention import heads_first_attention
    hlo = jax.jit(heads_first_attention).lower(q, k, v).compile().as_text()
    dots = [line for line in hlo.splitlines() if " dot(" in line]
    assert len(dots) == 2, dots
    assert all("rhs_contracting_dims={2}" in line for line in dots), dots


def test_bfloat16_inputs_stay_close():
    q, k, v = _qkv()
    want = matmul_attention(q, k, v)
    got = matmul_attention(*(a.astype(jnp.bfloat16) for a in (q, k, v)))
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=0.05)


def test_gelu_is_the_exact_gelu_with_its_derivatives():
    from vitmm.models import common

    x = jnp.linspace(-10.0, 10.0, 20001)
    exact = lambda x: jax.nn.gelu(x, approximate=False)  # noqa: E731
    np.testing.assert_allclose(np.asarray(common.gelu(x)), np.asarray(exact(x)), atol=1e-6, rtol=0)
    d1 = jax.vmap(jax.grad(common.gelu))(x)
    np.testing.assert_allclose(np.asarray(d1), np.asarray(jax.vmap(jax.grad(exact))(x)), atol=1e-6, rtol=0)
    d2 = jax.vmap(jax.grad(jax.grad(common.gelu)))(x[::100])  # custom_jvp stays differentiable
    np.testing.assert_allclose(np.asarray(d2), np.asarray(jax.vmap(jax.grad(jax.grad(exact)))(x[::100])),
                               atol=1e-5, rtol=0)
    assert common.gelu(x.astype(jnp.bfloat16)).dtype == jnp.bfloat16
    assert common.activation("gelu") is common.gelu


@pytest.mark.parametrize("impl,causal", [("matmul", False), ("xla", False), ("matmul", True)])
def test_attention_maps_are_sown_on_request_and_are_the_softmax_of_the_scaled_scores(impl, causal):
    x = jax.random.normal(jax.random.key(0), (2, 5, 8))
    module = Attention(num_heads=2, implementation=impl, is_causal=causal)
    variables = module.init(jax.random.key(1), x)
    plain = module.apply(variables, x)
    out, state = module.apply(variables, x, mutable=["intermediates"])
    np.testing.assert_array_equal(out, plain)  # asking for the maps changes nothing else
    (probs,) = state["intermediates"]["attention"]
    # Reference from the parameters, written out: q, k from the fused projection, softmax(q·kᵀ/√h).
    qkv = x @ variables["params"]["qkv"]["kernel"] + variables["params"]["qkv"]["bias"]
    q, k = qkv[..., :8].reshape(2, 5, 2, 4), qkv[..., 8:16].reshape(2, 5, 2, 4)
    scores = np.einsum("bthd,bshd->bhts", q, k) / 2.0
    if causal:
        scores = np.where(np.tril(np.ones((5, 5), bool)), scores, -np.inf)
    np.testing.assert_allclose(probs, jax.nn.softmax(scores, axis=-1), atol=1e-6)
    assert "intermediates" not in module.apply(variables, x, mutable=["params"])[1]
