"""How a VLM's answers are scored: the ``qa`` evaluator's exact match at the edge of its token
budget, and teacher-forced ``answer_scores`` against a brute-force recomputation."""

import numpy as np
import pytest

from configs import common
from vitmm.data import tokenizer as tok_lib
from vitmm.train import vlm_evaluators

PP = "decode|resize(32)|value_range(-1, 1)|choose|qa_tokens(48)"


def _qa(data_dir, max_new_tokens: int, text: str):
    """A ``qa`` evaluator whose model always says ``text`` (its bytes, then EOS), cut as the real
    decoder cuts it: at the number of tokens it is asked for."""
    tok = tok_lib.ByteTokenizer()
    cfg = dict(data=dict(name=common.SMOKE_DATA, split="validation", data_dir=data_dir), pp=PP, num_examples=24,
               batch_size=16, max_new_tokens=max_new_tokens)
    qa = vlm_evaluators.QAAccuracy(None, cfg, tok, prefix_lm=False)

    def decode(variables, images, prompts, prompt_len, n, eos_ids, *args):
        row = (tok.encode(text) + [tok.eos_id] * n)[:n]
        return np.tile(np.array(row, np.int32), (len(images), 1))

    qa.decode = decode
    return qa


@pytest.mark.parametrize("said, right", [("yes", True), ("yess", False), ("yes, a star", False)])
def test_an_answer_filling_the_budget_is_exact_only_if_it_ends_there(data_dir, said, right):
    """``max_new_tokens=3`` and the reference "yes" (three bytes): a model that says "yes" and
    stops is right; one that goes on ("yess") is not, though its first three tokens are "yes"."""
    answers = vlm_evaluators.QAAccuracy.answers(_qa(data_dir, 3, said), {})
    references = np.array([a["answer"] for a in answers])
    assert 0 < np.mean(references == "yes") < 1
    expected = np.mean(references == "yes") if right else 0.0
    assert _qa(data_dir, 3, said).run({})["accuracy"] == pytest.approx(expected)
    assert {a["prediction"] for a in answers} == {said if right else said[:4]}


def _tiny_vlm():
    import jax
    import jax.numpy as jnp

    from vitmm.models import vlm as vlm_lib

    model = vlm_lib.VLM(dict(width=32, depth=1, mlp_dim=64, num_heads=4, patch_size=8), {"name": "pool", "budget": 4},
                        dict(vocab_size=259, width=32, depth=2, num_heads=4))
    images = jax.random.normal(jax.random.key(0), (2, 32, 32, 3))
    variables = model.init(jax.random.key(3), images, jnp.full((2, 4), 257, jnp.int32))
    return model, variables, images


def test_answer_scores_equal_a_forward_per_answer_token_on_its_own_prefix():
    """Brute force: each answer token's NLL is ``-log_softmax`` of the last logits of a forward on
    the text before it alone (no padding, no alignment helper); the answers of two rows of
    different lengths summed over the answer mask, and ``exact`` is every argmax right."""
    import jax
    import jax.numpy as jnp

    from vitmm import decode

    model, variables, images = _tiny_vlm()
    rows = [([257, 10, 11], [40, 41, 258]), ([257, 12, 13, 14, 15], [42, 258])]  # (prompt, answer + EOS)
    ids, mask = np.zeros((2, 8), np.int32), np.zeros((2, 8), np.float32)
    for i, (prompt, answer) in enumerate(rows):
        ids[i, : len(prompt) + len(answer)] = prompt + answer
        mask[i, len(prompt): len(prompt) + len(answer)] = 1
    scores = jax.jit(lambda ids, mask: decode.answer_scores(model, variables, ids, mask, images=images))
    nll, _, exact = scores(jnp.asarray(ids), jnp.asarray(mask))
    got = np.asarray((nll * mask[:, 1:]).sum(1))
    # right-padded to one length (one compile): the causal mask keeps the padding from the last real position
    forward = jax.jit(lambda image, text: jax.nn.log_softmax(model.apply(variables, image, text)[0]))
    for i, (prompt, answer) in enumerate(rows):
        seq, total, hits = prompt + answer, 0.0, []
        for t in range(len(prompt), len(seq)):
            logits = forward(images[i:i + 1], jnp.asarray([seq[:t] + [0] * (8 - t)], jnp.int32))
            last = logits[logits.shape[0] - 8 + t - 1]  # [BOS, visual..., text...]: the last of seq[:t]
            total -= float(last[seq[t]])
            hits.append(int(last.argmax()) == seq[t])
        assert got[i] == pytest.approx(total, rel=1e-5)
        assert bool(exact[i]) == all(hits)


def test_cached_greedy_decoding_stops_each_row_at_its_own_eos():
    """A batch of prompts of different lengths: the KV-cache decoder equals re-running the whole
    sequence per token, and with EOS set to a token one row produces early, that row stops there
    (then repeats EOS) while the other goes on as before."""
    import jax
    import jax.numpy as jnp

    from vitmm import decode

    model, variables, images = _tiny_vlm()
    prompts = [[257, 40], [257, 70, 80, 90, 100]]
    buffer = np.zeros((2, 5), np.int32)
    for i, p in enumerate(prompts):
        buffer[i, : len(p)] = p
    lengths = np.array([len(p) for p in prompts])
    decoder = decode.GreedyDecoder(model)
    free = decoder(variables, images, buffer, lengths, 5, eos_id=258)

    forward = jax.jit(lambda image, text: model.apply(variables, image, text)[0])

    def recomputed(i, eos):  # right-padded to one length: one compile, the padding unseen under the causal mask
        seq = list(prompts[i])
        for _ in range(5):
            logits = forward(images[i:i + 1], jnp.asarray([seq + [0] * (10 - len(seq))], jnp.int32))
            seq.append(int(np.asarray(logits[logits.shape[0] - 10 + len(seq) - 1]).argmax()))
        out = seq[len(prompts[i]):]
        return out[: out.index(eos) + 1] + [eos] * (4 - out.index(eos)) if eos in out else out

    assert [free[i].tolist() for i in range(2)] == [recomputed(0, 258), recomputed(1, 258)]
    eos = int(free[0, 1])  # row 0's second token, taken as EOS
    stopped = decoder(variables, images, buffer, lengths, 5, eos_id=eos)
    assert stopped[0].tolist() == free[0, :2].tolist() + [eos] * 3
    assert [stopped[i].tolist() for i in range(2)] == [recomputed(0, eos), recomputed(1, eos)]
