"""Images at their own sizes: the NaFlex patch budget and packed batches for ``models.packing``.

    naflex_size(480, 640, patch=16, max_num_patches=256)   # → (224, 288): a 14×18 grid, 252 patches

``naflex_size`` (SigLIP 2's NaFlex, Tschannen et al. 2025): an image is resized to the largest
size whose patch grid fits ``max_num_patches`` with its aspect ratio kept, so the token count is a
function of the image size alone. The rule, exactly: among scales ``s ≤ max_scale``, take the
largest for which ``ceil(s·H/p) · ceil(s·W/p) ≤ max_num_patches``; the new size is
``(p·ceil(s·H/p), p·ceil(s·W/p))``, at least one patch a side. The count only grows with ``s``
and only jumps where ``s·H/p`` or ``s·W/p`` crosses an integer, so the largest such scale is one
of those points (``s = k·p/H`` or ``k·p/W``), which this searches in exact integer arithmetic:
the same sizes as the transformers SigLIP 2 image processor's bisection (tested against its stored
output for 400 sizes and budgets).
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np


def naflex_size(height: int, width: int, patch: int, max_num_patches: int,
                max_scale: float = 100.0) -> tuple[int, int]:
    """The ``(height, width)`` in pixels (multiples of ``patch``) that an image of ``height × width``
    takes under a budget of ``max_num_patches`` patches; see the module docstring for the rule.
    ``max_scale`` caps upscaling (100 in SigLIP 2's processor)."""
    if min(height, width, patch) < 1 or max_num_patches < 1:
        raise ValueError(f"naflex_size needs positive sizes and budget, got image {height}x{width}, "
                         f"patch {patch}, max_num_patches {max_num_patches}.")

    def grid(scale: Fraction) -> tuple[int, int]:
        return tuple(max(1, math.ceil(scale * side / patch)) for side in (height, width))

    cap = Fraction(max_scale)
    best = Fraction(0)
    # Candidate scales: where one side's grid reaches k (the count is constant just above each).
    for side in (height, width):
        # grids of k along this side need k ≤ max_num_patches; bisect k for the largest that fits
        lo, hi = 0, max_num_patches
        while lo < hi:
            k = (lo + hi + 1) // 2
            h, w = grid(min(Fraction(k * patch, side), cap))
            if h * w <= max_num_patches:
                lo = k
            else:
                hi = k - 1
        if lo:
            best = max(best, min(Fraction(lo * patch, side), cap))
    h, w = grid(best) if best else (1, 1)
    return h * patch, w * patch


# ----------------------------------------------------------------------------------------------
# Scenes of many shapes, and packed batches of them.
# ----------------------------------------------------------------------------------------------
def random_size(rng: np.random.Generator, min_side: int, max_side: int, max_aspect: float) -> tuple[int, int]:
    """An image size with log-uniform aspect ratio in ``[1/max_aspect, max_aspect]`` and
    log-uniform longer side in ``[min_side, max_side]`` (the shorter side at least 8 px)."""
    aspect = math.exp(rng.uniform(-math.log(max_aspect), math.log(max_aspect)))
    long = math.exp(rng.uniform(math.log(min_side), math.log(max_side)))
    short = max(8, round(long / max(aspect, 1 / aspect)))
    long = round(long)
    return (long, short) if aspect < 1 else (short, long)


class SceneSource:
    """Random-access scenes (``data.scenes.generate``) at random sizes (``random_size``), made on
    the fly: example ``i`` of a split is always the same image. A grain source."""

    def __init__(self, difficulty: str, num_examples: int, split: str = "train", seed: int = 0, *,
                 min_side: int = 32, max_side: int = 128, max_aspect: float = 3.0):
        self.difficulty, self.num_examples, self.split, self.seed = difficulty, num_examples, split, seed
        self.sizes = (min_side, max_side, max_aspect)

    def __len__(self) -> int:
        return self.num_examples

    def __getitem__(self, index: int) -> dict:
        from vitmm.data import scenes

        rng = np.random.default_rng([self.seed, scenes.SPLIT_IDS[self.split], int(index), 1])
        return scenes.generate(self.difficulty, random_size(rng, *self.sizes), int(index), self.split, self.seed)


PACKED_KEYS = ("patches", "kinds", "positions")


def packed_iterator(source, pp_fn, *, patch_size: int, seq_len: int, max_images: int, rows: int,
                    num_bins: int = 8, class_token: bool = True, num_registers: int = 0,
                    meta_keys: tuple[str, ...] = (), seed: int = 0, num_epochs: int | None = None,
                    process_index: int = 0, process_count: int = 1, patch_keep: float = 1.0,
                    max_num_patches: int | None = None):
    """Batches of ``rows`` packed rows (``models.packing.Packed`` fields as numpy arrays) from a
    source of images of many sizes: each example through ``pp_fn`` (its ``image`` float32
    ``[H, W, C]`` with sides multiples of the patch, e.g. after ``naflex``), cut into its tokens,
    and placed by grain's first-fit packer into one of ``num_bins`` open rows (more bins, less
    padding); a row holds at most ``max_images`` images. ``meta_keys`` (e.g. ``caption_tokens``)
    come along per image slot as ``[rows, max_images, ...]`` (zeros in empty slots), with
    ``image_ids`` the examples' indices in the source. Each process reads its own slice of the
    source (``process_index`` of ``process_count``). ``patch_keep < 1`` is FLIP/NaViT token
    dropping before packing: each image keeps a random ``round(patch_keep · h·w)`` of its patches
    (their grid positions kept), so a row holds more images. The iterator's
    ``get_state``/``set_state`` resume it exactly.

    An image's tokens (its patches, with ``patch_keep`` those kept, and the class and register
    tokens) must fit one row of ``seq_len``: given ``max_num_patches`` (the pp's NaFlex budget) that
    is checked here, before any data is read, and each image is checked as it is cut, so a row too
    short fails with one line naming the image and the fix rather than inside grain's packer."""
    import grain
    import grain.experimental

    from vitmm.data.pipeline import process_seed
    from vitmm.models import packing

    prefix = int(class_token) + num_registers

    def kept(n: int) -> int:
        return max(1, round(patch_keep * n)) if patch_keep < 1 else n

    if max_num_patches is not None and kept(max_num_patches) + prefix > seq_len:
        raise ValueError(f"input.packing.seq_len={seq_len} is shorter than an image at the budget: "
                         f"max_num_patches={max_num_patches} patches" + (f" ({kept(max_num_patches)} kept)"
                                                                         if patch_keep < 1 else "")
                         + f" + {prefix} class/register token(s); set seq_len >= {kept(max_num_patches) + prefix}.")

    def to_tokens(ex: dict, rng) -> dict:
        index = ex.pop("_index")
        name = ex.get("_id", f"example {index}")
        ex = pp_fn(ex, rng)
        tokens = packing.image_tokens(ex["image"], patch_size, class_token=class_token, num_registers=num_registers)
        if patch_keep < 1:
            n = len(tokens["kinds"]) - prefix
            keep = np.sort(rng.permutation(n)[:kept(n)]) + prefix
            rows = np.concatenate([np.arange(prefix), keep])
            tokens = {**{k: tokens[k][rows] for k in PACKED_KEYS}, "grid": tokens["grid"]}
        if len(tokens["kinds"]) > seq_len:
            h, w = (int(v) for v in tokens["grid"])
            raise ValueError(f"{name} has {len(tokens['kinds'])} tokens ({h}x{w} patches"
                             + (f", {len(tokens['kinds']) - prefix} kept" if patch_keep < 1 else "")
                             + f" + {prefix} class/register token(s)) > input.packing.seq_len={seq_len}; set "
                             f"seq_len >= max_num_patches + {prefix} (the pp's NaFlex budget and the tower's prefix).")
        return {**{k: tokens[k] for k in PACKED_KEYS}, "grid": tokens["grid"], "image_id": index,
                **{k: np.asarray(ex[k]) for k in meta_keys}}

    def to_row(row: dict) -> dict:
        out = {k: row[k] for k in PACKED_KEYS}
        out["segment_ids"] = row["kinds_segment_ids"].astype(np.int32)
        n = len(row["grid"])
        for key, fill in [("grid", 0), ("image_id", -1), *((k, 0) for k in meta_keys)]:
            values = np.stack([np.asarray(v) for v in row[key]])
            padded = np.full((max_images, *values.shape[1:]), fill, values.dtype)
            padded[:n] = values
            out["grids" if key == "grid" else "image_ids" if key == "image_id" else key] = padded
        return out

    seed = process_seed(seed, process_index)
    ds = grain.MapDataset.source(_Indexed(source))[process_index::process_count].shuffle(seed=seed).repeat(num_epochs)
    ds = ds.random_map(to_tokens, seed=seed).to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=8))
    ds = grain.experimental.FirstFitPackIterDataset(
        ds, length_struct={k: seq_len for k in PACKED_KEYS}, num_packing_bins=num_bins, shuffle_bins=False,
        max_sequences_per_bin=max_images, meta_features=("grid", "image_id", *meta_keys))
    return iter(ds.map(to_row).batch(rows, drop_remainder=True))


class _Indexed:
    """A source whose examples carry their index (``_index``)."""

    def __init__(self, source):
        self._source = source

    def __len__(self) -> int:
        return len(self._source)

    def __getitem__(self, index: int) -> dict:
        return {**self._source[index], "_index": np.int64(index)}
