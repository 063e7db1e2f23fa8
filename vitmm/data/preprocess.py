"""Preprocessing named in a config: ``"decode|resize(64)|flip_lr|value_range(-1, 1)|..."``.

Each op is a registered factory; ``parse("a(1)|b(key='x')")`` returns one callable
``fn(example, rng) -> example`` that grain runs as a ``random_map`` (``rng`` is a
``np.random.Generator`` derived from the seed and the example's position, so a resumed run
draws the same augmentations).

Ops (all work on numpy, per example):
  * ``decode``: text bytes (and lists of them) → str; images to uint8 RGB ``[H, W, 3]``. Grayscale
    (``[H, W]`` or ``[H, W, 1]``) is repeated to three channels; transparency is dropped
    (``alpha="drop"``, LLaVA's and open_clip's way) or composited onto white (``alpha="white"``,
    Hugging Face's processors' way, which imported VLMs' pp use). Encoded image
    files (the raw readers of ``data.formats``) are decoded (``data.images``: EXIF orientation,
    CMYK, palette); a conversation's ``images`` list becomes ``image``, ``num_images`` and
    ``has_image``. ``pad_to_square(fill)``: LLaVA's pad to a square with the mean colour.
  * The geometric ops (in ``data/ops_image.py``): ``resize(size)``, ``center_crop(size)``,
    ``random_resized_crop(size, scale, ratio, method)``; ``naflex(max_num_patches, patch)`` (aspect kept,
    the grid within a patch budget), Qwen2-VL's ``smart_resize(min_pixels, max_pixels, factor)`` and
    ``letterbox(size)`` (aspect kept, padded to a square) for images of many shapes;
    ``anyres(pinpoints, tile, tile_grid)``: LLaVA-NeXT's base view + tiles, with each visual
    token's place (batches of images at their own sizes for an AnyRes VLM; ``max_patches``:
    LLaVA-OneVision's downsampling). Idefics3's ``idefics3_tiles(longest_edge, tile)`` is in
    ``data/tiles.py``, the video ops in ``data/video.py``.
  * ``flip_lr(prob=0.5, text_keys=(...), mode="swap")``: horizontal flip. A flipped image
    makes "left" wrong in its text, so ``mode="swap"`` swaps the words left/right (any case) in the
    listed text fields (default: captions, questions and conversations stay true); ``mode="skip"`` leaves any
    example whose text mentions left or right unflipped.
  * ``value_range(lo, hi)``: uint8 → float32 in ``[lo, hi]``; ``normalize(mean, std)``: uint8 →
    ``(x / 255 - mean) / std`` (a pretrained tower's input statistics); ``blank``: zeros instead
    (a no-image baseline).
  * The text ops (in ``data/ops_text.py``): ``tokenize(key, max_len, out_key=None, ...)``:
    fixed-length int32 ids in ``out_key`` (default ``{key}_tokens``) and ``{out_key}_truncated``.
  * ``qa_tokens(max_len, chat=False, max_answer=None)``: a question and its answer as one sequence
    for the VLM (``chat=True``: in the LM's chat template, ``image_pos`` where ``<image>`` stood),
    with the answer mask and the prompt length; an answer longer than ``max_answer`` tokens is an
    error.
  * ``conversation_tokens(max_len, overflow="truncate_turns")``: a LLaVA-style multi-turn
    conversation in the LM's chat template, the loss on every assistant turn, the visual tokens
    where ``<image>`` stood (``data/ops_text.py``).
  * ``choose(keys, out_keys)``: one random entry, at the same index, from parallel lists
    (e.g. a question with its answer; ``"captions/text"`` reaches into nested features).
  * ``keep(*keys)`` / ``drop(*keys)``.
"""

from __future__ import annotations

import ast
from collections.abc import Callable

import numpy as np

from vitmm.data import images as images_lib
from vitmm.data import ops_image, ops_text
from vitmm.data import tiles as tiles_lib
from vitmm.data import video as video_lib
from vitmm.data.images import decode_image
from vitmm.data.skips import BadExample

_OPS: dict[str, Callable[..., Callable]] = {}
_TEXT_DEFAULT = ops_image.TEXT_DEFAULT


_TAKES_TOKENIZER: set[str] = set()  # ops whose ``tokenizer`` defaults to the one ``parse`` is given


def register(name: str, takes_tokenizer: bool = False):
    def wrap(factory):
        _OPS[name] = factory
        if takes_tokenizer:
            _TAKES_TOKENIZER.add(name)
        return factory

    return wrap


def available_ops() -> tuple[str, ...]:
    return tuple(sorted(_OPS))


def _parse_op(text: str):
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except SyntaxError as err:
        raise ValueError(f"Cannot parse preprocessing op {text!r}: {err.msg}.") from err
    if isinstance(node, ast.Name):
        return node.id, (), {}
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        args = tuple(ast.literal_eval(a) for a in node.args)
        kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
        return node.func.id, args, kwargs
    raise ValueError(f"Preprocessing op {text!r} must be NAME or NAME(args).")


def ops(spec: str) -> list[tuple[str, tuple, dict]]:
    """``spec``'s ops as ``(name, args, kwargs)``, in order (e.g. to describe a run's image steps)."""
    return [_parse_op(text) for text in filter(str.strip, _split_ops(spec))]


def op_names(spec: str) -> list[str]:
    """The names of ``spec``'s ops, in order; ``spec`` may be a pp template (``{image_mean}`` …)."""
    return [text.split("(")[0].strip() for text in _split_ops(spec) if text.strip()]


def _split_ops(spec: str) -> list[str]:
    """``spec`` cut at each ``|`` outside quotes (a quoted argument may hold one, e.g. Qwen2-VL's
    ``'<|vision_start|>'``)."""
    parts, start, quote = [], 0, None
    for i, char in enumerate(spec):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "|":
            parts.append(spec[start:i])
            start = i + 1
    return [*parts, spec[start:]]


# Ops whose output size (AnyRes: the candidate resolution, so the token count) follows the image's own
# size: after a draft decode they would follow the reduced size instead.
SIZED_FROM_INPUT = ("smart_resize", "anyres")


def decode_draft(spec: str) -> int | None:
    """The ``draft`` of ``spec``'s ``decode`` op, if any (``images.decode_image``)."""
    return next((kw.get("draft", args[2] if len(args) > 2 else None) for name, args, kw in ops(spec)
                 if name == "decode"), None)


def parse(spec: str, tokenizer=None) -> Callable[[dict, np.random.Generator], dict]:
    """Builds the per-example function for ``spec`` (ops separated by ``|``)."""
    fns, steps = [], ops(spec)
    draft = decode_draft(spec)
    sized = next((name for name, _, _ in steps if name in SIZED_FROM_INPUT), None)
    if draft and sized:
        raise ValueError(f"decode(draft={draft}) decodes a JPEG at a reduced size, from which {sized} would size the "
                         f"image (not from the file's size, as without draft): drop draft from decode in {spec!r}.")
    for name, args, kwargs in steps:
        if name not in _OPS:
            raise ValueError(f"Unknown preprocessing op {name!r} in {spec!r}; available: {available_ops()}.")
        if name in _TAKES_TOKENIZER:
            kwargs.setdefault("tokenizer", tokenizer)
        fns.append(_OPS[name](*args, **kwargs))

    def apply(example: dict, rng: np.random.Generator) -> dict:
        example = dict(example)
        for (name, _, kwargs), fn in zip(steps, fns, strict=True):
            example = fn(example, rng)
            if example.get(MORE_IMAGES) and name in _IMAGE_OPS and name != "decode":
                example[MORE_IMAGES] = [_each_image(name, kwargs, fn, image, rng) for image in example[MORE_IMAGES]]
        return example

    return apply


MORE_IMAGES = "more_images"  # an example's second and later images, through the image ops as ``image``
_ONE_IMAGE_OPS = ("flip_lr", "letterbox", "anyres")  # they write text or other keys too


def _each_image(name: str, kwargs: dict, fn, image, rng):
    """``fn`` (the op ``name``) on one of an example's further images."""
    if name in _ONE_IMAGE_OPS or kwargs.get("key", "image") != "image":
        raise ValueError(f"The preprocessing op {name!r} takes one image; an example with several images cannot go "
                         f"through it (drop it, or keep one image an example with decode(max_images=1)).")
    return fn({"image": image}, rng)["image"]


# Ops that read or write the image (after which a value mapping cannot move to the device).
_IMAGE_OPS = {"decode", "resize", "naflex", "smart_resize", "letterbox", "anyres", "center_crop", "random_resized_crop",
              "flip_lr", "value_range", "normalize", "blank", "pad_to_square"}


IMAGE_OPS_NAMES = frozenset(_IMAGE_OPS)
# Ops that regroup an example's images themselves (not mapped over ``more_images``): two frames a
# 6-channel image, or an image into tiles.
_REGROUP_IMAGES = ("temporal_patch", "idefics3_tiles")


def split_image_affine(spec: str) -> tuple[str, tuple | None]:
    """``(host spec, (scale, offset))``: the pp without its final ``value_range``/``normalize`` of
    ``image`` and that map as per-channel float32 ``image * scale + offset``, for a device to apply
    to uint8 batches (a quarter of the bytes to move, and the cast fused into the first layer).
    ``(spec, None)`` when the pp has no such op or an image op follows it (e.g. ``blank``). The map
    equals the host op to within float32 rounding (≤ 1 ULP), not bit-identically: the host rounds
    ``(x / 255 - mean) / std`` step by step, the device one (often fused) multiply-add with
    pre-rounded constants."""
    ops = [t for t in _split_ops(spec) if t.strip()]
    for i in range(len(ops) - 1, -1, -1):
        name, args, kwargs = _parse_op(ops[i])
        if name in _REGROUP_IMAGES:  # after normalize they change the channels or the images: no device map
            return spec, None
        if name not in _IMAGE_OPS:
            continue
        key = kwargs.get("key", args[2] if len(args) > 2 else "image")  # (lo, hi, key) and (mean, std, key)
        if name not in ("value_range", "normalize") or key != "image":
            return spec, None
        if name == "value_range":
            lo, hi = (list(args) + [kwargs.get("lo", -1.0), kwargs.get("hi", 1.0)][len(args):])[:2]
            scale, offset = np.full(3, (hi - lo) / 255.0, np.float32), np.full(3, lo, np.float32)
        else:
            mean, std = (list(args) + [kwargs.get("mean", (0.5,) * 3), kwargs.get("std", (0.5,) * 3)][len(args):])[:2]
            mean, std = np.asarray(mean, np.float32), np.asarray(std, np.float32)
            scale, offset = np.float32(1.0) / (np.float32(255.0) * std), -mean / std
        return "|".join(ops[:i] + ops[i + 1:]), (scale, offset)
    return spec, None


# ----------------------------------------------------------------------------------------------
def _decode_text(value):
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, list) and value and isinstance(value[0], bytes):
        return [v.decode("utf-8") for v in value]
    if isinstance(value, dict):  # nested features, e.g. coco_captions' captions/text
        return {k: _decode_text(v) for k, v in value.items()}
    return value


def get_path(example: dict, key: str):
    """``example["captions"]["text"]`` for ``key="captions/text"``."""
    value = example
    for part in key.split("/"):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(f"No {key!r} in the example; it has {sorted(example)}.")
        value = value[part]
    return value


@register("decode")
def decode(image_key="image", max_images=1, draft=None, num_frames=8, alpha="drop"):
    """Text bytes → str; the image (an array, or encoded bytes from a raw reader) → uint8 RGB.
    A raw conversation's ``images`` list (0 to ``max_images`` of them) becomes ``image`` (a 1×1
    black stand-in when there is none; the second and later in ``more_images``), ``num_images`` and
    ``has_image``; ``draft``: see ``images.decode_image``. A conversation's ``video`` (a file's
    bytes, or a list of frame images) becomes ``num_frames`` frames (``data.video``'s sampling) as
    its images, and its ``<video>`` (or its one ``<image>`` when it has no ``<video>``) as ``num_frames``
    ``<image>`` tags; ``video_frames`` counts them.
    ``alpha``: ``"drop"`` or ``"white"`` (``data.images``)."""
    images_lib.check_alpha(alpha)
    video_lib.check_count("decode num_frames", num_frames)

    def fn(ex, rng):
        del rng
        images, video = ex.pop("images", None), ex.pop("video", None)
        ex = {key: value if key == image_key else _decode_text(value) for key, value in ex.items()}
        if video is not None:
            video_lib.video_as_images(ex, video, images, num_frames, lambda v: _decoded(v, draft, alpha), image_key)
        elif "<video>" in str(ex.get("conversations", "")):
            raise BadExample("image_tag_mismatch", "a <video> tag but no video")
        elif images is not None:
            if len(images) > max_images:
                raise BadExample("too_many_images", f"{len(images)} images; this model takes at most {max_images}")
            ex[image_key] = images[0] if images else np.zeros((1, 1, 3), np.uint8)
            ex["num_images"], ex["has_image"] = np.int32(len(images)), np.bool_(len(images) > 0)
            if len(images) > 1:  # the rest go through the image ops as the first does (``parse``)
                ex[MORE_IMAGES] = [_decoded(value, draft, alpha) for value in images[1:]]
        if image_key in ex:
            ex[image_key] = _decoded(ex[image_key], draft, alpha)
        return ex

    return fn


def _decoded(value, draft, alpha="drop"):
    return decode_image(value, draft, alpha) if isinstance(value, bytes) else images_lib.array_to_rgb(value, alpha)


@register("value_range")
def value_range(lo=-1.0, hi=1.0, key="image"):
    def fn(ex, rng):
        ex[key] = ex[key].astype(np.float32) * ((hi - lo) / 255.0) + lo
        return ex

    return fn


@register("blank")
def blank(key="image"):
    """The image replaced by zeros of its shape (float32): the no-image ("blind") baseline's input,
    with the same model and token counts as the run it is compared with."""
    def fn(ex, rng):
        ex[key] = np.zeros(ex[key].shape, np.float32)
        return ex

    return fn


@register("normalize")
def normalize(mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5), key="image"):
    """uint8 → float32 ``(x / 255 - mean) / std`` per channel (the mean and std a tower was
    trained with; 0.5/0.5 is ``value_range(-1, 1)``)."""
    mean, std = np.asarray(mean, np.float32), np.asarray(std, np.float32)

    def fn(ex, rng):
        ex[key] = (ex[key].astype(np.float32) / np.float32(255.0) - mean) / std
        return ex

    return fn


@register("choose")
def choose(keys=("questions", "answers", "question_kinds"), out_keys=("question", "answer", "question_kind")):
    def fn(ex, rng):
        n = len(get_path(ex, keys[0]))
        if n == 0:
            raise ValueError(f"choose{keys}: the example has no entries in {keys[0]!r}.")
        i = int(rng.integers(n))
        for k, out in zip(keys, out_keys, strict=True):
            ex[out] = get_path(ex, k)[i]
        return ex

    return fn


@register("keep")
def keep(*keys, optional=()):
    """Only ``keys``, ``optional`` ones where present (e.g. ``more_images``), and the bookkeeping
    fields whose names start with ``_`` (e.g. ``_id``). An example's further images
    (``more_images``) and their places (``image_positions``) are never dropped while its first image
    or place is kept: the example would train on its first image alone, its other ``<image>`` places
    left empty without a word (a ``ValueError`` names the fix). A video's ``video_frames`` (``decode``'s)
    stays with its frames in ``more_images``: without it M-RoPE would place its temporal patches as
    separate images (``data.sequences.mrope_positions``)."""
    several = {MORE_IMAGES: "image", "image_positions": "image_pos"}  # dropped while this is kept: an error

    def fn(ex, rng):
        missing = [k for k in keys if k not in ex]
        if missing:
            raise KeyError(f"keep{keys}: the example has no {missing}; it has {sorted(ex)}.")
        lost = [k for k, first in several.items() if k in ex and first in keys and k not in keys + tuple(optional)]
        if lost:
            count = max(1 + len(ex.get(MORE_IMAGES, ())), len(ex.get("image_positions", ())))
            name = f"example {ex['_id']}" if "_id" in ex else "an example"
            raise ValueError(f"keep{keys} drops {', '.join(lost)} of {name} with {count} images: "
                             "it would train on its first image alone. Keep them: keep(..., optional=('more_images', "
                             "'image_positions')), and set input.sequences for several images.")
        kept = keys + tuple(optional) + (("video_frames",) if MORE_IMAGES in keys + tuple(optional) else ())
        return {k: v for k, v in ex.items() if k in kept or k.startswith("_")}

    return fn


@register("drop")
def drop(*keys):
    def fn(ex, rng):
        return {k: v for k, v in ex.items() if k not in keys}

    return fn


tokenize = register("tokenize", takes_tokenizer=True)(ops_text.tokenize)
qa_tokens = register("qa_tokens", takes_tokenizer=True)(ops_text.qa_tokens)
conversation_tokens = register("conversation_tokens", takes_tokenizer=True)(ops_text.conversation_tokens)
temporal_patch = register("temporal_patch")(video_lib.temporal_patch)
pad_to_square = register("pad_to_square")(ops_image.pad_to_square)
resize = register("resize")(ops_image.resize)
naflex = register("naflex")(ops_image.naflex)
smart_resize = register("smart_resize")(ops_image.smart_resize)
letterbox = register("letterbox")(ops_image.letterbox)
anyres = register("anyres")(ops_image.anyres)
center_crop = register("center_crop")(ops_image.center_crop)
random_resized_crop = register("random_resized_crop")(ops_image.random_resized_crop)
flip_lr = register("flip_lr")(ops_image.flip_lr)
anyres_views = ops_image.anyres_views
idefics3_tiles = register("idefics3_tiles")(tiles_lib.idefics3_tiles)
