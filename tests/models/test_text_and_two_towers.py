"""Text tower pooling and masking; the two-tower model's embeddings, temperature and bias."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vitmm.data import tokenizer as tok_lib
from vitmm.models import text, two_towers

TOK = tok_lib.ByteTokenizer()
TEXT = dict(vocab_size=TOK.vocab_size, width=32, depth=2, num_heads=4, max_len=16)


def _ids(*texts, padding="pad"):
    return jnp.stack([tok_lib.tokenize(TOK, s, 16, padding=padding).ids for s in texts])


def test_eot_pooling_reads_the_eos_position_and_ignores_what_follows():
    model = text.TextTransformer(**TEXT, causal=True, pool="eot")
    ids = _ids("a red circle", "hi")
    variables = model.init(jax.random.key(0), ids)
    pooled, out = model.apply(variables, ids)
    eos = [len("a red circle") + 1, len("hi") + 1]
    np.testing.assert_allclose(pooled, out["encoded"][jnp.arange(2), jnp.array(eos)], atol=1e-6)
    # Causal: tokens after EOS cannot change the pooled embedding.
    noisy = ids.at[:, -1].set(77)
    np.testing.assert_allclose(model.apply(variables, noisy)[0], pooled, atol=1e-6)
    # eos_id=None uses argmax(ids) (EOS is the largest id): the same position.
    argmax_model = text.TextTransformer(**TEXT, causal=True, pool="eot", eos_id=TOK.eos_id)
    np.testing.assert_allclose(argmax_model.apply(variables, ids)[0], pooled, atol=1e-6)


def test_bidirectional_last_pooling_sees_every_token():
    model = text.TextTransformer(**TEXT, causal=False, pool="last")
    ids = _ids("a red circle", padding="eos")
    variables = model.init(jax.random.key(0), ids)
    pooled, out = model.apply(variables, ids)
    np.testing.assert_allclose(pooled, out["encoded"][:, -1], atol=1e-6)
    changed = model.apply(variables, ids.at[:, 1].set(5))[0]
    assert not np.allclose(changed, pooled, atol=1e-4)


def test_mean_pooling_ignores_padding_and_first_pooling():
    model = text.TextTransformer(**TEXT, causal=False, pool="mean")
    ids = _ids("abc")
    variables = model.init(jax.random.key(0), ids)
    pooled, out = model.apply(variables, ids)
    np.testing.assert_allclose(pooled[0], out["encoded"][0, :5].mean(0), atol=1e-6)  # BOS abc EOS
    first = text.TextTransformer(**TEXT, pool="first").apply(variables, ids)
    np.testing.assert_allclose(first[0], first[1]["encoded"][:, 0], atol=1e-6)


def test_text_bad_input():
    model = text.TextTransformer(**TEXT)
    variables = model.init(jax.random.key(0), _ids("a"))
    with pytest.raises(ValueError, match="exceeds max_len=16"):
        model.apply(variables, jnp.zeros((1, 20), jnp.int32))
    with pytest.raises(ValueError, match=r"\[B, L\]"):
        model.apply(variables, jnp.zeros((20,), jnp.int32))
    with pytest.raises(ValueError, match="Unknown text pool"):
        text.TextTransformer(**TEXT, pool="cls").init(jax.random.key(0), _ids("a"))


IMAGE = dict(width=32, depth=1, mlp_dim=64, num_heads=4, patch_size=8)


def test_two_towers_embeddings_temperature_and_bias():
    model = two_towers.TwoTowers(image=IMAGE, text=TEXT, embed_dim=16, bias_init=-10.0,
                                 temperature_init=10.0)
    images = jax.random.normal(jax.random.key(1), (2, 16, 16, 3))
    ids = _ids("a", "b")
    variables = model.init(jax.random.key(0), images, ids)
    zimg, ztxt, out = model.apply(variables, images, ids)
    assert zimg.shape == ztxt.shape == (2, 16)
    np.testing.assert_allclose(jnp.linalg.norm(zimg, axis=-1), 1.0, atol=1e-5)
    np.testing.assert_allclose(jnp.linalg.norm(ztxt, axis=-1), 1.0, atol=1e-5)
    np.testing.assert_allclose(variables["params"]["t"], [math.log(10.0)], rtol=1e-6)
    np.testing.assert_allclose(out["t"], 10.0, rtol=1e-5)
    np.testing.assert_allclose(out["b"], -10.0)
    assert "img/encoded" in out and "txt/encoded" in out and out["img/norm"].shape == (2,)
    # Image-only evaluation.
    zimg2, ztxt2, _ = model.apply(variables, images)
    np.testing.assert_allclose(zimg2, zimg, atol=1e-6)
    assert ztxt2 is None


def test_clip_temperature_init_and_clamp():
    model = two_towers.TwoTowers(image=IMAGE, text=None, embed_dim=8)
    variables = model.init(jax.random.key(0), jnp.zeros((1, 16, 16, 3)))
    np.testing.assert_allclose(jnp.exp(variables["params"]["t"]), 1 / 0.07, rtol=1e-5)
    assert "b" not in variables["params"]
    big = {**variables["params"], "t": jnp.array([math.log(500.0)])}
    np.testing.assert_allclose(jnp.exp(two_towers.clamp_temperature(big)["t"]), 100.0, rtol=1e-5)
    small = two_towers.clamp_temperature(variables["params"])
    np.testing.assert_allclose(small["t"], variables["params"]["t"])
    below = {**variables["params"], "t": jnp.array([math.log(0.5)])}  # open_clip's lower bound: t >= 1
    np.testing.assert_allclose(two_towers.clamp_temperature(below)["t"], 0.0)
    with pytest.raises(ValueError, match="no text tower"):
        model.apply(variables, None, _ids("a"))
