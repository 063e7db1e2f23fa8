"""KV-cache generation: the cached logits equal the no-cache forward's, greedy decoding equals a
recompute-everything loop, sampling is seeded and top-p tiny is greedy, EOS stops a row."""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vitmm import decode
from vitmm.interop import hf_lm
from vitmm.models.lm import LM

FIXTURE = pathlib.Path(__file__).resolve().parent / "fixtures/interop/hf_llama"  # GQA, Llama 3 RoPE


@pytest.fixture(scope="session")
def llama():
    kwargs, params = hf_lm.load_lm(FIXTURE)
    return kwargs, params, decode.Generator(kwargs)


def _full_logits(kwargs, params, ids, mask):
    positions = np.maximum(np.cumsum(mask, -1) - 1, 0)
    return np.asarray(LM(**kwargs).apply({"params": params}, jnp.asarray(ids), pad_mask=jnp.asarray(mask),
                                         positions=jnp.asarray(positions)))


def test_cached_logits_equal_the_full_forward_on_ragged_prompts(llama):
    kwargs, params, gen = llama
    ids, mask = decode.left_pad([[5, 17, 33, 8, 41], [9, 12]], pad_id=0)
    continuation = np.array([[7, 70, 3], [44, 2, 61]], np.int32)
    cached = gen.logits(params, ids, mask, continuation)  # [B, 4, vocab]
    full_ids = np.concatenate([ids, continuation], 1)
    full_mask = np.concatenate([mask, np.ones_like(continuation, bool)], 1)
    full = _full_logits(kwargs, params, full_ids, full_mask)[:, ids.shape[1] - 1:]
    err = np.abs(cached - full).max() / np.abs(full).max()
    assert err <= 1e-5, err
    # and the short prompt decodes as it would alone, unpadded
    alone = _full_logits(kwargs, params, full_ids[1:, 3:], full_mask[1:, 3:])[:, 1:]
    np.testing.assert_allclose(cached[1], alone[0], rtol=1e-5, atol=1e-5 * np.abs(alone).max())


def test_greedy_generation_equals_recomputing_the_sequence(llama):
    kwargs, params, gen = llama
    prompts = [[5, 17, 33, 8, 41], [9, 12]]
    ids, mask = decode.left_pad(prompts, pad_id=0)
    out = gen.generate(params, ids, mask, max_new_tokens=6, eos_id=95)
    # each prompt alone, the whole sequence recomputed per token; right-padded to one length (one
    # compile), which the causal mask keeps from the positions read
    forward = jax.jit(lambda ids: LM(**kwargs).apply({"params": params}, ids))
    for row, prompt in enumerate(prompts):
        seq = list(prompt)
        for _ in range(6):
            logits = np.asarray(forward(jnp.asarray([seq + [0] * (11 - len(seq))])))
            seq.append(int(logits[0, len(seq) - 1].argmax()))
        expected = seq[len(prompt):]
        if 95 in expected:
            stop = expected.index(95)
            expected = expected[:stop + 1] + [95] * (5 - stop)
        assert out[row].tolist() == expected


def test_sampling_is_seeded_top_p_tiny_is_greedy_and_eos_stops_a_row(llama):
    _, params, gen = llama
    ids, mask = decode.left_pad([[5, 17, 33], [9, 12, 40]], pad_id=0)
    greedy = gen.generate(params, ids, mask, 8, eos_id=95)
    a = gen.generate(params, ids, mask, 8, eos_id=95, temperature=1.0, seed=1)
    b = gen.generate(params, ids, mask, 8, eos_id=95, temperature=1.0, seed=1)
    c = gen.generate(params, ids, mask, 8, eos_id=95, temperature=1.0, seed=2)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    np.testing.assert_array_equal(gen.generate(params, ids, mask, 8, eos_id=95, temperature=1.0, top_p=1e-6, seed=3),
                                  greedy)
    compiled = gen._step._cache_size()
    for temperature, top_p in ((0.7, 0.9), (1.3, 1.0), (0.2, 0.5)):  # what clients send: no new program each
        gen.generate(params, ids, mask, 8, eos_id=95, temperature=temperature, top_p=top_p, seed=4)
    assert gen._step._cache_size() == compiled
    eos = int(greedy[0, 2])  # pretend the third greedy token of row 0 is EOS
    stopped = gen.generate(params, ids, mask, 8, eos_id=eos)
    assert stopped[0, :3].tolist() == greedy[0, :3].tolist() and (stopped[0, 3:] == eos).all()


def test_any_of_several_eos_ids_ends_a_row_which_then_repeats_the_first():
    """An instruct LM's end of turn (107) ends a row as its EOS (1) does; a finished row repeats the
    first id, and decoding stops once every row has ended."""
    steps = iter([[107, 5], [9, 1], [3, 3]])
    rows = decode.stream_until_eos(np.array([4, 4]), 10, (1, 107), lambda now, i: np.array(next(steps)))
    assert [row.tolist() for row in rows] == [[4, 4], [107, 5], [1, 1]]


def test_top_p_keeps_the_nucleus_only():
    import jax

    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    draws = np.asarray([decode.sample(logits, jax.random.key(i), 1.0, 0.7)[0] for i in range(200)])
    assert set(draws) == {0, 1}  # 0.5 + 0.3 reach 0.7; 0.15 and 0.05 never drawn
    assert {int(decode.sample(logits, jax.random.key(i), 1.0, 0.0)[0]) for i in range(20)} == {0}  # top_p 0: greedy


def test_top_p_stops_at_the_first_token_whose_mass_reaches_it():
    """Four equally likely tokens (probabilities exactly 1/4) and top_p 0.5: two tokens reach it, so a
    third is never drawn (the smallest such set, as Hugging Face's TopPLogitsWarper keeps)."""
    import jax

    logits = jnp.zeros((1, 4))
    draws = {int(decode.sample(logits, jax.random.key(i), 1.0, 0.5)[0]) for i in range(64)}
    assert len(draws) == 2


def test_an_lms_embedding_rows_past_the_tokenizers_ids_are_never_chosen(llama):
    """Qwen pads its embedding past its tokenizer's ids: ``vocab_size`` (the tokenizer's) keeps the
    padded rows' logits out of greedy and sampled choices, in ``sample`` and in the generator."""
    logits = jnp.array([[0.0, 1.0, 5.0, 9.0]])  # rows 2 and 3: padding past a 2-id tokenizer
    assert int(decode.sample(logits, jax.random.key(0), 0.0, 1.0, vocab_size=2)[0]) == 1
    assert {int(decode.sample(logits, jax.random.key(i), 3.0, 1.0, vocab_size=2)[0]) for i in range(50)} == {0, 1}
    assert int(decode.sample(logits, jax.random.key(0), 0.0, 1.0, vocab_size=4)[0]) == 3
    kwargs, params, gen = llama
    ids, mask = decode.left_pad([[5, 17, 33], [9, 12, 40]], pad_id=0)
    greedy = gen.generate(params, ids, mask, 6, eos_id=0)
    cut = int(greedy.max())  # the largest id chosen unmasked: no longer a token
    masked = decode.Generator(kwargs, vocab_size=cut)
    for temperature in (0.0, 1.5):
        out = masked.generate(params, ids, mask, 6, eos_id=0, temperature=temperature, seed=1)
        assert out.max() < cut
