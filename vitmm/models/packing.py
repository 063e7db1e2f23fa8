"""Packed sequences (NaViT, Dehghani et al. 2023): images of different sizes in one fixed-length row.

    batch = packing.pack([img_a, img_b, img_c], patch_size=16, seq_len=256, max_images=4,
                         class_token=True, num_registers=0)      # the model's
    pooled, out = model.apply(variables, batch)      # pooled: [rows, max_images, D]
    per_image = packing.unpack(pooled, batch)        # [img_a's, img_b's, img_c's], each [D]

A row holds whole images one after another, each as ``[cls | registers | patches]`` (the
order of a ``ViT``'s unpacked sequence), then padding. ``Packed`` says for every token which image
it belongs to (``segment_ids``, 1-based within the row, 0 for padding), what it is (``kinds``: a
patch, the CLS token or register ``r``) and where a patch sits in its image's grid (``positions``,
row and column); ``grids`` holds each image's grid. A ``ViT`` applied to it attends only within
an image, gives each image its own positions and pools per image, so every image gets what its
own unpacked forward gives (tested to float32 rounding for every position kind and pooling).

``pack`` lays out given images (host, numpy): ``image_tokens`` per image, ``first_fit`` to decide
which share a row, ``from_rows`` for the arrays (``data.packing`` streams them with grain).
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.struct
import jax.numpy as jnp
import numpy as np

from vitmm.models.patch_embed import grid_size, to_pair

PATCH, CLS, FIRST_REGISTER = 0, 1, 2  # kinds; register r is FIRST_REGISTER + r


@flax.struct.dataclass
class Packed:
    """One batch of packed rows (a pytree: it goes through ``jit`` as it is).

    patches: ``[B, L, ph·pw·C]``, each patch flattened in ``(row, col, channel)`` order (that of
      ``patch_embed.unfold_patches``); zeros at prefix and padding tokens.
    segment_ids: ``[B, L]`` int32, the image a token belongs to (1 … K), 0 for padding.
    kinds: ``[B, L]`` int32, ``PATCH``, ``CLS`` or ``FIRST_REGISTER + r``.
    positions: ``[B, L, 2]`` int32, a patch's (row, col) in its image's grid; 0 elsewhere.
    grids: ``[B, K, 2]`` int32, each image's grid (h, w); 0 for an empty slot.
    image_ids: ``[B, K]`` int32, which of the packed images a slot holds (its index in the list
      given to ``pack``); -1 for an empty slot. The model does not read it; ``unpack`` does.
    """

    patches: jnp.ndarray
    segment_ids: jnp.ndarray
    kinds: jnp.ndarray
    positions: jnp.ndarray
    grids: jnp.ndarray
    image_ids: jnp.ndarray

    @property
    def max_images(self) -> int:
        return self.grids.shape[1]

    def image_mask(self):
        """``[B, K]``: True where a slot holds an image."""
        return self.grids[..., 0] > 0

    def padding_fraction(self) -> float:
        return float(np.mean(np.asarray(self.segment_ids) == 0))


def first_fit(lengths: Sequence[int], seq_len: int, max_images: int) -> list[list[int]]:
    """Greedy first-fit in the given order: each item goes into the first row with room for its
    length (and fewer than ``max_images`` items), else opens a new row. Returns the rows as lists
    of item indices. An item longer than ``seq_len`` is an error that names it."""
    rows: list[list[int]] = []
    free: list[int] = []
    for i, n in enumerate(lengths):
        if n > seq_len:
            raise ValueError(f"Item {i} needs {n} tokens but a row holds seq_len={seq_len}; raise seq_len "
                             "or give the image a smaller patch budget (data.packing.naflex_size).")
        for r, room in enumerate(free):
            if n <= room and len(rows[r]) < max_images:
                rows[r].append(i)
                free[r] -= n
                break
        else:
            rows.append([i])
            free.append(seq_len - n)
    return rows


def image_tokens(image: np.ndarray, patch_size: int | Sequence[int], *, class_token: bool = True,
                 num_registers: int = 0) -> dict:
    """One image's tokens as they enter a row: ``patches [n, ph·pw·C]`` (zeros for the prefix),
    ``kinds [n]`` and ``positions [n, 2]``, with ``n = prefix + h·w``, and its ``grid (h, w)``."""
    ph, pw = to_pair(patch_size, "patch_size")
    image = np.asarray(image, np.float32)
    if image.ndim != 3:
        raise ValueError(f"Packing needs [H, W, C] images, got shape {image.shape}.")
    (h, w), c = grid_size(image.shape[:2], (ph, pw)), image.shape[-1]
    prefix = [CLS] * class_token + [FIRST_REGISTER + r for r in range(num_registers)]
    p = len(prefix)
    patches = np.zeros((p + h * w, ph * pw * c), np.float32)
    patches[p:] = image.reshape(h, ph, w, pw, c).transpose(0, 2, 1, 3, 4).reshape(h * w, ph * pw * c)
    positions = np.zeros((p + h * w, 2), np.int32)
    positions[p:] = np.stack(np.divmod(np.arange(h * w), w), axis=1)
    kinds = np.array(prefix + [PATCH] * (h * w), np.int32)
    return dict(patches=patches, kinds=kinds, positions=positions, grid=np.array([h, w], np.int32))


def from_rows(rows: Sequence[Sequence[dict]], seq_len: int, max_images: int,
              image_ids: Sequence[Sequence[int]] | None = None) -> Packed:
    """Lays out rows of ``image_tokens`` dicts one after another (then padding) as a ``Packed``
    batch; ``image_ids`` (default: counting across rows) say which image each entry is."""
    if not rows or not rows[0]:
        raise ValueError("from_rows needs at least one row with one image.")
    size = rows[0][0]["patches"].shape[-1]
    b = len(rows)
    out = dict(patches=np.zeros((b, seq_len, size), np.float32), segment_ids=np.zeros((b, seq_len), np.int32),
               kinds=np.zeros((b, seq_len), np.int32), positions=np.zeros((b, seq_len, 2), np.int32),
               grids=np.zeros((b, max_images, 2), np.int32), image_ids=np.full((b, max_images), -1, np.int32))
    count = 0
    for r, members in enumerate(rows):
        if len(members) > max_images:
            raise ValueError(f"Row {r} has {len(members)} images but max_images={max_images}.")
        start = 0
        for k, tokens in enumerate(members):
            n = len(tokens["kinds"])
            if start + n > seq_len:
                raise ValueError(f"Row {r} needs more than seq_len={seq_len} tokens (image {k} ends at {start + n}).")
            span = slice(start, start + n)
            out["segment_ids"][r, span] = k + 1
            for key in ("patches", "kinds", "positions"):
                out[key][r, span] = tokens[key]
            out["grids"][r, k] = tokens["grid"]
            out["image_ids"][r, k] = image_ids[r][k] if image_ids is not None else count
            count += 1
            start += n
    return Packed(**out)


def pack(images: Sequence[np.ndarray], patch_size: int | Sequence[int], seq_len: int, max_images: int, *,
         class_token: bool = True, num_registers: int = 0,
         rows: Sequence[Sequence[int]] | None = None) -> Packed:
    """Packs ``images`` (each ``[H, W, C]``, sides multiples of the patch) into rows of
    ``seq_len`` tokens with at most ``max_images`` images each. ``rows`` (lists of indices into
    ``images``) fixes the layout; by default ``first_fit`` in the given order. ``unpack`` returns
    per-image results in the order of ``images``.

    ``class_token`` and ``num_registers`` are the model's: each image's tokens start with them."""
    if len({np.shape(im)[-1] for im in images}) != 1 or any(np.ndim(im) != 3 for im in images):
        raise ValueError(f"pack needs [H, W, C] images with one channel count, got shapes "
                         f"{sorted({tuple(np.shape(im)) for im in images})}.")
    tokens = [image_tokens(im, patch_size, class_token=class_token, num_registers=num_registers) for im in images]
    if rows is None:
        rows = first_fit([len(t["kinds"]) for t in tokens], seq_len, max_images)
    return from_rows([[tokens[i] for i in members] for members in rows], seq_len, max_images,
                     image_ids=[list(members) for members in rows])


def unpack(values, packed: Packed) -> list:
    """Per-image results ``values [B, K, ...]`` (e.g. the pooled output) as a list in the order
    of the images given to ``pack`` (``packed.image_ids``)."""
    values, ids = np.asarray(values), np.asarray(packed.image_ids)
    slots = {int(i): (r, k) for (r, k), i in np.ndenumerate(ids) if i >= 0}
    return [values[slots[i]] for i in sorted(slots)]
