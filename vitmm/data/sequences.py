"""VLM examples as flat sequences with any number of images, and rows packed with them
(``input.sequences``; ``VLM.packed`` reads them).

    python -m vitmm.train --config configs/llava_finetune.py:pack=512 ...

An example (after the pp: ``ids``, ``answer_mask``, ``image_pos`` or ``image_positions``, its
images) becomes one sequence ``to_sequence``: text tokens with each image's ``M`` visual tokens
where its ``<image>`` stood. Per position:

* ``tokens``: the text id (0 on visual positions);
* ``visual``: which visual token sits there, ``k · M + j`` for token ``j`` of the example's image
  ``k`` (-1 on text);
* ``targets``/``weights``: position ``t`` predicts the text token at ``t + 1``, weighted by its
  answer mask (0 where ``t + 1`` is visual or past the end), the same terms as ``VLM.__call__``'s
  ``text_logits`` give an unpacked example;
* ``prefix``: the positions before the first answer token (image and prompt: a prefix-LM's
  bidirectional part).

The sequence ends at the last answer token: what follows it changes no loss term under a causal
mask. ``packed_batches`` packs sequences into rows of ``length`` positions and ``max_images``
image slots with grain's first-fit packer (``bins`` open rows; ``pack=False``: one example a row,
padded, the baseline), each row's examples numbered by ``segment_ids`` and their ``positions``
restarting at 0, and ``visual`` renumbered to the row's image slots. The loss over a packed batch
is the unpacked batch's (``tests/data/test_sequences.py``).
"""

from __future__ import annotations

import numpy as np

from vitmm.data import skips

SEQUENCE_KEYS = ("tokens", "visual", "targets", "weights", "prefix")


def to_sequence(ex: dict, num_visual: int, mrope_grid: tuple[int, int] | None = None) -> dict:
    """The flat sequence of one pp'd example (see the module docstring) and its ``images``
    ``[K, H, W, C]`` (``K = 0`` for a text-only example); with ``mrope_grid`` (an image's visual
    tokens as rows × columns), ``mrope [S, 3]``: Qwen2-VL's 3D positions (``mrope_positions``)."""
    answer = np.asarray(ex["answer_mask"])
    answered = np.flatnonzero(answer)
    if not len(answered):
        raise skips.BadExample("too_long", "no answer token is left to train on")
    tokens, visual, text_at, images = _interleave(ex, int(answered[-1]) + 1, num_visual)
    is_text = text_at >= 0
    weight_here = np.where(is_text, answer[np.maximum(text_at, 0)], 0).astype(np.float32)
    targets = np.zeros_like(tokens)
    weights = np.zeros(len(tokens), np.float32)
    targets[:-1] = np.where(is_text[1:], tokens[1:], 0)
    weights[:-1] = weight_here[1:]
    first_answer = int(np.flatnonzero(weight_here)[0])
    out = {"tokens": tokens, "visual": visual, "targets": targets, "weights": weights,
           "prefix": np.arange(len(tokens)) < first_answer, "images": images}
    if mrope_grid is not None:
        out["mrope"] = mrope_positions(visual, mrope_grid, int(ex.get("video_frames", 0))).T
    return out


def prompt_sequence(ex: dict, num_visual: int, mrope_grid: tuple[int, int] | None = None) -> dict:
    """A prompt's sequence (its first ``prompt_len`` text tokens and the images among them):
    ``tokens``, ``visual`` and ``images`` (and ``mrope [S, 3]``, as ``to_sequence``), what
    ``VLM.prefill_sequences`` takes."""
    tokens, visual, _, images = _interleave(ex, int(ex["prompt_len"]), num_visual)
    out = {"tokens": tokens, "visual": visual, "images": images}
    if mrope_grid is not None:
        out["mrope"] = mrope_positions(visual, mrope_grid, int(ex.get("video_frames", 0))).T
    return out


def mrope_positions(visual: np.ndarray, grid: tuple[int, int], video_frames: int = 0) -> np.ndarray:
    """Qwen2-VL's 3D positions ``[3, S]`` of one sequence (``get_rope_index``): a text token at
    ``(p, p, p)`` and the next at ``p + 1``; an image of ``rows × cols`` tokens from ``p`` at
    ``(p, p + i, p + j)`` and a video of ``t`` frames (its temporal patches, consecutive images
    when ``video_frames`` is ``t``) at ``(p + τ, p + i, p + j)``, the text after either at
    ``p + max(t, rows, cols)``."""
    rows, cols = grid
    m = rows * cols
    out = np.zeros((3, len(visual)), np.int64)
    current, k = 0, 0
    while k < len(visual):
        if visual[k] < 0:
            out[:, k] = current
            current, k = current + 1, k + 1
            continue
        t = video_frames or 1
        tau, ij = np.divmod(np.arange(t * m), m)
        out[:, k:k + t * m] = current + np.stack([tau, ij // cols, ij % cols])
        current, k = current + max(t, rows, cols), k + t * m
    return out


def _interleave(ex: dict, end: int, num_visual: int):
    """The text tokens ``ids[:end]`` with each image's ``num_visual`` positions where it goes:
    ``(tokens, visual, text index of each position (-1 on visual ones), images [K, H, W, C])``."""
    ids = np.asarray(ex["ids"])
    has_image = bool(ex.get("has_image", True))
    images = [ex["image"], *ex.get("more_images", [])] if has_image else []
    places = ex.get("image_positions")
    places = [int(p) for p in places] if places is not None else [int(ex.get("image_pos", 1))] * len(images)
    if len(places) != len(images):
        raise ValueError(f"to_sequence: {len(places)} image positions for {len(images)} images.")
    if places != sorted(places) or any(not 0 <= p <= end for p in places):
        raise ValueError(f"to_sequence: image positions {places} are not ascending within the {end} text tokens.")
    text_at, visual = [], []
    cursor = 0
    for k, place in enumerate(places + [end]):
        text_at += range(cursor, place)
        visual += [-1] * (place - cursor)
        cursor = place
        if k < len(places):
            text_at += [-1] * num_visual
            visual += range(k * num_visual, (k + 1) * num_visual)
    text_at, visual = np.asarray(text_at, np.int64), np.asarray(visual, np.int32)
    tokens = np.where(text_at >= 0, ids[np.maximum(text_at, 0)], 0).astype(np.int32)
    first = np.asarray(ex["image"])
    stacked = np.stack(images) if images else np.zeros((0, *first.shape), first.dtype)
    return tokens, visual, text_at, stacked


def row_visual(visual: np.ndarray, segments: np.ndarray, image_segments: np.ndarray, num_visual: int) -> np.ndarray:
    """Each example's ``visual`` (its own image numbers) as the row's: image ``k`` of the example in
    segment ``s`` is the row's slot ``first(s) + k``, ``first(s)`` the first slot ``image_segments``
    gives ``s`` (the packer lays a row's images out in segment order)."""
    real = image_segments[image_segments > 0]
    first = np.searchsorted(real, segments)
    return np.where((visual >= 0) & (segments > 0), first * num_visual + visual, -1).astype(np.int32)


def packed_batches(source, pp_fn, *, num_visual: int, length: int, max_images: int, rows: int, pack: bool = True,
                   bins: int = 8, seed: int = 0, num_epochs: int | None = None, process_index: int = 0,
                   process_count: int = 1, skip_bad: float | None = None, workers: int = 0,
                   mrope_grid: tuple[int, int] | None = None):
    """Batches of ``rows`` rows (``SEQUENCE_KEYS``, ``segment_ids``, ``positions`` ``[rows, length]``;
    ``images [rows, max_images, H, W, C]``) from ``source`` through ``pp_fn`` and ``to_sequence``;
    each process reads its own slice. ``skip_bad`` (raw data): bad examples are skipped and counted
    as ``skips.SkippingBatches`` does (its counts in the state). ``get_state``/``set_state`` resume
    the stream exactly (grain's packer keeps its open rows in the state). ``mrope_grid``: rows carry
    ``mrope [rows, length, 3]`` too (``mrope_positions``, restarting at each example)."""
    import grain
    import grain.experimental

    from vitmm.data import workers as workers_lib
    from vitmm.data.pipeline import collate

    def sequence(ex, rng):
        seq = to_sequence(pp_fn(ex, rng), num_visual, mrope_grid)
        if len(seq["tokens"]) > length or len(seq["images"]) > max_images:
            raise ValueError(f"An example of {len(seq['tokens'])} positions and {len(seq['images'])} images does not "
                             f"fit a row of input.sequences.length={length} and max_images={max_images}: raise them "
                             f"(each image is {num_visual} positions) or lower model.max_len.")
        seq["_truncated"] = ex.get("_truncated", 0)
        return seq

    ds = grain.MapDataset.source(source)[process_index::process_count].shuffle(seed=seed).repeat(num_epochs)
    read = grain.ReadOptions(num_threads=1, prefetch_buffer_size=8)
    if skip_bad is None:
        ds = ds.random_map(sequence, seed=seed).map(_without_meta).to_iter_dataset(read)
    else:  # bad examples counted and skipped one at a time, before packing
        ds = workers_lib.SkippingBatchesDataset(ds.random_map(skips.guard(sequence), seed=seed).to_iter_dataset(read),
                                                1, _single, skip_bad, min(1000, len(source) // process_count))
    keys = SEQUENCE_KEYS + (("mrope",) if mrope_grid is not None else ())
    ds = grain.experimental.FirstFitPackIterDataset(
        ds, length_struct={**{k: length for k in keys}, "images": max_images},
        num_packing_bins=bins if pack else 1, shuffle_bins=False, max_sequences_per_bin=None if pack else 1)

    def to_row(row: dict) -> dict:
        out = {k: row[k] for k in SEQUENCE_KEYS}
        out["segment_ids"] = row["tokens_segment_ids"].astype(np.int32)
        out["positions"] = row["tokens_positions"].astype(np.int32)
        out["visual"] = row_visual(row["visual"], out["segment_ids"], row["images_segment_ids"], num_visual)
        out["images"] = row["images"]
        if mrope_grid is not None:
            out["mrope"] = row["mrope"].astype(np.int32)
        return out

    ds = ds.map(to_row).batch(rows, drop_remainder=True, batch_fn=collate)
    return workers_lib.in_workers(ds, workers, 2)


def one_row(seq: dict, length: int, max_images: int) -> dict:
    """A sequence alone in a row of ``length`` positions and ``max_images`` image slots (what the
    packer makes of it with ``pack=False``): fixed shapes, for evaluation batches and prompts."""
    n, k = len(seq["tokens"]), len(seq["images"])
    if n > length or k > max_images:
        raise ValueError(f"An example of {n} positions and {k} images does not fit a row of input.sequences.length="
                         f"{length} and max_images={max_images}.")
    row = {key: np.pad(seq[key], (0, length - n), constant_values=-1 if key == "visual" else 0)
           for key in SEQUENCE_KEYS if key in seq}
    if "mrope" in seq:
        row["mrope"] = np.pad(seq["mrope"], ((0, length - n), (0, 0))).astype(np.int32)
    row["segment_ids"] = (np.arange(length) < n).astype(np.int32)
    row["positions"] = np.where(row["segment_ids"] > 0, np.arange(length), 0).astype(np.int32)
    row["images"] = np.zeros((max_images, *seq["images"].shape[1:]), seq["images"].dtype)
    row["images"][:k] = seq["images"]
    return row


def _without_meta(seq: dict) -> dict:
    return {k: seq[k] for k in (*SEQUENCE_KEYS, "images", "mrope") if k in seq}


def _single(examples: list) -> dict:
    (example,) = examples
    return example


def padding_share(batch: dict) -> float:
    """The share of a batch's positions that hold no example."""
    return float(np.mean(np.asarray(batch["segment_ids"]) == 0))
