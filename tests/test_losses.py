"""Contrastive losses: every multi-device variant equals the one-device loss on the global batch,
forward and gradients, on 4 CPU devices; and a local-negatives-only loss is caught."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from vitmm import losses
from vitmm.models.two_towers import l2_normalize

N_DEV = 4
N_LOCAL = 3
DIM = 8


@pytest.fixture(scope="session")
def setup():
    assert jax.device_count() >= N_DEV, "tests/conftest.py sets 4 CPU devices"
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    x_img = jax.random.normal(k1, (N_DEV * N_LOCAL, DIM))
    x_txt = jax.random.normal(k2, (N_DEV * N_LOCAL, DIM))
    # A shared "parameter" so that gradients test what a trainer sees with replicated params.
    w = jax.random.normal(k3, (DIM, DIM)) / np.sqrt(DIM)
    return x_img, x_txt, w


def _embed(w, x):
    return l2_normalize(x @ w)


def _single(kind, w, x_img, x_txt, t, b):
    zi, zt = _embed(w, x_img), _embed(w, x_txt)
    return losses.softmax_loss(zi, zt, t) if kind == "softmax" else losses.sigmoid_loss(zi, zt, t, b)


def _reference(kind, w, x_img, x_txt, t=10.0, b=-2.0):
    return jax.value_and_grad(_single, argnums=(1, 4, 5))(kind, w, x_img, x_txt, t, b) if kind == "sigmoid" \
        else jax.value_and_grad(_single, argnums=(1, 4))(kind, w, x_img, x_txt, t, b)


PMAP_LOSSES = {
    "softmax": lambda zi, zt, t, b: losses.softmax_loss_pmap(zi, zt, t, "batch"),
    "sigmoid": lambda zi, zt, t, b: losses.sigmoid_loss_pmap(zi, zt, t, b, "batch"),
    "sigmoid_chunked": lambda zi, zt, t, b: losses.sigmoid_loss_chunked_pmap(zi, zt, t, b, "batch"),
    # The bug this suite must catch: negatives only from the local shard.
    "softmax_local_only": lambda zi, zt, t, b: losses.softmax_loss(zi, zt, t),
}


def _pmap_loss_and_grads(name, w, x_img, x_txt, t=10.0, b=-2.0):
    loss_fn = PMAP_LOSSES[name]

    def step(w, xi, xt, t, b):
        def local(w, t, b):
            return loss_fn(_embed(w, xi), _embed(w, xt), t, b)

        loss, grads = jax.value_and_grad(local, argnums=(0, 1, 2))(w, t, b)
        return jax.lax.pmean(loss, "batch"), jax.lax.pmean(grads, "batch")

    shard = lambda x: x.reshape(N_DEV, N_LOCAL, *x.shape[1:])  # noqa: E731
    rep = lambda x: jnp.broadcast_to(jnp.asarray(x, jnp.float32), (N_DEV,))  # noqa: E731
    loss, grads = jax.pmap(step, axis_name="batch", in_axes=(None, 0, 0, 0, 0),
                           devices=jax.devices()[:N_DEV])(w, shard(x_img), shard(x_txt), rep(t), rep(b))
    jax.block_until_ready(loss)
    return loss[0], jax.tree.map(lambda g: g[0], grads)


def _close(a, b, tol=1e-5):
    return all(np.allclose(x, y, atol=tol, rtol=tol) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b),
                                                                     strict=True))


@pytest.mark.parametrize("name, kind", [("softmax", "softmax"), ("sigmoid", "sigmoid"),
                                        ("sigmoid_chunked", "sigmoid")])
def test_pmap_losses_equal_global_loss_and_gradients(setup, name, kind):
    x_img, x_txt, w = setup
    ref_loss, ref_grads = _reference(kind, w, x_img, x_txt)
    loss, (gw, gt, gb) = _pmap_loss_and_grads(name, w, x_img, x_txt)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gw, ref_grads[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gt, ref_grads[1], rtol=1e-5, atol=1e-6)
    if kind == "sigmoid":
        np.testing.assert_allclose(gb, ref_grads[2], rtol=1e-5, atol=1e-6)


def test_local_negatives_only_is_caught(setup):
    x_img, x_txt, w = setup
    ref_loss, ref_grads = _reference("softmax", w, x_img, x_txt)
    loss, (gw, _, _) = _pmap_loss_and_grads("softmax_local_only", w, x_img, x_txt)
    # The comparison used above must reject a loss that sees only local negatives.
    assert not np.allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert not np.allclose(gw, ref_grads[0], rtol=1e-5, atol=1e-6)
    assert float(loss) < float(ref_loss)  # fewer negatives: an easier, different objective


def _mesh():
    return jax.sharding.Mesh(np.array(jax.devices()[:N_DEV]), ("data",))


@pytest.mark.parametrize("kind", ["softmax", "sigmoid"])
def test_jit_over_mesh_equals_global_loss(setup, kind):
    x_img, x_txt, w = setup
    ref_loss, ref_grads = _reference(kind, w, x_img, x_txt)
    mesh = _mesh()
    sharded = NamedSharding(mesh, P("data"))
    xi, xt = jax.device_put(x_img, sharded), jax.device_put(x_txt, sharded)
    argnums = (1, 4, 5) if kind == "sigmoid" else (1, 4)
    fn = jax.jit(jax.value_and_grad(_single, argnums=argnums), static_argnums=0)
    loss, grads = fn(kind, w, xi, xt, 10.0, -2.0)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert _close(grads, ref_grads)


def test_chunked_sigmoid_over_mesh_equals_global_loss(setup):
    x_img, x_txt, w = setup
    ref_loss, ref_grads = _reference("sigmoid", w, x_img, x_txt)
    mesh = _mesh()
    sharded = NamedSharding(mesh, P("data"))

    def loss_fn(w, xi, xt, t, b):
        return losses.sigmoid_loss_chunked(_embed(w, xi), _embed(w, xt), t, b, mesh)

    fn = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 3, 4)))
    loss, grads = fn(w, jax.device_put(x_img, sharded), jax.device_put(x_txt, sharded), 10.0, -2.0)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert _close(grads, ref_grads)
    # Each device only ever holds n x n logits: no [B, B] array in the compiled program.
    hlo = fn.lower(w, x_img, x_txt, 10.0, -2.0).compile().as_text()
    assert f"f32[{N_LOCAL},{N_LOCAL}]" in hlo and f"f32[{N_LOCAL},{N_DEV * N_LOCAL}]" not in hlo


def test_single_device_losses_match_their_formulas():
    zi = l2_normalize(jax.random.normal(jax.random.key(1), (5, 4)))
    zt = l2_normalize(jax.random.normal(jax.random.key(2), (5, 4)))
    logits = 3.0 * np.asarray(zi) @ np.asarray(zt).T
    log_softmax_rows = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    log_softmax_cols = logits - np.log(np.exp(logits).sum(0, keepdims=True))
    expected = -0.5 * (np.diag(log_softmax_rows).mean() + np.diag(log_softmax_cols).mean())
    np.testing.assert_allclose(losses.softmax_loss(zi, zt, 3.0), expected, rtol=1e-5)
    labels = 2 * np.eye(5) - 1
    sig = -np.log(1 / (1 + np.exp(-labels * (logits - 1.0)))).sum() / 5
    np.testing.assert_allclose(losses.sigmoid_loss(zi, zt, 3.0, -1.0), sig, rtol=1e-5)


@pytest.mark.parametrize("kind", ["softmax", "sigmoid"])
def test_a_validity_mask_gives_the_loss_of_the_valid_pairs_alone(kind):
    """Packed batches leave empty image slots out: the masked loss (and its gradient) is the
    loss of the valid rows as if the others were never there."""
    rng = np.random.default_rng(0)
    zi, zt = (jnp.asarray(rng.normal(size=(7, 5)), jnp.float32) for _ in range(2))
    valid = jnp.asarray([True, False, True, True, False, True, True])

    def loss(zi, zt, valid=None):
        if kind == "softmax":
            return losses.softmax_loss(zi, zt, 3.0, valid)
        return losses.sigmoid_loss(zi, zt, 3.0, -1.0, valid)

    keep = np.flatnonzero(valid)
    np.testing.assert_allclose(loss(zi, zt, valid), loss(zi[keep], zt[keep]), rtol=1e-6)
    grads = jax.grad(loss, argnums=(0, 1))(zi, zt, valid)
    sub = jax.grad(loss, argnums=(0, 1))(zi[keep], zt[keep])
    for g, s in zip(grads, sub, strict=True):
        np.testing.assert_allclose(g[keep], s, rtol=1e-5, atol=1e-7)
        np.testing.assert_array_equal(np.asarray(g)[~np.asarray(valid)], 0.0)
