"""Decoding and scoring: teacher-forced answer scoring, and KV-cache generation (greedy or
sampled) with a VLM and with a language model.

Teacher-forced scoring reads the VLM's output through ``vlm.text_logits`` (the last visual
position predicts the token after the image), as the training loss does; ``GreedyDecoder``
prefills image and prompt into a KV cache and decodes one compiled step per token.
``Generator`` prefills a batch of left-padded prompts into a fixed-size KV cache and then runs
one compiled step per token. Both caches give the no-cache forward's logits (tested).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from vitmm import losses
from vitmm.models import lm as lm_lib
from vitmm.models.vlm import VLM, text_logits


def answer_scores(model: VLM, variables, ids, answer_mask, *, images=None, features=None, prompt_len=None,
                  prefix_lm: bool = False, image_pos=None,
                  visual_mask=None) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]:
    """Teacher-forced answer scoring: ``(nll, correct, exact)`` with ``[B, L-1]`` per-position
    negative log-likelihoods and argmax hits, and ``[B]`` exact-match flags.

    ``ids`` is ``[BOS] prompt answer [EOS] PAD…`` and ``answer_mask`` marks answer + EOS (as
    ``qa_tokens`` makes them). ``exact`` is True iff the argmax is right at every answer
    position; that is precisely when greedy decoding reproduces the answer and its EOS (each
    greedy step sees the correct prefix until the first miss), so one forward pass gives
    greedy exact-match accuracy (tests check this against ``greedy_decode``). ``visual_mask``:
    images with different token counts in one batch (``VLM.__call__``).
    """
    logits = model.apply(variables, images, ids, prompt_len=prompt_len, prefix_lm=prefix_lm, features=features,
                         image_pos=image_pos, visual_mask=visual_mask)
    num_visual = logits.shape[1] - ids.shape[1]
    logits = text_logits(logits, num_visual, image_pos)[:, :-1]
    targets, mask = ids[:, 1:], answer_mask[:, 1:] > 0
    nll = losses.token_nll(logits, targets)
    correct = logits.argmax(-1) == targets
    return nll, correct, jnp.all(correct | ~mask, axis=1)


class GreedyDecoder:
    """Answers of a VLM over a KV cache, greedy (or sampled: ``temperature``): the image and the
    prompts are prefilled once, then one compiled step per generated token (each compiled once per shape; the evaluator
    keeps one decoder)."""

    def __init__(self, model: VLM, vocab_size: int | None = None):
        self.model, self.vocab_size = model, vocab_size  # the tokenizer's: logits past it are never sampled

        def prefill(variables, images, ids, prompt_len, cache, image_pos, prefix_lm, visual_mask, layout):
            return model.apply(variables, images, ids, prompt_len, cache, image_pos, prefix_lm, visual_mask, layout,
                               method=VLM.prefill)

        def step(variables, token, position, cache, key, temperature, top_p, greedy):
            logits, cache = model.apply(variables, token, position, cache, method=VLM.step)
            return sample(logits, key, temperature, top_p, greedy, vocab_size), cache

        def prefill_sequences(variables, images, tokens, visual, lengths, cache, prefix_lm, positions):
            return model.apply(variables, images, tokens, visual, lengths, cache, prefix_lm, positions,
                               method=VLM.prefill_sequences)

        self._prefill = jax.jit(prefill, static_argnames=("prefix_lm",))
        self._prefill_sequences = jax.jit(prefill_sequences, static_argnames=("prefix_lm",))
        # temperature and top_p traced: one program serves every setting a client sends (greedy or not: two)
        self._step = jax.jit(step, donate_argnums=(3,), static_argnames=("greedy",))

    def __call__(self, variables, images, prompt_ids: np.ndarray, prompt_len: np.ndarray, max_new_tokens: int,
                 eos_id, prefix_lm: bool = False, image_pos=None, visual_mask=None, layout=None,
                 temperature: float = 0.0, top_p: float = 1.0, seed: int = 0) -> np.ndarray:
        """Answers ``[B, max_new_tokens]`` (EOS, then padding with EOS) after each prompt; ``eos_id``:
        an id or several (``stream_until_eos``).

        ``prompt_ids: [B, L]`` holds each prompt (BOS included) left-aligned, ``prompt_len`` their
        lengths; whatever follows a prompt in its row is ignored. ``image_pos``, ``visual_mask``
        (images with different token counts) and ``layout`` (AnyRes views) as in ``VLM``.
        ``temperature`` 0: greedy; else sampled (``sample``: ``top_p``, from ``seed``).
        """
        out = np.full((prompt_ids.shape[0], max_new_tokens), np.atleast_1d(eos_id)[0], np.int32)
        for i, now in enumerate(self.stream(variables, images, prompt_ids, prompt_len, max_new_tokens, eos_id,
                                            prefix_lm, image_pos, visual_mask, layout, temperature, top_p, seed)):
            out[:, i] = now
        return out

    def stream(self, variables, images, prompt_ids: np.ndarray, prompt_len: np.ndarray, max_new_tokens: int,
               eos_id, prefix_lm: bool = False, image_pos=None, visual_mask=None, layout=None,
               temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, cache_len: int | None = None):
        """``__call__``'s tokens one step at a time: ``[B]`` arrays (a finished row repeats EOS).
        ``cache_len``: a longer KV cache than needed (a server rounds shapes up so that few compile)."""
        b, length = prompt_ids.shape
        num_visual = (self.model.apply(variables, images.shape[1:3], method=VLM.num_visual_tokens) if layout is None
                      else np.shape(layout[0] if isinstance(layout, tuple) else layout)[1])
        cache = lm_lib.init_cache(self.model.lm, b, max(cache_len or 0, length + num_visual + max_new_tokens))
        prompt_len = jnp.asarray(np.asarray(prompt_len), jnp.int32)
        optional = lambda x: None if x is None else jax.tree.map(jnp.asarray, x)  # noqa: E731 - layout: maybe a pair
        logits, cache = self._prefill(variables, images, jnp.asarray(prompt_ids), prompt_len, cache,
                                      None if image_pos is None else jnp.asarray(image_pos, jnp.int32),
                                      prefix_lm, optional(visual_mask), optional(layout))
        shown = num_visual if visual_mask is None else jnp.asarray(np.asarray(visual_mask).sum(-1), jnp.int32)
        yield from self._continue(variables, logits, cache, prompt_len + shown, max_new_tokens, eos_id, temperature,
                                  top_p, seed)

    def stream_sequences(self, variables, images, tokens: np.ndarray, visual: np.ndarray, lengths: np.ndarray,
                         max_new_tokens: int, eos_id, prefix_lm: bool = False, temperature: float = 0.0,
                         top_p: float = 1.0, seed: int = 0, cache_len: int | None = None, positions=None):
        """``stream`` for prompts as flat sequences (``VLM.prefill_sequences``: any number of
        images a prompt; ``positions [3, B, T]`` with M-RoPE)."""
        cache = lm_lib.init_cache(self.model.lm, tokens.shape[0], max(cache_len or 0, tokens.shape[1] + max_new_tokens))
        lengths = jnp.asarray(np.asarray(lengths), jnp.int32)
        images = jax.tree.map(jnp.asarray, images)  # an array, or a models.packing.Packed batch
        logits, cache = self._prefill_sequences(variables, images, jnp.asarray(tokens),
                                                jnp.asarray(visual), lengths, cache, prefix_lm,
                                                None if positions is None else jnp.asarray(positions, jnp.int32))
        yield from self._continue(variables, logits, cache, lengths, max_new_tokens, eos_id, temperature, top_p, seed)

    def _continue(self, variables, logits, cache, position, max_new_tokens, eos_id, temperature, top_p, seed):
        """The tokens after a prefill's ``logits``, the next one at sequence ``position [B]``."""
        state = {"cache": cache, "position": position}
        key, temperature, top_p = jax.random.key(seed), float(temperature), float(top_p)

        def step(now, i):
            token, state["cache"] = self._step(variables, jnp.asarray(now), state["position"] + i, state["cache"],
                                               jax.random.fold_in(key, i + 1), temperature, top_p,
                                               greedy=temperature == 0)
            return token

        first = sample(logits, jax.random.fold_in(key, 0), temperature, top_p, vocab_size=self.vocab_size)
        yield from stream_until_eos(first, max_new_tokens, eos_id, step)


def stream_until_eos(first, max_new_tokens: int, eos_id, step):
    """Yields ``[B]`` tokens: ``first``, then ``step(previous [B], i)`` for the one after the
    ``i``-th. ``eos_id``: an id, or several (an instruct LM's end of turn and its EOS): a row that
    has produced any of them is finished and repeats the first; it stops when every row is (or the
    budget is spent)."""
    eos_ids = np.atleast_1d(np.asarray(eos_id, np.int32))
    done, token = np.zeros(first.shape[0], bool), first
    for i in range(max_new_tokens):
        now = np.where(done, eos_ids[0], np.asarray(token)).astype(np.int32)
        yield now
        done |= np.isin(now, eos_ids)
        if done.all() or i == max_new_tokens - 1:
            return
        token = step(now, i)


def greedy_decode(model: VLM, variables, images, prompt_ids, prompt_len, max_new_tokens: int, eos_id: int,
                  prefix_lm: bool = False, image_pos=None, visual_mask=None, layout=None) -> np.ndarray:
    """``GreedyDecoder(model)(...)`` for a single call (compiles its steps each time)."""
    return GreedyDecoder(model)(variables, images, prompt_ids, prompt_len, max_new_tokens, eos_id, prefix_lm,
                                image_pos, visual_mask, layout)


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """``(ids [B, L], mask [B, L])`` with each prompt at the right end (what ``Generator`` takes)."""
    length = max(len(p) for p in prompts)
    ids = np.full((len(prompts), length), pad_id, np.int32)
    mask = np.zeros((len(prompts), length), bool)
    for i, p in enumerate(prompts):
        if p:
            ids[i, length - len(p):], mask[i, length - len(p):] = p, True
    return ids, mask


def sample(logits: jnp.ndarray, key, temperature, top_p, greedy: bool | None = None,
           vocab_size: int | None = None) -> jnp.ndarray:
    """Next tokens ``[B]`` from ``logits [B, vocab]``: argmax at temperature 0, else a draw from
    the softmax at ``temperature`` restricted to the smallest set of tokens whose probability
    reaches ``top_p`` (nucleus sampling; the most likely token always stays; ``top_p`` 1: every
    token). ``temperature`` and ``top_p`` may be traced; ``greedy`` (static) then says which of
    the two it is (default: ``temperature == 0`` for a number). ``vocab_size``: the tokenizer's
    ids; an LM's embedding rows past them (Qwen pads its embedding) are never chosen."""
    if vocab_size is not None and vocab_size < logits.shape[-1]:
        logits = jnp.where(jnp.arange(logits.shape[-1]) < vocab_size, logits, -jnp.inf)
    if temperature == 0 if greedy is None else greedy:
        return logits.argmax(-1).astype(jnp.int32)
    logits = logits / temperature
    order = jnp.argsort(-logits, axis=-1)
    sorted_logits = jnp.take_along_axis(logits, order, -1)
    before = jnp.cumsum(jax.nn.softmax(sorted_logits, -1), -1) - jax.nn.softmax(sorted_logits, -1)
    keep_sorted = (before < top_p) | (top_p >= 1.0)  # the mass before a token is below top_p: in the nucleus
    keep_sorted = keep_sorted.at[:, 0].set(True)  # the most likely token, even at top_p 0 (greedy then)
    keep = jnp.zeros_like(keep_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(keep_sorted)
    logits = jnp.where(keep, logits, -jnp.inf)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


class Generator:
    """``LM`` generation over a KV cache: ``generate(params, ids, mask, max_new_tokens, eos_id,
    temperature=0.0, top_p=1.0, seed=0) -> [B, max_new_tokens]`` (EOS, then EOS padding; ``eos_id``
    an id or several, as ``stream_until_eos`` takes it).

    ``ids``/``mask`` hold left-padded prompts (``left_pad``); positions count real tokens, so a
    padded prompt decodes as it would alone. The prefill and the one-token step are each
    compiled once per (batch, prompt length, cache length).
    """

    def __init__(self, lm_config: dict, vocab_size: int | None = None):
        self.lm_config, self.vocab_size = dict(lm_config), vocab_size  # as GreedyDecoder's
        self.model = lm_lib.LM(**self.lm_config)
        self._prefill = jax.jit(self._prefill_fn)
        self._step = jax.jit(self._step_fn, static_argnames=("greedy",), donate_argnums=(1,))

    def _prefill_fn(self, params, ids, mask, cache):
        positions = jnp.maximum(jnp.cumsum(mask, -1) - 1, 0)
        logits, cache = self.model.apply({"params": params}, ids, pad_mask=mask, positions=positions, cache=cache)
        return logits[:, -1], cache

    def _step_fn(self, params, cache, token, position, key, temperature, top_p, greedy):
        logits, cache = self.model.apply({"params": params}, token[:, None], positions=position[:, None], cache=cache)
        return sample(logits[:, -1], key, temperature, top_p, greedy, self.vocab_size), logits[:, -1], cache

    def logits(self, params, ids, mask, continuation: np.ndarray) -> np.ndarray:
        """Logits ``[B, 1 + n, vocab]`` after the prompt and after each of the ``n`` forced
        ``continuation [B, n]`` tokens, through the cache (what the tests compare)."""
        b, length = ids.shape
        cache = lm_lib.init_cache(self.lm_config, b, length + continuation.shape[1])
        last, cache = self._prefill(params, jnp.asarray(ids), jnp.asarray(mask), cache)
        out, position = [last], jnp.asarray(np.asarray(mask).sum(-1), jnp.int32)
        for i in range(continuation.shape[1]):
            _, last, cache = self._step(params, cache, jnp.asarray(continuation[:, i], jnp.int32), position,
                                        jax.random.key(0), 0.0, 1.0, greedy=True)
            out.append(last)
            position = position + 1
        return np.stack([np.asarray(x) for x in out], axis=1)

    def generate(self, params, ids, mask, max_new_tokens: int, eos_id, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int = 0) -> np.ndarray:
        out = np.full((ids.shape[0], max_new_tokens), np.atleast_1d(eos_id)[0], np.int32)
        for i, now in enumerate(self.stream(params, ids, mask, max_new_tokens, eos_id, temperature, top_p, seed)):
            out[:, i] = now
        return out

    def stream(self, params, ids, mask, max_new_tokens: int, eos_id, temperature: float = 0.0,
               top_p: float = 1.0, seed: int = 0, cache_len: int | None = None):
        """``generate``'s tokens one step at a time: ``[B]`` arrays (a finished row repeats EOS).
        ``cache_len``: a longer KV cache than needed (a server rounds shapes up so that few compile)."""
        b, length = ids.shape
        cache = lm_lib.init_cache(self.lm_config, b, max(cache_len or 0, length + max_new_tokens))
        last, cache = self._prefill(params, jnp.asarray(ids), jnp.asarray(mask), cache)
        key = jax.random.key(seed)
        state = {"cache": cache, "position": jnp.asarray(np.asarray(mask).sum(-1), jnp.int32)}

        def step(now, i):
            token, _, state["cache"] = self._step(params, state["cache"], jnp.asarray(now), state["position"] + i,
                                                  jax.random.fold_in(key, i + 1), float(temperature), float(top_p),
                                                  greedy=float(temperature) == 0)
            return token

        first = sample(last, jax.random.fold_in(key, 0), temperature, top_p, vocab_size=self.vocab_size)
        yield from stream_until_eos(first, max_new_tokens, eos_id, step)
