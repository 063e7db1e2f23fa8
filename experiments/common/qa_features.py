"""Scenes questions on a frozen tower's features, for experiments that train connectors and LMs
on top of a fixed encoder: each image is encoded once, every run reads the arrays.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from vitmm.data import pipeline, preprocess, scenes
from vitmm.data.tokenizer import ByteTokenizer, WordTokenizer
from vitmm.models.vit import ViT


def encode_split(tower: ViT, params, data: str, split: str, limit: int, image_size: int, tokenizer,
                 max_len: int, data_dir=None, batch_size: int = 250, views: dict | None = None) -> dict:
    """Tower features of the first ``limit`` images of ``split`` and all their questions.

    Returns ``patches [I, N, C]`` (float32), ``grid``, and per question ``image`` (index into
    ``patches``), ``ids``, ``answer_mask``, ``prompt_len``, ``kind``. ``views``, ``{name: (tower,
    params, image_size)}``, encodes the same images again with other towers or sizes (e.g. the
    encoder-side token budget): ``patches@name`` and ``grid@name``.
    """
    source = pipeline.get_source(data, split, data_dir, keys=("image", "questions", "answers", "question_kinds"))
    towers = {"": (tower, params, image_size), **{"@" + k: v for k, v in (views or {}).items()}}
    decoders = {name: preprocess.parse(f"decode|resize({size})|value_range(-1, 1)")
                for name, (_, _, size) in towers.items()}
    encoders = {name: jax.jit(lambda p, x, t=t: t.apply({"params": p}, x)[1]["patch_tokens"])
                for name, (t, _, _) in towers.items()}
    n = min(limit, len(source))
    rng = np.random.default_rng(0)  # the ops used here draw nothing; parse's signature wants one
    patches = {name: [] for name in towers}
    for start in range(0, n, batch_size):
        indices = range(start, min(n, start + batch_size))
        for name, (_, p, _) in towers.items():
            images = np.stack([decoders[name](source[i], rng)["image"] for i in indices])
            patches[name].append(np.asarray(encoders[name](p, jnp.asarray(images))))
    out = qa_arrays((source[i] for i in range(n)), tokenizer, max_len)
    for name, (t, _, size) in towers.items():
        out["patches" + name] = np.concatenate(patches[name])
        out["grid" + name] = tuple(t.grid((size, size)))
    return out


def qa_arrays(examples, tokenizer, max_len: int) -> dict:
    """Per question of the examples (in order): ``image`` (the example's index), ``ids``,
    ``answer_mask``, ``prompt_len`` (``qa_tokens``) and ``kind`` (an index into
    ``scenes.QUESTION_KINDS``; made in memory, scenes name their kinds)."""
    tokens = preprocess.parse(f"qa_tokens({max_len})", tokenizer)
    rng = np.random.default_rng(0)  # qa_tokens draws nothing; parse's signature wants one
    qa = {k: [] for k in ("image", "ids", "answer_mask", "prompt_len", "kind")}
    for i, ex in enumerate(examples):
        for q, a, kind in zip(ex["questions"], ex["answers"], ex["question_kinds"], strict=True):
            t = tokens({"question": _text(q), "answer": _text(a)}, rng)
            qa["image"].append(i)
            qa["ids"].append(t["ids"])
            qa["answer_mask"].append(t["answer_mask"])
            qa["prompt_len"].append(t["prompt_len"])
            qa["kind"].append(scenes.QUESTION_KINDS.index(kind) if isinstance(kind, str) else int(kind))
    return {k: np.asarray(v) for k, v in qa.items()}


def _text(x) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def make_tokenizer(kind: str, data: str, data_dir=None, sample: int = 2000):
    """The tokenizer and a ``max_len`` that fits BOS + the longest question + answer + EOS in the
    first ``sample`` training images (``words``: the vocabulary of those questions and answers)."""
    source = pipeline.get_source(data, "train", data_dir, keys=("questions", "answers"))
    return tokenizer_for(kind, [source[i] for i in range(min(sample, len(source)))])


def tokenizer_for(kind: str, examples) -> tuple:
    """``make_tokenizer`` on examples' ``questions`` and ``answers`` (e.g. scenes made in memory)."""
    pairs = [(_text(q), _text(a)) for ex in examples for q, a in zip(ex["questions"], ex["answers"], strict=True)]
    if kind == "words":
        tokenizer = WordTokenizer.from_texts(t for pair in pairs for t in pair)
    elif kind == "bytes":
        tokenizer = ByteTokenizer()
    else:
        raise SystemExit(f"--tokenizer must be 'words' or 'bytes', got {kind!r}.")
    longest = max(len(tokenizer.encode(q + " ")) + len(tokenizer.encode(a)) for q, a in pairs)
    return tokenizer, longest + 2
