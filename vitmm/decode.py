"""Decoding and scoring: teacher-forced answer scoring and greedy generation with a VLM, and
KV-cache generation (greedy or sampled) with a language model.

The VLM paths read the model's output through ``vlm.text_logits`` (the last visual position
predicts ``ids[1]``), so they agree with the training loss on which position predicts which
token. ``Generator`` prefills a batch of left-padded prompts into a fixed-size KV cache and then
runs one compiled step per token; its logits equal the no-cache forward's (tested).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from vitmm import losses
from vitmm.models import lm as lm_lib
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


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """``(ids [B, L], mask [B, L])`` with each prompt at the right end (what ``Generator`` takes)."""
    length = max(len(p) for p in prompts)
    ids = np.full((len(prompts), length), pad_id, np.int32)
    mask = np.zeros((len(prompts), length), bool)
    for i, p in enumerate(prompts):
        if p:
            ids[i, length - len(p):], mask[i, length - len(p):] = p, True
    return ids, mask


def sample(logits: jnp.ndarray, key, temperature: float, top_p: float) -> jnp.ndarray:
    """Next tokens ``[B]`` from ``logits [B, vocab]``: argmax at temperature 0, else a draw from
    the softmax at ``temperature`` restricted to the smallest set of tokens whose probability
    reaches ``top_p`` (nucleus sampling; the most likely token always stays)."""
    if temperature == 0:
        return logits.argmax(-1).astype(jnp.int32)
    logits = logits / temperature
    if top_p < 1.0:
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, -1)
        before = jnp.cumsum(jax.nn.softmax(sorted_logits, -1), -1) - jax.nn.softmax(sorted_logits, -1)
        keep_sorted = before < top_p  # the mass before a token is below top_p: it is in the nucleus
        keep = jnp.zeros_like(keep_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(keep_sorted)
        logits = jnp.where(keep, logits, -jnp.inf)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


class Generator:
    """``LM`` generation over a KV cache: ``generate(params, ids, mask, max_new_tokens, eos_id,
    temperature=0.0, top_p=1.0, seed=0) -> [B, max_new_tokens]`` (EOS, then EOS padding).

    ``ids``/``mask`` hold left-padded prompts (``left_pad``); positions count real tokens, so a
    padded prompt decodes as it would alone. The prefill and the one-token step are each
    compiled once per (batch, prompt length, cache length).
    """

    def __init__(self, lm_config: dict):
        self.lm_config = dict(lm_config)
        self.model = lm_lib.LM(**self.lm_config)
        self._prefill = jax.jit(self._prefill_fn)
        self._step = jax.jit(self._step_fn, static_argnames=("temperature", "top_p"), donate_argnums=(1,))

    def _prefill_fn(self, params, ids, mask, cache):
        positions = jnp.maximum(jnp.cumsum(mask, -1) - 1, 0)
        logits, cache = self.model.apply({"params": params}, ids, pad_mask=mask, positions=positions, cache=cache)
        return logits[:, -1], cache

    def _step_fn(self, params, cache, token, position, key, temperature, top_p):
        logits, cache = self.model.apply({"params": params}, token[:, None], positions=position[:, None], cache=cache)
        return sample(logits[:, -1], key, temperature, top_p), logits[:, -1], cache

    def logits(self, params, ids, mask, continuation: np.ndarray) -> np.ndarray:
        """Logits ``[B, 1 + n, vocab]`` after the prompt and after each of the ``n`` forced
        ``continuation [B, n]`` tokens, through the cache (what the tests compare)."""
        b, length = ids.shape
        cache = lm_lib.init_cache(self.lm_config, b, length + continuation.shape[1])
        last, cache = self._prefill(params, jnp.asarray(ids), jnp.asarray(mask), cache)
        out, position = [last], jnp.asarray(np.asarray(mask).sum(-1), jnp.int32)
        for i in range(continuation.shape[1]):
            _, last, cache = self._step(params, cache, jnp.asarray(continuation[:, i], jnp.int32), position,
                                        jax.random.key(0), 0.0, 1.0)
            out.append(last)
            position = position + 1
        return np.stack([np.asarray(x) for x in out], axis=1)

    def generate(self, params, ids, mask, max_new_tokens: int, eos_id: int, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int = 0) -> np.ndarray:
        b, length = ids.shape
        cache = lm_lib.init_cache(self.lm_config, b, length + max_new_tokens)
        last, cache = self._prefill(params, jnp.asarray(ids), jnp.asarray(mask), cache)
        key = jax.random.key(seed)
        token = sample(last, jax.random.fold_in(key, 0), temperature, top_p)
        position = jnp.asarray(np.asarray(mask).sum(-1), jnp.int32)
        out = np.full((b, max_new_tokens), eos_id, np.int32)
        done = np.zeros(b, bool)
        for step in range(max_new_tokens):
            now = np.where(done, eos_id, np.asarray(token))
            out[:, step] = now
            done |= now == eos_id
            if done.all() or step == max_new_tokens - 1:
                break
            token, _, cache = self._step(params, cache, jnp.asarray(now), position, jax.random.fold_in(key, step + 1),
                                         float(temperature), float(top_p))
            position = position + 1
        return out
