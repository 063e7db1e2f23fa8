"""The Llama-style LM and the VLM: masks, RoPE, token layout, answer-only loss, greedy decoding."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from vitmm import decode, losses
from vitmm.data import tokenizer as tok_lib
from vitmm.models import lm as lm_lib
from vitmm.models import vlm as vlm_lib

LM_KW = dict(vocab_size=259, width=32, depth=2, num_heads=4)
VISION = dict(width=32, depth=2, mlp_dim=64, num_heads=4, patch_size=8)


def test_lm_is_causal_and_prefix_mask_opens_the_prefix():
    model = lm_lib.LM(**LM_KW)
    ids = jax.random.randint(jax.random.key(0), (2, 10), 1, 250)
    variables = model.init(jax.random.key(1), ids)
    logits = model.apply(variables, ids)
    assert logits.shape == (2, 10, 259)
    changed = model.apply(variables, ids.at[:, 6].set(7))
    np.testing.assert_allclose(changed[:, :6], logits[:, :6], atol=1e-5)  # the past never sees the future
    assert not np.allclose(changed[:, 6:], logits[:, 6:], atol=1e-4)
    prefix = model.apply(variables, ids, prefix_len=5)
    changed_prefix = model.apply(variables, ids.at[:, 4].set(7), prefix_len=5)
    assert not np.allclose(changed_prefix[:, 2], prefix[:, 2], atol=1e-4)  # inside the prefix: both ways
    mask = lm_lib.attention_mask(4, jnp.array([2]))
    np.testing.assert_array_equal(mask[0, 0], [[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]])


def test_the_lms_attention_implementation_is_a_setting_not_a_different_model():
    """``attn_impl`` picks jax.nn.dot_product_attention's kernel (cuDNN's fused one on a GPU:
    tests/train/test_dry_run.py compiles it for an H100); the same parameters and, with XLA's, the
    same logits; refused in one line where it cannot apply."""
    ids = jax.random.randint(jax.random.key(0), (2, 10), 1, 250)
    variables = lm_lib.LM(**LM_KW).init(jax.random.key(1), ids)
    np.testing.assert_array_equal(lm_lib.LM(**LM_KW, attn_impl="xla").apply(variables, ids, prefix_len=3),
                                  lm_lib.LM(**LM_KW).apply(variables, ids, prefix_len=3))
    with pytest.raises(ValueError, match="attn_impl='flash'"):
        lm_lib.LM(**LM_KW, attn_impl="flash").init(jax.random.key(1), ids)
    with pytest.raises(ValueError, match="no soft-capped scores"):
        lm_lib.LM(**LM_KW, attn_impl="cudnn", attn_softcap=50.0).init(jax.random.key(1), ids)


def test_gradient_checkpointing_recomputes_the_same_gradients():
    """``remat_policy`` (LLaVA's ``--gradient_checkpointing``): the same parameter names, logits
    and gradients (1e-6); only what the backward pass keeps changes."""
    ids = jax.random.randint(jax.random.key(0), (2, 10), 1, 250)
    plain, remat = lm_lib.LM(**LM_KW), lm_lib.LM(**LM_KW, remat_policy="nothing_saveable")
    variables = plain.init(jax.random.key(1), ids)
    assert jax.tree.structure(remat.init(jax.random.key(1), ids)) == jax.tree.structure(variables)
    grads = [jax.grad(lambda v, m=m: m.apply(v, ids, prefix_len=3).sum())(variables) for m in (plain, remat)]
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6), *grads)
    from vitmm.models import lora  # the adapters' branch is intercepted inside the checkpointed blocks too

    adapters = lora.init(variables["params"], (r".*attn/(q|v)$",), 4, jax.random.key(2))
    adapters = jax.tree.map(lambda x: x + 0.1, adapters)  # b starts at zero: non-zero to see its gradient
    grads = [jax.grad(lambda a, m=m: lora.apply(m, variables["params"], a, 8, ids).sum())(adapters)
             for m in (plain, remat)]
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), *grads)
    with pytest.raises(ValueError, match="remat_policy='all'"):
        lm_lib.LM(**LM_KW, remat_policy="all").init(jax.random.key(1), ids)


def test_a_cache_decodes_at_its_slots_and_refuses_tokens_past_its_end():
    """Without ``positions`` the tokens go where their slots are (a decode step is not position 0);
    tokens past the cache's end are an error, or NaN logits under jit, never keys written over."""
    model = lm_lib.LM(**LM_KW)
    ids = jnp.asarray([[5, 9, 14, 3]])
    params = model.init(jax.random.key(0), ids)
    full = jax.jit(model.apply)(params, ids)
    step = jax.jit(lambda ids, cache: model.apply(params, ids, cache=cache))  # (eager: ~1 s a call)
    first, cache = step(ids[:, :3], lm_lib.init_cache(LM_KW, 1, 4))
    last, cache = step(ids[:, 3:], cache)
    np.testing.assert_allclose(np.asarray(last[:, 0]), np.asarray(full[:, 3]), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="1 new token.* at cache slot 4 do not fit a cache of 4 slots"):
        model.apply(params, ids[:, :1], cache=cache)  # refused before any computation
    assert np.isnan(np.asarray(step(ids[:, 3:], cache)[0])).all()


def test_a_cached_prefix_lm_computes_what_the_forward_without_a_cache_does():
    """``prefix_len`` 3 with a cache: a prefill of 6 tokens (prefix and 3 more) and 2 decode steps
    give the logits of one forward pass over the 8 tokens without a cache; the prefix sees itself
    both ways, the token after it (slot 3) stays unseen by the prefix."""
    model = lm_lib.LM(**LM_KW)
    ids = jnp.asarray([[5, 9, 14, 3, 77, 21, 8, 40]])
    params = model.init(jax.random.key(0), ids)
    full = np.asarray(jax.jit(lambda i: model.apply(params, i, prefix_len=3))(ids))
    step = jax.jit(lambda ids, cache: model.apply(params, ids, cache=cache, prefix_len=3))
    got, cache = step(ids[:, :6], lm_lib.init_cache(LM_KW, 1, 8))
    for k in (6, 7):
        out, cache = step(ids[:, k:k + 1], cache)
        got = jnp.concatenate([got, out], axis=1)
    np.testing.assert_allclose(np.asarray(got), full, atol=1e-5, rtol=0)


def test_lm_has_no_biases_and_uses_rmsnorm_and_swiglu():
    params = lm_lib.LM(**LM_KW).init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
    block = params["block_00"]
    assert set(block["mlp"]) == {"gate", "up", "down"} and "bias" not in block["mlp"]["gate"]
    assert set(block["attn_norm"]) == {"scale"}  # RMSNorm: no bias
    assert set(block["attn"]) == {"q", "k", "v", "o"} and all("bias" not in p for p in block["attn"].values())


def test_lm_loss_counts_only_masked_positions():
    logits = jnp.log(jnp.array([[[0.7, 0.3], [0.1, 0.9], [0.5, 0.5]]]))
    targets = jnp.array([[0, 1, 0]])
    loss, acc = losses.lm_loss(logits, targets, jnp.array([[0, 1, 0]]))
    np.testing.assert_allclose(loss, -np.log(0.9), rtol=1e-6)
    assert float(acc) == 1.0


@pytest.mark.parametrize("connector, vision_layer, use_cls", [
    ({"name": "mlp"}, -2, False), ({"name": "pool", "budget": 4}, -1, True),
    ({"name": "qwen_resampler", "budget": 4}, -1, False)])
def test_vlm_places_visual_tokens_after_bos(connector, vision_layer, use_cls):
    model = vlm_lib.VLM(VISION, connector, LM_KW, vision_layer=vision_layer, use_cls=use_cls)
    images = jax.random.normal(jax.random.key(0), (2, 32, 32, 3))
    ids = jax.random.randint(jax.random.key(1), (2, 6), 1, 250).at[:, 0].set(257)
    variables = model.init(jax.random.key(2), images, ids)
    m = model.apply(variables, (32, 32), method=vlm_lib.VLM.num_visual_tokens)
    assert m == (16 if connector["name"] == "mlp" else 4) + int(use_cls)
    logits = model.apply(variables, images, ids)
    assert logits.shape == (2, 1 + m + 5, 259)
    assert vlm_lib.text_logits(logits, m).shape == (2, 6, 259)
    # Text logits after the image depend on the image.
    other = model.apply(variables, images[::-1], ids)
    assert not np.allclose(other[:, -1], logits[:, -1], atol=1e-5)
    # The visual positions hold the connector's output: splicing [BOS, visual, text] by hand into
    # the LM gives the same logits, and moving the visual tokens after the text changes the
    # logits at the text positions.
    visual = model.apply(variables, images, method=vlm_lib.VLM.visual_tokens)
    assert visual.shape == (2, m, LM_KW["width"])
    text = model.apply(variables, ids, method=lambda mod, i: mod.language.embed(i))
    by_hand = model.apply(variables, method=lambda mod: mod.language(
        embeds=jnp.concatenate([text[:, :1], visual, text[:, 1:]], axis=1)))
    np.testing.assert_allclose(by_hand, logits, atol=1e-5, rtol=0)
    moved = model.apply(variables, method=lambda mod: mod.language(
        embeds=jnp.concatenate([text, visual], axis=1)))
    assert not np.allclose(moved[:, 1:6], logits[:, 1 + m:], atol=1e-4)


@functools.cache  # one init per test process (~5 s eager); no test changes the variables
def _vlm_and_variables():
    model = vlm_lib.VLM(VISION, {"name": "pool", "budget": 4}, LM_KW)
    images = jax.random.normal(jax.random.key(0), (2, 32, 32, 3))
    variables = model.init(jax.random.key(3), images, jnp.full((2, 4), 257, jnp.int32))
    return model, variables, images


def test_the_first_text_prediction_sees_the_image():
    """With a BOS-only prompt the first predicted token comes from the last visual position
    (BOS cannot see the image under the causal mask)."""
    model, variables, images = _vlm_and_variables()
    m = model.apply(variables, (32, 32), method=vlm_lib.VLM.num_visual_tokens)
    bos = jnp.full((2, 1), 257, jnp.int32)
    first = vlm_lib.text_logits(model.apply(variables, images, bos), m)[:, 0]
    other = vlm_lib.text_logits(model.apply(variables, images[::-1], bos), m)[:, 0]
    assert first.shape == (2, 259)
    assert np.abs(np.asarray(first - other)).max() > 1e-3
    np.testing.assert_array_equal(first, model.apply(variables, images, bos)[:, -1])  # = the last visual


def test_greedy_decoding_equals_an_unpadded_step_by_step_forward():
    """Ragged prompts (BOS only, and BOS + 2 tokens) in one padded batch: each generated token
    equals the argmax at the last position of that example's own unpadded sequence."""
    model, variables, images = _vlm_and_variables()
    prompts = [[257], [257, 70, 80]]
    buffer = np.zeros((2, 3), np.int32)
    for i, p in enumerate(prompts):
        buffer[i, : len(p)] = p
    out = decode.greedy_decode(model, variables, images, buffer, np.array([1, 3]), max_new_tokens=4, eos_id=258)
    forward = jax.jit(lambda image, ids: model.apply(variables, image, ids))  # right-padded: one compile
    for i, p in enumerate(prompts):
        seq = list(p)
        for _ in range(4):
            logits = forward(images[i:i + 1], jnp.asarray([seq + [0] * (7 - len(seq))], jnp.int32))
            m = logits.shape[1] - 7  # the visual tokens; the causal mask keeps the padding out of what is read
            seq.append(int(np.asarray(logits[0, m + len(seq) - 1]).argmax()))
        want = seq[len(p):]
        if 258 in want:  # EOS, then EOS padding
            want = want[: want.index(258) + 1] + [258] * (3 - want.index(258))
        assert out[i].tolist() == want, (i, out[i].tolist(), want)


def test_vlm_learns_an_answer_and_greedy_decoding_returns_it():
    """Overfit two examples: the answer-only loss falls and greedy decoding reproduces answers."""
    tok = tok_lib.ByteTokenizer()
    model = vlm_lib.VLM(VISION, {"name": "pool", "budget": 4}, LM_KW)
    images = jnp.stack([jnp.zeros((32, 32, 3)), jnp.ones((32, 32, 3))])
    answers = ["red", "blue"]
    prompt = [tok.bos_id] + tok.encode("colour?")
    seqs = [prompt + tok.encode(a) + [tok.eos_id] for a in answers]
    length = max(map(len, seqs))
    ids = np.zeros((2, length), np.int32)
    answer_mask = np.zeros((2, length), np.float32)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = s
        answer_mask[i, len(prompt): len(s)] = 1  # answer + EOS are the targets
    ids, answer_mask = jnp.asarray(ids), jnp.asarray(answer_mask)
    variables = model.init(jax.random.key(0), images, ids)
    m = model.apply(variables, (32, 32), method=vlm_lib.VLM.num_visual_tokens)
    tx = optax.adam(3e-3)
    params, opt = variables["params"], tx.init(variables["params"])

    def loss_fn(p):
        logits = vlm_lib.text_logits(model.apply({"params": p}, images, ids), m)
        return losses.lm_loss(logits[:, :-1], ids[:, 1:], answer_mask[:, 1:])[0]

    @jax.jit
    def step(p, o):
        loss, g = jax.value_and_grad(loss_fn)(p)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o, loss

    first = None
    for _ in range(150):
        params, opt, loss = step(params, opt)
        first = first if first is not None else float(loss)
    assert float(loss) < 0.05 * first
    prompts = jnp.asarray(np.tile(np.array(prompt + [0] * (length - len(prompt)), np.int32), (2, 1)))
    out = decode.greedy_decode(model, {"params": params}, images, np.asarray(prompts),
                                np.full(2, len(prompt)), max_new_tokens=6, eos_id=tok.eos_id)
    decoded = [tok.decode(row[: list(row).index(tok.eos_id)] if tok.eos_id in row else row) for row in out]
    assert decoded == answers

    # Teacher-forced exact match agrees with greedy decoding: right answers score True; swapped
    # answers and a longer answer that greedy decoding would end early score False.
    def scored(texts):
        rows = [prompt + tok.encode(a) + [tok.eos_id] for a in texts]
        width = max(map(len, rows))
        seq, mask = np.zeros((2, width), np.int32), np.zeros((2, width), np.float32)
        for i, r in enumerate(rows):
            seq[i, : len(r)], mask[i, len(prompt): len(r)] = r, 1
        return np.asarray(decode.answer_scores(model, {"params": params}, jnp.asarray(seq), jnp.asarray(mask),
                                                images=images)[2])

    assert scored(answers).tolist() == [True, True]
    assert scored(answers[::-1]).tolist() == [False, False]
    assert scored(["redd", "blue"]).tolist() == [False, True]


def test_image_pos_puts_the_visual_tokens_where_the_placeholder_was():
    """``image_pos = p``: the LM reads ``ids[:p] visual ids[p:]`` (spliced by hand here), the last
    visual position predicts ``ids[p]``, and ``p = 1`` is the default layout exactly."""
    model, variables, images = _vlm_and_variables()
    m = model.apply(variables, (32, 32), method=vlm_lib.VLM.num_visual_tokens)
    ids = jax.random.randint(jax.random.key(5), (2, 7), 1, 250).at[:, 0].set(257)
    pos = np.array([3, 5])
    logits = model.apply(variables, images, ids, image_pos=pos)
    visual = model.apply(variables, images, method=vlm_lib.VLM.visual_tokens)
    text = model.apply(variables, ids, method=lambda mod, i: mod.language.embed(i))
    for i, p in enumerate(pos):
        spliced = jnp.concatenate([text[i:i + 1, :p], visual[i:i + 1], text[i:i + 1, p:]], axis=1)
        by_hand = model.apply(variables, method=lambda mod, e=spliced: mod.language(embeds=e))
        np.testing.assert_allclose(logits[i:i + 1], by_hand, atol=1e-5, rtol=0)
        aligned = vlm_lib.text_logits(logits, m, pos)[i]
        np.testing.assert_array_equal(aligned[p - 1], logits[i, p - 1 + m])  # the last visual predicts ids[p]
        np.testing.assert_array_equal(aligned[: p - 1], logits[i, : p - 1])
        np.testing.assert_array_equal(aligned[p:], logits[i, p + m:])
    np.testing.assert_array_equal(model.apply(variables, images, ids, image_pos=np.ones(2, np.int32)),
                                  model.apply(variables, images, ids))
    np.testing.assert_array_equal(vlm_lib.text_logits(logits, m, np.ones(2, np.int32)), logits[:, m:])


@pytest.mark.parametrize("image_pos", [None, np.array([3, 5])])
def test_text_logits_at_gives_the_full_text_logits_at_those_positions(image_pos):
    """The head run at chosen text positions only returns exactly ``text_logits`` there (≤ 1e-6),
    the last visual position's included (text position ``p - 1``)."""
    model, variables, images = _vlm_and_variables()
    m = model.apply(variables, (32, 32), method=vlm_lib.VLM.num_visual_tokens)
    ids = jax.random.randint(jax.random.key(5), (2, 7), 1, 250).at[:, 0].set(257)
    full = vlm_lib.text_logits(model.apply(variables, images, ids, image_pos=image_pos), m, image_pos)
    at = np.array([[0, 2, 4, 6], [4, 1, 5, 3]])
    some = model.apply(variables, images, ids, image_pos=image_pos, text_logits_at=at)
    assert some.shape == (2, 4, 259)
    np.testing.assert_allclose(some, np.take_along_axis(np.asarray(full), at[..., None], 1), atol=1e-6, rtol=0)


@pytest.mark.parametrize("prefix_lm", [False, True])
def test_cached_decoding_equals_the_full_forward_with_image_pos_and_prefix(prefix_lm):
    """The KV-cache prefill's logits equal the full forward's at each prompt's last position
    (≤ 1e-5), and greedy decoding over the cache equals re-running the whole sequence per token,
    for ragged prompts with the image inside them and the prefix-LM mask."""
    model, variables, images = _vlm_and_variables()
    m = model.apply(variables, (32, 32), method=vlm_lib.VLM.num_visual_tokens)
    prompts, pos = [[257, 40], [257, 70, 80, 90]], np.array([2, 3])
    buffer = np.zeros((2, 4), np.int32)
    for i, p in enumerate(prompts):
        buffer[i, : len(p)] = p
    lengths = np.array([len(p) for p in prompts])
    cache = lm_lib.init_cache(LM_KW, 2, 4 + m + 3)
    first, _ = jax.jit(lambda *a: model.apply(variables, *a, prefix_lm, method=vlm_lib.VLM.prefill))(
        images, jnp.asarray(buffer), lengths, cache, pos)  # one program each: eager costs seconds
    out = decode.greedy_decode(model, variables, images, buffer, lengths, 3, eos_id=258, prefix_lm=prefix_lm,
                               image_pos=pos)
    forward = jax.jit(lambda image, ids, image_pos, prompt_len: model.apply(
        variables, image, ids, image_pos=image_pos, prompt_len=prompt_len, prefix_lm=prefix_lm))
    for i, p in enumerate(prompts):
        seq = list(p)
        for step in range(3):
            logits = forward(images[i:i + 1], jnp.asarray([seq], jnp.int32), pos[i:i + 1], lengths[i:i + 1])[0, -1]
            if step == 0:
                np.testing.assert_allclose(first[i], logits, atol=1e-5, rtol=0)
            seq.append(int(np.asarray(logits).argmax()))
        want = seq[len(p):]
        if 258 in want:
            want = want[: want.index(258) + 1] + [258] * (2 - want.index(258))
        assert out[i].tolist() == want, (i, out[i].tolist(), want)
