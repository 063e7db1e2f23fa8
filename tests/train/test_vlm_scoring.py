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
