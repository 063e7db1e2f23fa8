"""Scenes questions on a frozen tower's features, for experiments that train connectors and LMs
on top of a fixed encoder: each image is encoded once, every run reads the arrays.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from vitmm.data import pipeline, preprocess
from vitmm.data.tokenizer import ByteTokenizer, WordTokenizer
from vitmm.models.vit import ViT


def encode_split(tower: ViT, params, data: str, split: str, limit: int, image_size: int, tokenizer,
                 max_len: int, data_dir=None, batch_size: int = 250) -> dict:
    """Tower features of the first ``limit`` images of ``split`` and all their questions.

    Returns ``patches [I, N, C]`` (float32), ``grid``, and per question ``image`` (index into
    ``patches``), ``ids``, ``answer_mask``, ``prompt_len``, ``kind``.
    """
    source = pipeline.get_source(data, split, data_dir, keys=("image", "questions", "answers", "question_kinds"))
    decode = preprocess.parse(f"decode|resize({image_size})|value_range(-1, 1)")
    tokens = preprocess.parse(f"qa_tokens({max_len})", tokenizer)
    encode = jax.jit(lambda p, x: tower.apply({"params": p}, x)[1]["patch_tokens"])
    n = min(limit, len(source))
    rng = np.random.default_rng(0)  # the ops used here draw nothing; parse's signature wants one
    patches, qa = [], {k: [] for k in ("image", "ids", "answer_mask", "prompt_len", "kind")}
    for start in range(0, n, batch_size):
        examples = [decode(source[i], rng) for i in range(start, min(n, start + batch_size))]
        images = np.stack([ex["image"] for ex in examples])
        patches.append(np.asarray(encode(params, jnp.asarray(images))))
        for offset, ex in enumerate(examples):
            for q, a, kind in zip(ex["questions"], ex["answers"], ex["question_kinds"], strict=True):
                t = tokens({"question": _text(q), "answer": _text(a)}, rng)
                qa["image"].append(start + offset)
                qa["ids"].append(t["ids"])
                qa["answer_mask"].append(t["answer_mask"])
                qa["prompt_len"].append(t["prompt_len"])
                qa["kind"].append(int(kind))
    grid = tower.grid((image_size, image_size))
    return {"patches": np.concatenate(patches), "grid": tuple(grid),
            **{k: np.asarray(v) for k, v in qa.items()}}


def _text(x) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def make_tokenizer(kind: str, data: str, data_dir=None, sample: int = 2000):
    """The tokenizer and a ``max_len`` that fits BOS + the longest question + answer + EOS in the
    first ``sample`` training images (``words``: the vocabulary of those questions and answers)."""
    source = pipeline.get_source(data, "train", data_dir, keys=("questions", "answers"))
    pairs = [(_text(q), _text(a)) for i in range(min(sample, len(source)))
             for q, a in zip(source[i]["questions"], source[i]["answers"], strict=True)]
    if kind == "words":
        tokenizer = WordTokenizer.from_texts(t for pair in pairs for t in pair)
    elif kind == "bytes":
        tokenizer = ByteTokenizer()
    else:
        raise SystemExit(f"--tokenizer must be 'words' or 'bytes', got {kind!r}.")
    longest = max(len(tokenizer.encode(q + " ")) + len(tokenizer.encode(a)) for q, a in pairs)
    return tokenizer, longest + 2
