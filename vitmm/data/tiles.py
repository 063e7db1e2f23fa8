"""Idefics3's (SmolVLM's) image splitting as a preprocessing op: ``idefics3_tiles``.

    decode(max_images=2)|idefics3_tiles(1536, 384)|normalize(...)|conversation_tokens(...)

Each image of an example has its longest edge resized to ``longest_edge`` (the other side kept in
proportion, rounded down to an even number, at most 4096), then both sides up to multiples of
``tile``; an image larger than one tile is cut into ``rows × cols`` tiles and followed by the whole
image squashed to one tile, a smaller one stays one tile. The tiles become the example's images,
and each ``<image>`` tag of the conversation the processor's text around them (``image_texts``,
which ``conversation_tokens`` puts in after the chat template, as the processor does): for a split
image ``<fake_token_around_image><row_r_col_c><image>`` for each tile, a newline after each row,
then ``\\n<fake_token_around_image><global-img><image><fake_token_around_image>`` (just the last
part for one tile), each ``<image>`` one tile's visual tokens. The rules are transformers'
``Idefics3ImageProcessor`` and ``Idefics3Processor`` (tested on their outputs)."""

from __future__ import annotations

import math

import numpy as np

from vitmm.data import images as images_lib

FAKE, GLOBAL, TAG = "<fake_token_around_image>", "<global-img>", "<image>"
MAX_SIDE = 4096  # the processor's MAX_IMAGE_SIZE


def resized_size(h: int, w: int, longest_edge: int) -> tuple[int, int]:
    """The first resize: the longest edge to ``longest_edge`` (the other side rounded down, then up
    to even), and both at most ``MAX_SIDE``."""
    aspect = w / h
    if w >= h:
        w, h = longest_edge, int(longest_edge / aspect)
        h += h % 2
    else:
        h, w = longest_edge, int(longest_edge * aspect)
        w += w % 2
    h, w = max(h, 1), max(w, 1)
    if max(h, w) > MAX_SIDE:  # scaled below the upper bound, aspect from the first resize
        aspect = w / h
        h, w = (int(MAX_SIDE / aspect), MAX_SIDE) if w >= h else (MAX_SIDE, int(MAX_SIDE * aspect))
    return max(h, 1), max(w, 1)


def encoder_size(h: int, w: int, tile: int) -> tuple[int, int]:
    """Both sides up to multiples of ``tile`` (the longer first, the other by the aspect ratio)."""
    aspect = w / h
    if w >= h:
        w = math.ceil(w / tile) * tile
        return math.ceil(int(w / aspect) / tile) * tile, w
    h = math.ceil(h / tile) * tile
    return h, math.ceil(int(h * aspect) / tile) * tile


def split(image: np.ndarray, longest_edge: int, tile: int, method: str = "lanczos") -> tuple[list, str]:
    """One image's tiles (and the whole image last) and the text its ``<image>`` tag becomes."""
    image = images_lib.resize(image, resized_size(*image.shape[:2], longest_edge), method)
    image = images_lib.resize(image, encoder_size(*image.shape[:2], tile), method)
    h, w = image.shape[:2]
    whole = f"{FAKE}{GLOBAL}{TAG}{FAKE}"
    if h <= tile and w <= tile:
        return [image], whole
    rows, cols = h // tile, w // tile
    tiles = [image[r * tile:(r + 1) * tile, c * tile:(c + 1) * tile] for r in range(rows) for c in range(cols)]
    text = "".join("".join(f"{FAKE}<row_{r + 1}_col_{c + 1}>{TAG}" for c in range(cols)) + "\n" for r in range(rows))
    return [*tiles, images_lib.resize(image, (tile, tile), method)], f"{text}\n{whole}"


def idefics3_tiles(longest_edge, tile, method="lanczos", key="image"):
    """The op (see the module docstring): an example's images (``key`` and ``more_images``) become
    their tiles, ``image_texts`` the text each ``<image>`` tag becomes. Put it after ``decode`` and
    before ``normalize``."""

    def fn(ex, rng):
        if not ex.get("has_image", True):  # a text-only example's placeholder, at the tiles' size to batch with them
            ex[key] = np.zeros((tile, tile, ex[key].shape[-1]), ex[key].dtype)
            return ex
        made = [split(image, longest_edge, tile, method) for image in [ex[key], *ex.get("more_images", [])]]
        frames = [frame for tiles, _ in made for frame in tiles]
        ex[key], ex["image_texts"] = frames[0], [text for _, text in made]
        if len(frames) > 1:
            ex["more_images"] = frames[1:]
        return ex

    return fn
