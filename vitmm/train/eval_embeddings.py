"""The evaluation split's embeddings for the contrastive evaluators (``train.evaluators``): one pass
over the split per set of parameters, shared by every evaluator that reads it — images (at a fixed
square size, or at their own sizes packed into rows), their captions, labels, and which image each
caption describes."""

from __future__ import annotations

import functools
import hashlib

import numpy as np

from vitmm.data import pipeline, preprocess, skips
from vitmm.data import tokenizer as tok_lib


class Embeddings:
    """Embeds an evaluation split once per set of parameters; shared by the evaluators.

    ``get`` returns ``zimg [I, D]`` and ``labels [I]`` (one per distinct image), and with captions
    ``ztxt [T, D]``, ``tokens [T, L]``, ``captions [T]`` (each caption's whole text: its tokens are
    cut to ``max_len``, and captions that differ only past it are different captions) and
    ``txt2img [T]`` (the image each caption describes).
    An image has several captions where a record holds a list of them (``data.captions``, e.g.
    COCO's ``"captions/text"``), or where rows of raw data (CSV, wds, parquet: one row per
    image-caption pair, open_clip's layout) show the same image: such rows are one image when
    their preprocessed pixels are identical byte for byte (the same file, or a copy of it; a model
    cannot tell such images apart, so ranking one copy over another would be a coin toss).
    """

    def __init__(self, embed_images, embed_texts, data: dict, max_len: int, tokenizer, batch_size: int,
                 num_examples: int | None, image_size: int, native: dict | None = None, padding: str = "pad",
                 value_op: str = "value_range(-1, 1)", captions: bool = True):
        self._embed_images, self._embed_texts = embed_images, embed_texts
        self.tokenizer, self.max_len, self.batch_size = tokenizer, max_len, batch_size
        self.padding = padding  # "eos" for a text tower pooled at its last position (SigLIP), as it trained
        # captions=False (only zero-shot reads this split): no caption is read, tokenized or embedded,
        # so a classification dataset of images and labels (cifar10, imagenet2012) works.
        self.captions = captions
        # data: name, split, data_dir (or scenes_any); keys to read (default image, caption,
        # label) and the ops that turn a record into one "caption" (default: it already has one),
        # or ``captions``: the path of a record's list of captions, every one of them scored.
        from vitmm.data import formats

        raw = formats.raw_format(data)  # image-caption pairs of the user's files: no labels
        self.caption_list = data.get("captions") if captions else None
        if self.caption_list and raw:
            raise ValueError(f"data.captions={self.caption_list!r} reads a TFDS record's list of captions; raw data "
                             "has one caption a row (rows that show the same image are grouped): leave it unset.")
        self.group_rows = bool(raw and captions)
        text = "caption" if not self.caption_list else self.caption_list.split("/")[0]
        default = (("image", text) if raw or self.caption_list else ("image", text, "label") if captions
                   else ("image", "label"))
        keys = tuple(data.get("keys") or default)
        self.source = source = pipeline.source_for(data, keys)
        self.num_examples = min(num_examples or len(source), len(source))
        label = "'label'" if "label" in keys else ""
        self.native = native  # with it: NaFlex to a patch budget and packed rows, else squares
        size = (f"naflex({native['max_num_patches']}, {native['patch_size'][0]})" if native
                else f"resize({image_size})")
        if self.caption_list:  # every caption tokenized here: tokenize takes one string
            image_pp = preprocess.parse(f"{data.get('pp') or 'decode'}|{size}|{value_op}", tokenizer)
            self._pp = functools.partial(self._all_captions, image_pp, keys="label" in keys)
        else:
            text = ((f"tokenize('caption', {max_len}, padding={padding!r})|", "'caption_tokens', 'caption', ")
                    if captions
                    else ("", ""))
            self._pp = preprocess.parse(
                f"{data.get('pp') or 'decode'}|{size}|{value_op}|{text[0]}keep('image', {text[1]}{label})", tokenizer)
        self.has_labels = "label" in keys
        self._params, self._value = None, None

    def _all_captions(self, image_pp, ex, rng, keys: bool):
        """``image_pp(ex)`` with ``caption_tokens [C, L]``: each of the record's ``C`` captions."""
        ex = image_pp(ex, rng)
        texts = [t.decode("utf-8") if isinstance(t, bytes) else str(t)
                 for t in preprocess.get_path(ex, self.caption_list)]
        if not texts:
            raise skips.BadExample("caption_missing", f"no entries in {self.caption_list!r}")
        ids = [tok_lib.tokenize(self.tokenizer, t, self.max_len, padding=self.padding).ids for t in texts]
        out = {k: v for k, v in ex.items() if k == "image" or k.startswith("_") or (keys and k == "label")}
        return {**out, "caption_tokens": np.stack(ids), "caption": texts}

    def get(self, params) -> dict:
        # Keyed on the params object itself, held until clear(): an id() key could match a
        # new params tree allocated where a freed one was, and return the old embeddings.
        if params is not self._params:
            images, labels, texts, tokens, strings, txt2img, seen = [], [], [], [], [], [], {}
            view = Prefix(self.source, self.num_examples)
            batches = (self._native_batches(params, view) if self.native else
                       pipeline.eval_batches(view, self._pp, self.batch_size, process_index=0, process_count=1,
                                             num_threads=1))
            for batch in batches:
                kept = np.flatnonzero(batch["_mask"])
                embedded = batch["zimg"] if self.native else np.asarray(self._embed_images(params, batch["image"]))
                if self.captions and not self.caption_list:  # one caption a row, embedded as a batch
                    texts.append(np.asarray(self._embed_texts(params, batch["caption_tokens"]))[kept])
                for j in kept:
                    image = len(images)
                    if self.group_rows:  # raw rows showing the same image: one image, several captions
                        pixels = batch["image_key"][j] if self.native else _pixels_key(batch["image"][j])
                        image = seen.setdefault(pixels, image)
                    if image == len(images):
                        images.append(embedded[j])
                        labels.append(batch["label"][j] if self.has_labels else -1)
                    if self.captions:
                        rows = np.asarray(batch["caption_tokens"][j]).reshape(-1, self.max_len)
                        tokens.append(rows)
                        caption = batch["caption"][j]
                        strings += [_text(c) for c in (caption if self.caption_list else [caption])]
                        txt2img += [image] * len(rows)
            self._value = dict(zimg=np.stack(images), labels=np.asarray(labels))
            if self.captions:
                tokens = np.concatenate(tokens)
                ztxt = np.concatenate(texts) if texts else self._embed_all(params, tokens)
                self._value.update(ztxt=ztxt, tokens=tokens, captions=np.asarray(strings, object),
                                   txt2img=np.asarray(txt2img))
            self._params = params
        return self._value

    def _embed_all(self, params, tokens) -> np.ndarray:
        """``tokens [T, L]`` embedded ``batch_size`` at a time (the last chunk padded: one compiled shape)."""
        out = []
        for start in range(0, len(tokens), self.batch_size):
            chunk = tokens[start : start + self.batch_size]
            padded = np.concatenate([chunk, np.repeat(chunk[:1], self.batch_size - len(chunk), 0)])
            out.append(np.asarray(self._embed_texts(params, padded))[: len(chunk)])
        return np.concatenate(out)

    def _native_batches(self, params, view):
        """``eval_batches``' batches for images at their own sizes: each chunk of examples packed
        into rows for the image tower, its embeddings (``zimg``) in the examples' order."""
        from vitmm.models import packing

        rng, n = np.random.default_rng(0), len(view)  # the ops used here draw nothing
        guarded = skips.guard(self._pp)
        for start in range(0, n, self.batch_size):
            # A bad raw record (missing file, empty caption, undecodable image) is left out, as the
            # square path masks it: it is not counted in ``examples``.
            outs = (guarded(_record(view[i]), rng) for i in range(start, min(n, start + self.batch_size)))
            examples = [out for out in outs if not isinstance(out, skips.Skipped)]
            if not examples:
                continue
            packed = packing.pack([ex["image"] for ex in examples], self.native["patch_size"],
                                  self.native["seq_len"], self.native["max_images"],
                                  class_token=self.native["class_token"], num_registers=self.native["num_registers"])
            batch = pipeline.collate([{k: v for k, v in ex.items() if k != "image"} for ex in examples])
            batch["image_key"] = [_pixels_key(ex["image"]) for ex in examples]
            batch["zimg"] = np.stack(packing.unpack(self._embed_images(params, packed), packed))
            batch["_mask"] = np.ones(len(examples), np.int32)
            yield batch

    def clear(self) -> None:
        """Drops the cached embeddings and the parameters they came from."""
        self._params, self._value = None, None

    def texts(self, params, strings) -> np.ndarray:
        ids = np.stack([tok_lib.tokenize(self.tokenizer, s, self.max_len, padding=self.padding).ids for s in strings])
        return np.asarray(self._embed_texts(params, ids))


def _text(caption) -> str:
    """A caption as a string (a TFDS record's are bytes)."""
    return caption.decode("utf-8") if isinstance(caption, (bytes, np.bytes_)) else str(caption)


def _pixels_key(image: np.ndarray) -> tuple:
    """An image's identity: its shape and a digest of its pixels."""
    image = np.ascontiguousarray(image)
    return image.shape, hashlib.blake2b(image.tobytes(), digest_size=16).digest()


def _record(record):
    """A source's record as a dict the pp may change, or its ``Skipped`` (a bad raw record) as is."""
    return record if isinstance(record, skips.Skipped) else dict(record)


class Prefix:
    """The first ``n`` examples of ``source`` (an evaluation's ``num_examples``)."""

    def __init__(self, source, n):
        self._source, self._n = source, n

    def __len__(self):
        return self._n

    def __getitem__(self, i):
        return self._source[i]
