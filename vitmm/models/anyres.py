"""AnyRes (LLaVA-NeXT, Liu et al. 2024): a high-resolution image as a base view plus tiles.

    layout = anyres.plan((480, 640), pinpoints=[(336, 672), (672, 336), (672, 672)], tile=336)
    anyres.num_tokens((480, 640), pinpoints, tile=336, tile_grid=(24, 24))   # what the LM gets

The image goes to the candidate resolution (``pinpoints``) that keeps the most of its pixels and
wastes the least (``best_resolution``), resized with its aspect ratio kept and centred with zero
padding, then cut into ``tile × tile`` tiles in raster order; a base view is the whole image
squashed to one tile. Each view goes through the tower and the connector, which give a grid of
tokens per tile (``tile_grid``). The tiles' grids are put back together, the rows or columns that
only show padding are cut away (``unpadded``), and a learned newline token ends every row; the
base view's tokens come first. The rules are transformers' (``select_best_resolution``,
``get_patch_output_size``, ``unpad_image``), and ``num_tokens`` equals its processor's count on
300 stored image sizes (tested), as it equals the VLM's real output shape.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np


def check_pinpoints(pinpoints, tile: int) -> list[tuple[int, int]]:
    """The candidate resolutions as ``(h, w)`` pairs, or ValueError in one line naming what cannot
    be tiled and the fix: an empty list, an entry that is not a pair, a side that is not a positive
    whole number of ``tile``-pixel tiles (every candidate, not only the one an image chooses:
    ``max_views`` and ``max_tokens`` size batches by all of them), a tile that is not positive."""
    if isinstance(tile, bool) or not isinstance(tile, int | np.integer) or tile < 1:
        raise ValueError(f"anyres tile={tile!r} must be a positive whole number of pixels (the tower's input side, "
                         "e.g. 336).")
    example = f"[({tile}, {2 * tile}), ({2 * tile}, {tile}), ({2 * tile}, {2 * tile})]"
    if not len(pinpoints):
        raise ValueError(f"anyres pinpoints {list(pinpoints)} are empty: give at least one (height, width), each a "
                         f"multiple of the {tile}px tile, e.g. {example}.")
    out = []
    for p in pinpoints:
        if isinstance(p, str) or not hasattr(p, "__len__") or len(p) != 2:
            raise ValueError(f"anyres pinpoint {p!r} is not a (height, width) pair: give a list of pairs, e.g. "
                             f"{example}.")
        sides = [int(v) if isinstance(v, int | float | np.number) and not isinstance(v, bool) and
                 float(v).is_integer() else None for v in p]
        if any(v is None or v < tile or v % tile for v in sides):
            fix = tuple(tile if v is None else max(tile, round(v / tile) * tile) for v in sides)
            raise ValueError(f"anyres pinpoint {tuple(p)} is not a whole number of {tile}px tiles a side "
                             f"(at least one): use multiples of {tile} (e.g. {fix}).")
        out.append((sides[0], sides[1]))
    return out


def best_resolution(image_hw: Sequence[int], pinpoints: Sequence[Sequence[int]]) -> tuple[int, int]:
    """The candidate ``(h, w)`` that shows the most of the image's own pixels after an
    aspect-preserving resize (at most its pixel count: upscaling adds none), ties broken by the
    least padding; the first such candidate."""
    if not len(pinpoints):
        raise ValueError(f"anyres pinpoints {list(pinpoints)} are empty: give at least one (height, width).")
    h, w = image_hw
    best, best_key = None, None
    for ch, cw in pinpoints:
        scale = min(cw / w, ch / h)
        shown = min(int(w * scale) * int(h * scale), w * h)
        key = (shown, -(ch * cw - shown))
        if best_key is None or key > best_key:
            best, best_key = (int(ch), int(cw)), key
    return best


def fitted_size(image_hw: Sequence[int], target_hw: Sequence[int]) -> tuple[int, int]:
    """The image's size inside ``target_hw`` after an aspect-preserving resize (the longer
    relative side fills the target; the other rounds up). The scale is computed first and then
    multiplied, as transformers' ``get_patch_output_size`` does: ``h * (tw / w)`` and ``h * tw / w``
    round differently when the exact size is whole (375×500 in 672² is 505×672, not 504×672)."""
    (h, w), (th, tw) = image_hw, target_hw
    scale_w, scale_h = tw / w, th / h
    if scale_w < scale_h:
        return min(math.ceil(h * scale_w), th), tw
    return th, min(math.ceil(w * scale_h), tw)


def plan(image_hw: Sequence[int], pinpoints, tile: int) -> dict:
    """``best`` resolution, the ``fitted`` size in it, the ``offset`` (top, left) of the centred
    image, and the ``tiles`` (rows, cols)."""
    pinpoints = check_pinpoints(pinpoints, tile)
    if min(image_hw) < 1:
        raise ValueError(f"AnyRes of an image of {image_hw[0]}x{image_hw[1]} pixels: it needs at least one pixel a "
                         "side; check how it was decoded or cropped.")
    best = best_resolution(image_hw, pinpoints)
    fitted = fitted_size(image_hw, best)
    return dict(best=best, fitted=fitted, offset=((best[0] - fitted[0]) // 2, (best[1] - fitted[1]) // 2),
                tiles=(best[0] // tile, best[1] // tile))


def unpadded(image_hw: Sequence[int], grid_hw: Sequence[int]) -> tuple[slice, slice]:
    """The rows and columns of a ``grid_hw`` token grid (the tiles together) that show the image,
    not its padding: the axis the image does not fill loses ``(grid - image)//2`` at each end."""
    (h, w), (gh, gw) = image_hw, grid_hw
    if w / h > gw / gh:
        new = int(round(h * (gw / w), 7))
        pad = (gh - new) // 2
        return slice(pad, gh - pad), slice(0, gw)
    new = int(round(w * (gh / h), 7))
    pad = (gw - new) // 2
    return slice(0, gh), slice(pad, gw - pad)


def num_tokens(image_hw: Sequence[int], pinpoints, tile: int, tile_grid: Sequence[int], extra: int = 0) -> int:
    """Visual tokens for an image: the base view's ``tile_grid`` (+ ``extra``, e.g. a CLS token),
    the tiles' unpadded grid and one newline per row of it."""
    layout = plan(image_hw, pinpoints, tile)
    rows, cols = unpadded(image_hw, (layout["tiles"][0] * tile_grid[0], layout["tiles"][1] * tile_grid[1]))
    n_rows, n_cols = rows.stop - rows.start, cols.stop - cols.start
    return tile_grid[0] * tile_grid[1] + extra + n_rows * n_cols + n_rows


NEWLINE = -1  # a layout entry that is the learned newline token, not a view's token


def layout(image_hw: Sequence[int], pinpoints, tile: int, tile_grid: Sequence[int]) -> np.ndarray:
    """Where each of the LM's visual tokens for an image of ``image_hw`` comes from: its index in
    the views' tokens flattened in order (view, row, column), or ``NEWLINE``. The base view's grid
    comes first, then the tiles' grids put back together, cut to the image (``unpadded``), each
    row followed by a newline; ``len(layout(...)) == num_tokens(...)``. Host-side numpy, so a
    batch of images of different sizes can be laid out before the model (``gather``)."""
    gh, gw = tile_grid
    rows, cols = plan(image_hw, pinpoints, tile)["tiles"]
    r, c = np.meshgrid(np.arange(rows * gh), np.arange(cols * gw), indexing="ij")  # the tiles' canvas
    index = (1 + (r // gh) * cols + c // gw) * gh * gw + (r % gh) * gw + c % gw
    keep_rows, keep_cols = unpadded(image_hw, index.shape)
    index = index[keep_rows, keep_cols]
    index = np.concatenate([index, np.full((index.shape[0], 1), NEWLINE)], axis=1)
    return np.concatenate([np.arange(gh * gw), index.reshape(-1)]).astype(np.int32)


def downsampled(image_hw: Sequence[int], pinpoints, tile: int, tile_grid: Sequence[int],
                max_patches: int) -> tuple[np.ndarray, np.ndarray]:
    """LLaVA-OneVision's ``anyres_max_N`` (``max_patches = N``): ``layout``'s tokens as
    ``(index [M, 4], weights [M, 4])``, each token the weighted sum of up to four view tokens. When
    the unpadded grid holds more than ``1.1² · N`` tiles' tokens it is resized bilinearly (PyTorch's
    ``interpolate``, ``align_corners=False``) by ``ratio = √(cells / (N · gh · gw))`` to
    ``(rows // ratio, cols // ratio)``, before the newlines; otherwise each token is one view token
    (weights ``[1, 0, 0, 0]``). ``NEWLINE`` rows keep ``NEWLINE`` in the first index."""
    flat = layout(image_hw, pinpoints, tile, tile_grid)
    gh, gw = tile_grid
    base, grid = flat[:gh * gw], flat[gh * gw:]
    rows = int(np.sum(grid == NEWLINE))
    one = lambda idx: (np.stack([idx, idx, idx, idx], -1), np.tile(np.array([1, 0, 0, 0], np.float32),  # noqa: E731
                                                                      (len(idx), 1)))
    if not rows:  # a banner whose unpadded grid kept no row: the base view alone, as LLaVA-OneVision gives it
        return one(flat)
    grid = grid.reshape(rows, -1)[:, :-1]  # the unpadded grid without its newlines
    h, w = grid.shape
    ratio = math.sqrt(h * w / (max_patches * gh * gw))
    if ratio <= 1.1:
        return one(flat)
    oh, ow = int(h // ratio), int(w // ratio)

    def taps(out: int, size: int):  # each output's two source rows (or columns) and their weights
        src = np.maximum((np.arange(out, dtype=np.float32) + np.float32(0.5)) * np.float32(size / out)
                         - np.float32(0.5), 0).astype(np.float32)
        low = src.astype(np.int64)
        frac = (src - low).astype(np.float32)
        return low, np.minimum(low + 1, size - 1), (np.float32(1) - frac).astype(np.float32), frac

    y0, y1, wy0, wy1 = taps(oh, h)
    x0, x1, wx0, wx1 = taps(ow, w)
    index = np.stack([grid[y0][:, x0], grid[y0][:, x1], grid[y1][:, x0], grid[y1][:, x1]], -1)
    weights = np.stack([wy0[:, None] * wx0[None], wy0[:, None] * wx1[None], wy1[:, None] * wx0[None],
                        wy1[:, None] * wx1[None]], -1).astype(np.float32)
    newline = np.broadcast_to(np.array([NEWLINE] * 4), (oh, 1, 4))
    index = np.concatenate([index, newline], axis=1).reshape(-1, 4)
    weights = np.concatenate([weights, np.broadcast_to(np.array([1, 0, 0, 0], np.float32), (oh, 1, 4))], 1)
    base_index, base_weights = one(base)
    return (np.concatenate([base_index, index]).astype(np.int32),
            np.concatenate([base_weights, weights.reshape(-1, 4)]).astype(np.float32))


def max_downsampled_tokens(pinpoints, tile: int, tile_grid: Sequence[int], max_patches: int) -> int:
    """A bound on ``downsampled``'s token count: the base view, at most ``1.1² · N`` tiles' tokens
    (more are resized below that) and a newline for each of the tallest canvas's rows."""
    pinpoints = check_pinpoints(pinpoints, tile)
    gh, gw = tile_grid
    rows = max(h // tile for h, _ in pinpoints) * gh
    return min(gh * gw + int(1.21 * max_patches * gh * gw) + rows, max_tokens(pinpoints, tile, tile_grid))


def max_views(pinpoints, tile: int) -> int:
    """The most views (base + tiles) any image gets: what a batch pads its views to."""
    pinpoints = check_pinpoints(pinpoints, tile)
    return 1 + max((h // tile) * (w // tile) for h, w in pinpoints)


def max_tokens(pinpoints, tile: int, tile_grid: Sequence[int]) -> int:
    """The most visual tokens any image gets (a candidate's full canvas, nothing unpadded)."""
    pinpoints = check_pinpoints(pinpoints, tile)
    gh, gw = tile_grid
    return gh * gw + max((h // tile) * gh * ((w // tile) * gw + 1) for h, w in pinpoints)


def gather(tokens: jnp.ndarray, index, newline: jnp.ndarray) -> jnp.ndarray:
    """The LM's tokens ``[B, M, D]`` from each view's grid of tokens ``[B, V, gh, gw, D]`` and each
    example's ``layout`` ``[B, M]`` (``NEWLINE``: ``newline [D]``), or ``downsampled``'s
    ``(index [B, M, 4], weights [B, M, 4])``: each token the weighted sum of its four."""
    b, v, gh, gw, d = tokens.shape
    table = jnp.concatenate([tokens.reshape(b, v * gh * gw, d),
                             jnp.broadcast_to(newline.astype(tokens.dtype), (b, 1, d))], axis=1)
    weights = None
    if isinstance(index, tuple | list):
        index, weights = index
    index = jnp.where(index == NEWLINE, v * gh * gw, index)
    if weights is None:
        return jnp.take_along_axis(table, index[..., None], axis=1)
    picked = jnp.take_along_axis(table, index.reshape(b, -1)[..., None], axis=1).reshape(*index.shape, d)
    w = weights.astype(tokens.dtype)[..., None]  # summed as interpolate does: rows of two, then the pair
    return (picked[:, :, 0] * w[:, :, 0] + picked[:, :, 1] * w[:, :, 1]) + \
        (picked[:, :, 2] * w[:, :, 2] + picked[:, :, 3] * w[:, :, 3])


def assemble(tokens: jnp.ndarray, image_hw: Sequence[int], pinpoints, tile: int, newline: jnp.ndarray) -> jnp.ndarray:
    """``gather`` for a batch of images of one size: tokens ``[B, 1 + rows·cols, gh, gw, D]`` (the
    base view, then the tiles in raster order, as ``views`` makes them)."""
    index = layout(image_hw, pinpoints, tile, tokens.shape[2:4])
    return gather(tokens, jnp.broadcast_to(jnp.asarray(index), (tokens.shape[0], len(index))), newline)


def views(images: jnp.ndarray, pinpoints, tile: int) -> jnp.ndarray:
    """``images [B, H, W, C]`` (one size) → ``[B, 1 + rows·cols, tile, tile, C]``: the base view
    (squashed to a tile), then the tiles in raster order (bicubic resizes, anti-aliased; the
    padding is zero of the input, the mean colour of normalised images, where the ``anyres``
    preprocessing op, for batches of images at their own sizes, pads black as LLaVA-NeXT does)."""
    b, h, w, c = images.shape
    layout = plan((h, w), pinpoints, tile)
    (fh, fw), (top, left), (rows, cols) = layout["fitted"], layout["offset"], layout["tiles"]
    resize = lambda x, size: jax.image.resize(x, (b, *size, c), "bicubic", antialias=True)  # noqa: E731
    canvas = jnp.zeros((b, *layout["best"], c), images.dtype).at[:, top:top + fh, left:left + fw].set(
        resize(images, (fh, fw)).astype(images.dtype))
    tiles = canvas.reshape(b, rows, tile, cols, tile, c).transpose(0, 1, 3, 2, 4, 5)
    tiles = tiles.reshape(b, rows * cols, tile, tile, c)
    return jnp.concatenate([resize(images, (tile, tile))[:, None].astype(images.dtype), tiles], axis=1)
