"""The text ops of ``data.preprocess`` (registered there as ``tokenize`` and ``qa_tokens``):
token ids for the towers, and question/answer sequences for the VLM, plain or in an LM's chat
template."""

from __future__ import annotations

import numpy as np

from vitmm.data import tokenizer as tok_lib


def tokenize(key, max_len, out_key=None, tokenizer=None, add_bos=True, add_eos=True, padding="pad",
             truncation="right"):
    tokenizer = tokenizer or tok_lib.ByteTokenizer()
    out_key = out_key or f"{key}_tokens"

    def fn(ex, rng):
        text = ex[key]
        if isinstance(text, bytes):
            text = text.decode("utf-8")
        result = tok_lib.tokenize(tokenizer, text, max_len, add_bos=add_bos, add_eos=add_eos,
                                  padding=padding, truncation=truncation)
        ex[out_key] = result.ids
        ex[f"{out_key}_truncated"] = np.bool_(result.truncated)
        return ex

    return fn


IMAGE_PLACEHOLDER = "<image>"  # where a chat prompt's visual tokens go (LLaVA's convention)


def qa_tokens(max_len, question_key="question", answer_key="answer", tokenizer=None, separator=" ", chat=False,
              system=None, max_answer=None):
    """A question and its answer as one VLM sequence: ``ids`` (int32 ``[max_len]``, PAD after),
    ``answer_mask`` (1 on the tokens the VLM is trained to produce), ``prompt_len`` (the tokens
    before the answer) and ``qa_truncated``.

    Plain (``chat=False``): ``[BOS] question separator answer [EOS]``; the image goes after BOS
    (``image_pos`` 1).
    A question too long for ``max_len`` is cut from the right so that the whole answer fits.

    ``chat=True``: the tokenizer's chat template (a converted LM's) renders a user turn
    ``"<image>\nquestion"`` (after a ``system`` turn when given) and the assistant's answer; the
    answer mask covers the assistant's answer up to and including EOS (the template's end of
    turn), ``image_pos`` is where ``<image>`` stood (the visual tokens go there), and the text
    after EOS is dropped. A chat example that does not fit ``max_len`` is an error.

    ``max_answer``: an answer of more tokens (EOS included) is an error (a VLM whose loss reads
    ``model.loss_positions`` answer tokens per example would drop the rest).
    """
    tokenizer = tokenizer or tok_lib.ByteTokenizer()
    fn = _qa_chat(max_len, question_key, answer_key, tokenizer, system) if chat else \
        _qa_plain(max_len, question_key, answer_key, tokenizer, separator)
    if max_answer is None:
        return fn

    def checked(ex, rng):
        ex = fn(ex, rng)
        if ex["answer_mask"].sum() > max_answer:
            raise ValueError(f"qa_tokens: the answer {ex[answer_key]!r} is {int(ex['answer_mask'].sum())} tokens with "
                             f"EOS, more than max_answer={max_answer} (model.loss_positions, the answer tokens the "
                             "loss reads); raise model.loss_positions.")
        return ex

    return checked


def _qa_plain(max_len, question_key, answer_key, tokenizer, separator):

    def fn(ex, rng):
        question = tokenizer.encode(ex[question_key] + separator)
        answer = tokenizer.encode(ex[answer_key]) + [tokenizer.eos_id]
        room = max_len - 1 - len(answer)
        if room < 1:
            raise ValueError(f"qa_tokens: answer {ex[answer_key]!r} does not fit max_len={max_len}.")
        truncated = len(question) > room
        question = question[:room]
        seq = [tokenizer.bos_id] + question + answer
        ids = np.full(max_len, tokenizer.pad_id, np.int32)
        ids[: len(seq)] = seq
        mask = np.zeros(max_len, np.float32)
        mask[1 + len(question): len(seq)] = 1.0
        ex["ids"], ex["answer_mask"] = ids, mask
        ex["prompt_len"], ex["qa_truncated"] = np.int32(1 + len(question)), np.bool_(truncated)
        ex["image_pos"] = np.int32(1)
        return ex

    return fn


def _qa_chat(max_len, question_key, answer_key, tokenizer, system):
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("qa_tokens(chat=True) needs a tokenizer with a chat template: set init.lm to a converted "
                         "LM (`python -m vitmm.interop --from hf|gguf`), whose tokenizer and template the run uses.")
    head = [{"role": "system", "content": system}] if system else []

    def fn(ex, rng):
        user = head + [{"role": "user", "content": f"{IMAGE_PLACEHOLDER}\n{ex[question_key]}"}]
        prompt = tokenizer.chat(user, add_generation_prompt=True)
        full = tokenizer.chat(user + [{"role": "assistant", "content": ex[answer_key]}])
        if not full.startswith(prompt) or prompt.count(IMAGE_PLACEHOLDER) != 1:
            raise ValueError("qa_tokens(chat=True): the chat template must render the prompt as a prefix of the whole "
                             f"exchange with one {IMAGE_PLACEHOLDER}; got {prompt!r} and {full!r}.")
        before, after = prompt.split(IMAGE_PLACEHOLDER)
        before, after = tokenizer.encode(before), tokenizer.encode(after)
        answer = tokenizer.encode(full[len(prompt):])
        if tokenizer.eos_id not in answer:
            raise ValueError(f"qa_tokens(chat=True): the assistant's turn {full[len(prompt):]!r} has no EOS (id "
                             f"{tokenizer.eos_id}) to stop at; convert the LM with its end-of-turn token as EOS.")
        answer = answer[: answer.index(tokenizer.eos_id) + 1]
        seq = before + after + answer
        if not before:
            raise ValueError("qa_tokens(chat=True): the chat template puts no token before <image>.")
        if len(seq) > max_len:
            raise ValueError(f"qa_tokens(chat=True): the exchange is {len(seq)} tokens, more than max_len={max_len}; "
                             "raise model.max_len.")
        ids = np.full(max_len, tokenizer.pad_id, np.int32)
        ids[: len(seq)] = seq
        mask = np.zeros(max_len, np.float32)
        mask[len(before) + len(after): len(seq)] = 1.0
        ex["ids"], ex["answer_mask"], ex["image_pos"] = ids, mask, np.int32(len(before))
        ex["prompt_len"], ex["qa_truncated"] = np.int32(len(before) + len(after)), np.bool_(False)
        return ex

    return fn
