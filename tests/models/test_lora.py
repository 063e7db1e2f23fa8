"""LoRA adapters: the adapted model starts as the base one, merging gives the same outputs, only
the adapters receive gradients and training them lowers the loss, dropout is seeded."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from vitmm.models import lora
from vitmm.models.lm import LM

KW = dict(vocab_size=64, width=32, depth=2, num_heads=4, num_kv_heads=2)
TARGETS = (r"block_\d+/attn/(q|v)", r"block_\d+/mlp/down")


@pytest.fixture(scope="session")
def setup():
    model = LM(**KW)
    ids = jax.random.randint(jax.random.key(0), (2, 9), 0, 64)
    params = model.init(jax.random.key(1), ids)["params"]
    return model, params, ids


def test_adapters_start_as_the_base_model_and_merge_to_the_same_outputs(setup):
    model, params, ids = setup
    adapters = lora.init(params, TARGETS, rank=4, key=jax.random.key(2))
    assert sorted(adapters) == [f"block_0{i}.{n}" for i in (0, 1) for n in ("attn.q", "attn.v", "mlp.down")]
    base = model.apply({"params": params}, ids)
    np.testing.assert_array_equal(lora.apply(model, params, adapters, 8.0, ids), base)  # B = 0
    adapters = jax.tree.map(lambda x: x + 0.1 * jax.random.normal(jax.random.key(3), x.shape), adapters)
    adapted = lora.apply(model, params, adapters, 8.0, ids)
    merged = model.apply({"params": lora.merge(params, adapters, 8.0)}, ids)
    assert np.abs(np.asarray(adapted) - np.asarray(base)).max() > 1e-3
    np.testing.assert_allclose(np.asarray(adapted), np.asarray(merged), rtol=1e-5, atol=1e-5)


def test_the_low_rank_branch_is_scaled_by_alpha_over_rank():
    """One dense layer, checked against numpy: ``y = xW + b + (α/r)·x·A·B`` (Hu et al.'s scaling,
    PEFT's ``lora_alpha / r``), applied and merged alike; α 6, rank 3: a factor of 2."""
    import flax.linen as nn

    class One(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(4, name="proj")(x)

    x = np.random.default_rng(0).normal(size=(2, 5)).astype(np.float32)
    params = One().init(jax.random.key(0), x)["params"]
    assert list(lora.init(params, (r"proj",), rank=3, key=jax.random.key(1))) == ["proj"]
    a = np.random.default_rng(1).normal(size=(5, 3)).astype(np.float32)
    b = np.random.default_rng(2).normal(size=(3, 4)).astype(np.float32)
    adapters = {"proj": {"a": jnp.asarray(a), "b": jnp.asarray(b)}}
    w, bias = np.asarray(params["proj"]["kernel"]), np.asarray(params["proj"]["bias"])
    want = x @ w + bias + 2.0 * (x @ a) @ b
    np.testing.assert_allclose(np.asarray(lora.apply(One(), params, adapters, 6.0, x)), want, rtol=1e-5, atol=1e-5)
    merged = One().apply({"params": lora.merge(params, adapters, 6.0)}, x)
    np.testing.assert_allclose(np.asarray(merged), want, rtol=1e-5, atol=1e-5)


def test_only_adapters_train_and_the_loss_goes_down(setup):
    model, params, ids = setup
    adapters = lora.init(params, TARGETS, rank=4, key=jax.random.key(2))

    def loss(ad):
        logits = lora.apply(model, params, ad, 8.0, ids[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()

    grads = jax.jit(jax.grad(loss))(adapters)
    assert all(float(jnp.abs(g["b"]).max()) > 0 for g in grads.values())  # every adapter is reached
    tx = optax.adam(1e-2)

    @jax.jit  # one program for the 20 steps (eager: each step's every operation dispatched alone)
    def step(adapters, state):
        updates, state = tx.update(jax.grad(loss)(adapters), state)
        return optax.apply_updates(adapters, updates), state

    state = tx.init(adapters)
    first = float(jax.jit(loss)(adapters))
    for _ in range(20):
        adapters, state = step(adapters, state)
    assert float(jax.jit(loss)(adapters)) < first - 0.1


def test_dropout_is_seeded_and_targets_must_match(setup):
    model, params, ids = setup
    adapters = jax.tree.map(lambda x: x + 0.1, lora.init(params, TARGETS, rank=2, key=jax.random.key(2)))
    a = lora.apply(model, params, adapters, 4.0, ids, dropout=0.5, rng=jax.random.key(5))
    b = lora.apply(model, params, adapters, 4.0, ids, dropout=0.5, rng=jax.random.key(5))
    c = lora.apply(model, params, adapters, 4.0, ids)
    np.testing.assert_array_equal(a, b)
    assert np.abs(np.asarray(a) - np.asarray(c)).max() > 1e-4
    with pytest.raises(ValueError, match="No dense layer matches"):
        lora.init(params, (r"vision/.*",), rank=2, key=jax.random.key(0))
    stacked = {"tower": {"blocks": {"attn": {"qkv": {"kernel": jnp.zeros((2, 8, 24))}}}}, **params}  # scan=True's
    with pytest.raises(ValueError, match=r"match stacked kernels.*tower/blocks/attn/qkv.*scan=False"):
        lora.init(stacked, (r".*attn/(qkv|q|v)",), rank=2, key=jax.random.key(0))  # never silently the LM only


def test_adapters_on_the_tower_and_the_lm_of_a_vlm_merge_to_the_same_outputs():
    """LoRA on the vision tower too (its fused qkv and output projections and its MLP) beside the
    LM's attention: the adapted VLM starts as the base one, every targeted layer changes the
    output, and merging gives the adapted outputs."""
    from vitmm.models import vlm

    model = vlm.VLM(dict(width=32, depth=2, mlp_dim=64, num_heads=4, patch_size=8), {"name": "pool", "budget": 4},
                    dict(vocab_size=64, width=32, depth=1, num_heads=4))
    images = jax.random.normal(jax.random.key(0), (2, 32, 32, 3))
    ids = jax.random.randint(jax.random.key(1), (2, 5), 0, 64)
    params = model.init(jax.random.key(2), images, ids)["params"]
    targets = (r"tower/encoder/block_\d+/(attn/(qkv|out)|mlp/fc1)", r"language/block_\d+/attn/(q|v)")
    adapters = lora.init(params, targets, rank=2, key=jax.random.key(3))
    assert sum(k.startswith("tower.") for k in adapters) == 6 and sum(k.startswith("language.") for k in adapters) == 2
    base = model.apply({"params": params}, images, ids)
    np.testing.assert_array_equal(lora.apply(model, params, adapters, 4.0, images, ids), base)
    bumped = jax.tree.map(lambda x: x + 0.1 * jax.random.normal(jax.random.key(4), x.shape), adapters)
    adapted = lora.apply(model, params, bumped, 4.0, images, ids)
    for layer in ("tower.encoder.block_00.attn.qkv", "tower.encoder.block_01.mlp.fc1"):  # each one is applied
        one = {k: (bumped if k == layer else adapters)[k] for k in adapters}
        assert np.abs(np.asarray(lora.apply(model, params, one, 4.0, images, ids) - base)).max() > 1e-4, layer
    merged = model.apply({"params": lora.merge(params, bumped, 4.0)}, images, ids)
    np.testing.assert_allclose(np.asarray(adapted), np.asarray(merged), rtol=1e-5, atol=1e-5)


def test_a_is_drawn_as_peft_draws_it_and_b_is_zero(setup):
    """PEFT's default (``kaiming_uniform_(a=√5)`` on ``lora_A [r, in]``): uniform on ±1/√in."""
    _, params, _ = setup
    adapters = lora.init(params, TARGETS, rank=4, key=jax.random.key(2))
    for name, ad in adapters.items():
        fan_in = ad["a"].shape[0]
        a = np.asarray(ad["a"])
        assert np.abs(a).max() <= fan_in ** -0.5 and np.abs(a).max() > 0.8 * fan_in ** -0.5, name
        assert abs(a.std() - fan_in ** -0.5 / np.sqrt(3)) < 0.2 * fan_in ** -0.5, name  # a uniform's std
        assert not np.any(np.asarray(ad["b"]))


def test_on_a_gpu_the_branch_is_added_once_as_merge_folds_it(setup):
    """Off CPU vitmm's ``Dense.__call__`` calls flax's, and flax runs the interceptor on both calls:
    the branch must still be added once, so training (``apply``) and export (``merge``) agree there
    too (traced as for a GPU on this machine, the path a GPU takes)."""
    from vitmm.models import layers

    model, params, ids = setup
    adapters = lora.init(params, TARGETS, rank=4, key=jax.random.key(2))
    adapters = jax.tree.map(lambda x: x + 0.1 * jax.random.normal(jax.random.key(3), x.shape), adapters)
    merged = np.asarray(model.apply({"params": lora.merge(params, adapters, 8.0)}, ids))
    with layers.compiling_for("gpu"):
        adapted = np.asarray(lora.apply(model, params, adapters, 8.0, ids))
    np.testing.assert_allclose(adapted, merged, rtol=1e-5, atol=1e-5)
