"""Decoding and scoring with a VLM: teacher-forced answer scoring and greedy generation.

Both read the model's output through ``vlm.text_logits`` (the last visual position predicts
``ids[1]``), so they agree with the training loss on which position predicts which token.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from vitmm import losses
from vitmm.models.vlm import VLM, text_logits


def answer_scores(model: VLM, variables, ids, answer_mask, *, images=None, features=None, prompt_len=None,
                  prefix_lm: bool = False) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]:
    """Teacher-forced answer scoring: ``(nll, correct, exact)`` with ``[B, L-1]`` per-position
    negative log-likelihoods and argmax hits, and ``[B]`` exact-match flags.

    ``ids`` is ``[BOS] prompt answer [EOS] PAD…`` and ``answer_mask`` marks answer + EOS (as
    ``qa_tokens`` makes them). ``exact`` is True iff the argmax is right at every answer
    position; that is precisely when greedy decoding reproduces the answer and its EOS (each
    greedy step sees the correct prefix until the first miss), so one forward pass gives
    greedy exact-match accuracy (tests check this against ``greedy_decode``).
    """
    logits = model.apply(variables, images, ids, prompt_len=prompt_len, prefix_lm=prefix_lm, features=features)
    num_visual = logits.shape[1] - ids.shape[1]
    logits = text_logits(logits, num_visual)[:, :-1]
    targets, mask = ids[:, 1:], answer_mask[:, 1:] > 0
    nll = losses.token_nll(logits, targets)
    correct = logits.argmax(-1) == targets
    return nll, correct, jnp.all(correct | ~mask, axis=1)


def _next_token(model, variables, images, ids, pos, prompt_len, num_visual, prefix_lm):
    logits = model.apply(variables, images, ids, prompt_len=prompt_len, prefix_lm=prefix_lm)
    logits = text_logits(logits, num_visual)
    return jnp.take_along_axis(logits, (pos - 1)[:, None, None], axis=1)[:, 0].argmax(-1)


class GreedyDecoder:
    """Greedy answers of ``model``: one compiled step per generated token, built once per
    decoder (the evaluator keeps one; flax modules with dict fields cannot be static jit args)."""

    def __init__(self, model: VLM):
        self.model = model
        self._step = jax.jit(functools.partial(_next_token, model), static_argnames=("num_visual", "prefix_lm"))

    def __call__(self, variables, images, prompt_ids: np.ndarray, prompt_len: np.ndarray, max_new_tokens: int,
                 eos_id: int, prefix_lm: bool = False) -> np.ndarray:
        """Answers ``[B, max_new_tokens]`` (EOS, then padding with EOS) after each prompt.

        ``prompt_ids: [B, L]`` holds BOS + prompt left-aligned, ``prompt_len`` their lengths. The
        step runs over a fixed-size buffer with room for ``max_new_tokens`` more and recomputes
        the whole sequence each time (no KV cache: answers here are a few tokens).
        """
        b, length = prompt_ids.shape
        buffer = np.zeros((b, length + max_new_tokens), np.int32)
        buffer[:, :length] = prompt_ids
        num_visual = self.model.apply(variables, images.shape[1:3], method=VLM.num_visual_tokens)
        pos = np.asarray(prompt_len).astype(np.int32).copy()
        prompt_len = jnp.asarray(pos)
        done = np.zeros(b, bool)
        out = np.full((b, max_new_tokens), eos_id, np.int32)
        for step in range(max_new_tokens):
            token = np.asarray(self._step(variables, images, jnp.asarray(buffer), jnp.asarray(pos), prompt_len,
                                          num_visual=num_visual, prefix_lm=prefix_lm))
            token = np.where(done, eos_id, token)
            out[:, step] = token
            buffer[np.arange(b), pos] = token
            pos = np.minimum(pos + 1, buffer.shape[1] - 1)
            done |= token == eos_id
            if done.all():
                break
        return out


def greedy_decode(model: VLM, variables, images, prompt_ids, prompt_len, max_new_tokens: int, eos_id: int,
                  prefix_lm: bool = False) -> np.ndarray:
    """``GreedyDecoder(model)(...)`` for a single call (compiles its step each time)."""
    return GreedyDecoder(model)(variables, images, prompt_ids, prompt_len, max_new_tokens, eos_id, prefix_lm)
