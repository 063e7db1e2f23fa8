"""The preprocessing ops that change an image's geometry (registered by ``data.preprocess``, whose
docstring lists every op): LLaVA's ``pad_to_square``; ``resize`` (a size, or the shorter side);
``naflex`` and Qwen2-VL's ``smart_resize`` (images at their own sizes); ``letterbox``; LLaVA-NeXT's
``anyres`` views; ``center_crop``, ``random_resized_crop`` and ``flip_lr`` (which swaps left and
right in the text too). Each takes ``key`` (default ``image``) and returns ``fn(example, rng)``."""

from __future__ import annotations

import numpy as np

from vitmm.data import images as images_lib
from vitmm.data.scenes import LEFT_RIGHT, swap_left_right
from vitmm.data.skips import BadExample

TEXT_DEFAULT = ("caption", "captions", "questions", "question", "answers", "answer", "text", "conversations")
TURN_TEXT = ("value", "content")  # a conversation turn's text (LLaVA's, OpenAI's)


def _pair(size) -> tuple[int, int]:
    return (size, size) if isinstance(size, int) else tuple(size)


def pad_to_square(fill=(0.5, 0.5, 0.5), key="image"):
    """LLaVA's pad-to-square (``expand2square``): the image centred on a square of its longer side
    filled with ``fill`` (in [0, 1], LLaVA passes the tower's mean: ``pad_to_square({image_mean})``)."""
    color = tuple(int(x * 255) for x in fill)

    def fn(ex, rng):
        ex[key] = images_lib.pad_to_square(ex[key], color)
        return ex

    return fn


def resize(size, key="image", method="bilinear", shorter=False):
    """To ``size`` (a side or ``(height, width)``) with PIL's ``method`` (``bilinear``, ``bicubic``);
    ``shorter=True``: the shorter side to ``size``, the aspect kept (transformers' CLIP processors'
    ``shortest_edge``; with ``method='bicubic'`` and ``center_crop``, their exact pixels). The
    default, PIL bilinear, antialiases when shrinking: big_vision's ``resize`` (``tf.image.resize``,
    no antialias) and HF SigLIP's (bicubic) give other pixels. With ``shorter=True`` an image of
    aspect ratio over 200 (a 1×2000 banner: a 336×672000 resize) is a ``BadExample("image_aspect")``."""
    if method not in images_lib.RESAMPLING:
        raise ValueError(f"resize(method={method!r}): choose one of {tuple(images_lib.RESAMPLING)}.")
    if shorter and not isinstance(size, int):
        raise ValueError(f"resize({size!r}, shorter=True): give the shorter side as one number.")

    def fn(ex, rng):
        h, w = ex[key].shape[:2]
        if shorter and max(h, w) > 200 * min(h, w):
            raise BadExample("image_aspect", f"an image of {h}x{w} pixels: its aspect ratio must be below 200 to "
                                             f"resize its shorter side to {size}; crop or pad it")
        hw = images_lib.shorter_side_size((h, w), size) if shorter else _pair(size)
        ex[key] = images_lib.resize(ex[key], hw, method)
        return ex

    return fn


def naflex(max_num_patches, patch, key="image", merge=1):
    """NaFlex: resize to the largest aspect-preserving size whose patch grid fits the budget
    (``data.packing.naflex_size``), so the token count follows from the image size alone.
    ``merge=k``: sides in multiples of ``k`` patches (``max_num_patches / k²`` windows of ``k × k``,
    for a connector that merges them, as Qwen2-VL's processor sizes images)."""
    from vitmm.data.packing import naflex_size

    def fn(ex, rng):
        size = naflex_size(*ex[key].shape[:2], patch * merge, max_num_patches // merge**2)
        ex[key] = images_lib.resize(ex[key], size)
        return ex

    return fn


def smart_resize(min_pixels, max_pixels, factor, key="image", method="bicubic"):
    """Qwen2-VL's processor's resize: each side to a multiple of ``factor`` (its patch × merge, e.g.
    28) nearest the image's, scaled with the aspect kept until the pixels are within
    ``[min_pixels, max_pixels]`` (``images.smart_size``), with PIL's ``method``."""

    def fn(ex, rng):
        ex[key] = images_lib.resize(ex[key], images_lib.smart_size(*ex[key].shape[:2], factor, min_pixels,
                                                                    max_pixels), method)
        return ex

    return fn


def letterbox(size, key="image"):
    """Padded square batching: resize so the longer side is ``size`` (aspect kept), then pad the
    bottom/right with zeros to ``size × size``; ``{key}_valid`` holds the image's own ``(h, w)``."""

    def fn(ex, rng):
        h, w = ex[key].shape[:2]
        scale = size / max(h, w)
        new = (max(1, round(h * scale)), max(1, round(w * scale)))
        out = np.zeros((size, size, ex[key].shape[2]), ex[key].dtype)
        out[:new[0], :new[1]] = images_lib.resize(ex[key], new)
        ex[key], ex[f"{key}_valid"] = out, np.array(new, np.int32)
        return ex

    return fn


def anyres(pinpoints, tile, tile_grid=None, key="image", method="bilinear", max_patches=None):
    """AnyRes (``models.anyres``) on the host, for batches of images at their own sizes: ``key``
    becomes the views ``[max_views, tile, tile, C]``: the base view (the image squashed to a tile),
    then the tiles of its best candidate resolution (the image resized with its aspect kept and
    centred on black, as LLaVA-NeXT's processor pads), then zero views up to ``max_views``.
    ``anyres_layout`` (int32 ``[max_tokens]``) says where each visual token comes from
    (``anyres.layout``) and ``visual_mask`` which are real: the image's tokens at the end, padding
    first, as ``VLM(visual_mask=…)`` reads them (without ``tile_grid``: the views only). ``method``:
    the resampling (``images.resize``; LLaVA-NeXT's processor: ``'bicubic'``). ``max_patches``:
    LLaVA-OneVision's ``anyres_max_N`` (``models.anyres.downsampled``): ``anyres_layout`` is then
    ``[max_tokens, 4]`` with ``anyres_weights`` beside it. Put it before ``value_range``/``normalize``."""
    from vitmm.models import anyres as anyres_lib

    pinpoints = anyres_lib.check_pinpoints(pinpoints, tile)  # one line naming what cannot be tiled, at parse time
    views = anyres_lib.max_views(pinpoints, tile)

    def fn(ex, rng):
        image = ex[key]
        made = anyres_views(image, pinpoints, tile, method)
        out = np.zeros((views, tile, tile, image.shape[2]), image.dtype)
        out[:len(made)] = made
        ex[key] = out
        if tile_grid is not None and max_patches:
            index, weights = anyres_lib.downsampled(image.shape[:2], pinpoints, tile, tile_grid, max_patches)
            length = anyres_lib.max_downsampled_tokens(pinpoints, tile, tile_grid, max_patches)
            ex["anyres_layout"] = np.concatenate([np.zeros((length - len(index), 4), np.int32), index])
            ex["anyres_weights"] = np.concatenate([np.zeros((length - len(index), 4), np.float32), weights])
            ex["visual_mask"] = np.arange(length) >= length - len(index)
        elif tile_grid is not None:
            index = anyres_lib.layout(image.shape[:2], pinpoints, tile, tile_grid)
            length = anyres_lib.max_tokens(pinpoints, tile, tile_grid)
            ex["anyres_layout"] = np.concatenate([np.zeros(length - len(index), np.int32), index])
            ex["visual_mask"] = np.arange(length) >= length - len(index)
        return ex

    return fn


def anyres_views(image: np.ndarray, pinpoints, tile: int, method: str = "bilinear") -> np.ndarray:
    """An image's AnyRes views ``[1 + rows·cols, tile, tile, C]`` (``models.anyres``): the base view
    (the image squashed to a tile), then the tiles of its best candidate resolution (the image
    resized with its aspect kept and centred on black, as LLaVA-NeXT's processor pads)."""
    from vitmm.models import anyres as anyres_lib

    plan = anyres_lib.plan(image.shape[:2], pinpoints, tile)
    (fh, fw), (top, left), (rows, cols) = plan["fitted"], plan["offset"], plan["tiles"]
    canvas = np.zeros((*plan["best"], image.shape[2]), image.dtype)
    canvas[top:top + fh, left:left + fw] = images_lib.resize(image, (fh, fw), method)
    tiles = canvas.reshape(rows, tile, cols, tile, -1).swapaxes(1, 2).reshape(-1, tile, tile, image.shape[2])
    return np.concatenate([images_lib.resize(image, (tile, tile), method)[None], tiles])


def center_crop(size, key="image"):
    """The central ``size`` crop, offsets rounded down as transformers' PIL backend does;
    torchvision's ``CenterCrop`` (open_clip) rounds them to nearest, one pixel apart when the
    margin is 3 mod 4."""
    size = _pair(size)

    def fn(ex, rng):
        h, w = ex[key].shape[:2]
        if h < size[0] or w < size[1]:
            raise ValueError(f"center_crop{size} of an image of size {(h, w)}; resize first.")
        top, left = (h - size[0]) // 2, (w - size[1]) // 2
        ex[key] = ex[key][top : top + size[0], left : left + size[1]]
        return ex

    return fn


def random_resized_crop(size, scale=(0.5, 1.0), ratio=(3 / 4, 4 / 3), key="image", method="bilinear"):
    """Inception-style crop as torchvision's ``RandomResizedCrop``: a random area fraction in
    ``scale`` and aspect ratio in ``ratio`` (10 tries, then a central crop at the ratio clamped to
    ``ratio``), resized to ``size`` with PIL's ``method`` (open_clip trains with ``'bicubic'``).
    The default ``scale`` is vitmm's (torchvision's is ``(0.08, 1)``)."""
    size = _pair(size)

    def fn(ex, rng):
        image = ex[key]
        top, left, ch, cw = _crop_box(image.shape[:2], scale, ratio, rng)
        ex[key] = images_lib.resize(np.ascontiguousarray(image[top : top + ch, left : left + cw]), size, method)
        return ex

    return fn


def _crop_box(hw, scale, ratio, rng) -> tuple[int, int, int, int]:
    """``(top, left, height, width)`` of a random crop (torchvision's ``RandomResizedCrop.get_params``)."""
    h, w = hw
    for _ in range(10):
        area = h * w * rng.uniform(*scale)
        aspect = np.exp(rng.uniform(np.log(ratio[0]), np.log(ratio[1])))
        ch, cw = int(round(np.sqrt(area / aspect))), int(round(np.sqrt(area * aspect)))
        if 0 < ch <= h and 0 < cw <= w:
            return int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1)), ch, cw
    ch, cw = h, w  # no crop fits: the central crop at the clamped ratio
    if w / h < min(ratio):
        ch = int(round(w / min(ratio)))
    elif w / h > max(ratio):
        cw = int(round(h * max(ratio)))
    return (h - ch) // 2, (w - cw) // 2, ch, cw


def flip_lr(prob=0.5, text_keys=TEXT_DEFAULT, mode="swap", key="image"):
    """Horizontal flip with probability ``prob``; the words left/right (any case) in ``text_keys``
    (strings, lists of them, or conversations' turns) swapped (``mode="swap"``), or the example
    left unflipped when they appear (``mode="skip"``)."""
    if mode not in ("swap", "skip"):
        raise ValueError(f"flip_lr mode={mode!r}; choose 'swap' (swap left/right in text) or 'skip'.")

    def fn(ex, rng):
        if rng.random() >= prob:
            return ex
        if mode == "skip" and any(LEFT_RIGHT.search(t) for k in text_keys for t in _texts(ex.get(k))):
            return ex
        ex[key] = np.ascontiguousarray(ex[key][:, ::-1])
        if mode == "swap":
            for k in text_keys:
                if k in ex:
                    ex[k] = _swapped(ex[k])
        return ex

    return fn


def _texts(value):
    """The strings of a text field: a string, a list of them, a conversation's turns, or nested
    features holding them (COCO's ``captions``: ``{"id": [...], "text": [...]}``)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _texts(item)
    elif isinstance(value, list):
        for item in value:
            if isinstance(item, str):
                yield item
            elif isinstance(item, dict):
                yield from (item[k] for k in TURN_TEXT if isinstance(item.get(k), str))


def _swapped(value):
    if isinstance(value, str):
        return swap_left_right(value)
    if isinstance(value, dict):  # nested features (a flip before ``choose('captions/text')``)
        return {k: _swapped(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_swapped(item) if isinstance(item, str) else
                {k: swap_left_right(v) if k in TURN_TEXT and isinstance(v, str) else v for k, v in item.items()}
                if isinstance(item, dict) else item for item in value]
    return value
