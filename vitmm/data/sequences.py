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


def to_sequence(ex: dict, num_visual: int, mrope_grid: tuple[int, int] | None = None,
                tower: dict | None = None, anyres: dict | None = None) -> dict:
    """The flat sequence of one pp'd example (see the module docstring) and its ``images``
    ``[K, H, W, C]`` (``K = 0`` for a text-only example); with ``mrope_grid`` (an image's visual
    tokens as rows × columns), ``mrope [S, 3]``: Qwen2-VL's 3D positions (``mrope_positions``).

    ``tower`` (``patch``, ``class_token``, ``num_registers``: the tower's; ``merge``: a connector's
    fixed ``k``): images at their own sizes, each its own number of visual tokens (one a patch for
    a token-wise connector, one a ``k × k`` window for a merging one), given to the tower packed:
    ``tower_patches``, ``tower_kinds``, ``tower_positions`` (its tokens, as
    ``models.packing.image_tokens`` lays them out, image after image, windows together when
    merging), ``tower_image`` (each token's image, from 1) and ``grids [K, 2]`` instead of
    ``images``; ``visual`` then indexes the example's tower tokens (merged ones when merging).

    ``anyres`` (``pinpoints``, ``tile``, ``tile_grid``: the VLM's and its connector's grid on a tile):
    each image at its own size becomes its AnyRes views (``images`` holds them, ``num_visual``
    tokens a view), its visual positions ``models.anyres.layout``'s, ``NEWLINE`` for its newlines;
    ``method`` (resampling) and ``affine`` (the pp's final normalize) as ``_anyres_layout`` says."""
    answer = np.asarray(ex["answer_mask"])
    answered = np.flatnonzero(answer)
    if not len(answered):
        raise skips.BadExample("too_long", "no answer token is left to train on")
    images, spans, visuals = _visual_layout(ex, num_visual, tower, anyres)
    tokens, visual, text_at = _interleave(ex, int(answered[-1]) + 1, spans)
    is_text = text_at >= 0
    weight_here = np.where(is_text, answer[np.maximum(text_at, 0)], 0).astype(np.float32)
    targets = np.zeros_like(tokens)
    weights = np.zeros(len(tokens), np.float32)
    targets[:-1] = np.where(is_text[1:], tokens[1:], 0)
    weights[:-1] = weight_here[1:]
    first_answer = int(np.flatnonzero(weight_here)[0])
    out = {"tokens": tokens, "visual": visual, "targets": targets, "weights": weights,
           "prefix": np.arange(len(tokens)) < first_answer, **visuals}
    if mrope_grid is not None:
        grids = [tuple(g // tower.get("merge", 1)) for g in visuals["grids"]] if tower is not None else \
            [tuple(mrope_grid)] * len(images)
        out["mrope"] = mrope_positions(visual, grids, int(ex.get("video_frames", 0))).T
    return out


def prompt_sequence(ex: dict, num_visual: int, mrope_grid: tuple[int, int] | None = None,
                    tower: dict | None = None, anyres: dict | None = None) -> dict:
    """A prompt's sequence (its first ``prompt_len`` text tokens and the images among them):
    ``tokens``, ``visual`` and ``images`` or the tower's fields (and ``mrope [S, 3]``), as
    ``to_sequence`` makes them: what ``VLM.prefill_sequences`` takes."""
    images, spans, visuals = _visual_layout(ex, num_visual, tower, anyres)
    tokens, visual, _ = _interleave(ex, int(ex["prompt_len"]), spans)
    out = {"tokens": tokens, "visual": visual, **visuals}
    if mrope_grid is not None:
        grids = [tuple(g // tower.get("merge", 1)) for g in visuals["grids"]] if tower is not None else \
            [tuple(mrope_grid)] * len(images)
        out["mrope"] = mrope_positions(visual, grids, int(ex.get("video_frames", 0))).T
    return out


TOWER_KEYS = ("tower_patches", "tower_kinds", "tower_positions", "tower_image")


NEWLINE = -2  # a ``visual`` entry that is AnyRes's learned newline token


def _visual_layout(ex: dict, num_visual: int, tower: dict | None, anyres: dict | None = None):
    """The example's images, each one's visual indices, and the arrays that carry them: ``images``
    (square, ``num_visual`` tokens each; with ``anyres``, each image's views, ``num_visual`` tokens
    a view, laid out by ``models.anyres.layout`` with ``NEWLINE``s) or the tower's packed tokens
    (``tower``)."""
    has_image = bool(ex.get("has_image", True))
    images = [ex["image"], *ex.get("more_images", [])] if has_image else []
    first = np.asarray(ex["image"])
    if anyres is not None:
        return _anyres_layout(images, first, num_visual, anyres)
    if tower is None:
        stacked = np.stack(images) if images else np.zeros((0, *first.shape), first.dtype)
        return images, [np.arange(k * num_visual, (k + 1) * num_visual) for k in range(len(images))], \
            {"images": stacked}
    from vitmm.models import packing

    k = tower.get("merge", 1)
    cut = [_window_order(packing.image_tokens(im, tower["patch"], class_token=tower.get("class_token", False),
                                              num_registers=tower.get("num_registers", 0)), k) for im in images]
    spans, start = [], 0
    for t in cut:
        n = int(np.prod(t["grid"]))
        spans.append(np.arange((start + len(t["kinds"]) - n) // k**2, (start + len(t["kinds"])) // k**2))
        start += len(t["kinds"])
    size = int(np.prod(packing.to_pair(tower["patch"]))) * first.shape[-1]
    cat = lambda key, shape, dtype: np.concatenate([t[key] for t in cut]) if cut else np.zeros(shape, dtype)  # noqa: E731
    return images, spans, {
        "tower_patches": cat("patches", (0, size), np.float32), "tower_kinds": cat("kinds", (0,), np.int32),
        "tower_positions": cat("positions", (0, 2), np.int32),
        "tower_image": np.concatenate([np.full(len(t["kinds"]), k + 1, np.int32) for k, t in enumerate(cut)])
        if cut else np.zeros((0,), np.int32),
        "grids": np.stack([t["grid"] for t in cut]) if cut else np.zeros((0, 2), np.int32)}


def _anyres_layout(images: list, first: np.ndarray, num_visual: int, anyres: dict):
    """AnyRes (``models.anyres``) at each image's own size: its views as square images, and the
    layout of their tokens (``num_visual`` a view) with a newline ending each row. The views are
    cut from uint8 images, padded black and resampled with ``anyres['method']`` (bilinear unless
    set) as the ``anyres`` op does; ``anyres['affine']`` (``scale, offset``, the pp's final
    normalize, ``SequenceLayout.split_affine``) is applied to them afterwards."""
    from vitmm.data.ops_image import anyres_views
    from vitmm.models import anyres as anyres_lib

    tile, grid = anyres["tile"], tuple(anyres["tile_grid"])
    pinpoints = anyres_lib.check_pinpoints(anyres["pinpoints"], tile)
    method, affine = anyres.get("method", "bilinear"), anyres.get("affine")
    views, spans = [], []
    for image in images:
        image = np.asarray(image)
        if image.dtype != np.uint8:
            raise ValueError(f"AnyRes views of a {image.dtype} image: input.sequences cuts them from uint8 images "
                             "before the pp's final normalize/value_range; drop image ops after it.")
        index = anyres_lib.layout(image.shape[:2], pinpoints, tile, grid)
        spans.append(np.where(index == anyres_lib.NEWLINE, NEWLINE, len(views) * num_visual + index))
        views.extend(anyres_views(image, pinpoints, tile, method))
    stacked = np.stack(views) if views else np.zeros((0, tile, tile, first.shape[-1]), np.uint8)
    if affine is not None:
        stacked = stacked.astype(np.float32) * affine[0] + affine[1]
    return images, spans, {"images": stacked}


def _window_order(tokens: dict, k: int) -> dict:
    """An image's tokens with its patches in merge-window order for a connector merging ``k × k``
    neighbours (``merge=k``): each window's ``k²`` patches consecutive (row-major inside it),
    windows in raster order, as Qwen2-VL's processor lays them out; their grid positions travel
    with them, so the tower sees the same image. No prefix tokens then (they would break the
    windows' alignment)."""
    if k == 1:
        return tokens
    h, w = (int(v) for v in tokens["grid"])
    if h % k or w % k or len(tokens["kinds"]) != h * w:
        raise ValueError(f"An image of {h}×{w} patches{' with prefix tokens' if len(tokens['kinds']) != h * w else ''} "
                         f"cannot be merged {k}×{k} in packed rows: resize to multiples of {k} patches (e.g. "
                         f"naflex(N, patch · {k}) with N/{k * k} windows) with a tower without CLS or registers.")
    order = np.arange(h * w).reshape(h // k, k, w // k, k).transpose(0, 2, 1, 3).reshape(-1)
    return {**tokens, "patches": tokens["patches"][order], "positions": tokens["positions"][order],
            "kinds": tokens["kinds"][order]}


def _interleave(ex: dict, end: int, spans: list):
    """The text tokens ``ids[:end]`` with image ``k``'s visual indices ``spans[k]`` (an array)
    where it goes: ``(tokens, visual, text index of each position (-1 on visual ones))``."""
    ids = np.asarray(ex["ids"])
    places = ex.get("image_positions")
    name = f"Example {ex['_id']}" if "_id" in ex else "An example"
    if places is None and len(spans) > 1:  # stacking them all where the one place is would be silent
        raise ValueError(f"{name} has {len(spans)} images but its text places one (image_pos): each image needs its "
                         "own <image> place (image_positions), as conversation_tokens writes them. Give several "
                         "images to conversation_tokens (qa_tokens places one), and keep image_positions and "
                         "more_images (keep(..., optional=('more_images', 'image_positions'))).")
    places = [int(p) for p in places] if places is not None else [int(ex.get("image_pos", 1))] * len(spans)
    if len(places) != len(spans):
        raise ValueError(f"{name} has {len(places)} image places (image_positions) for {len(spans)} images: an op "
                         "after conversation_tokens changed the images, or the chat template writes <image> tags of "
                         "its own; one <image> an image (after any op that splits or merges images).")
    if places != sorted(places) or any(not 0 <= p <= end for p in places):
        raise ValueError(f"to_sequence: image positions {places} are not ascending within the {end} text tokens.")
    text_at, visual = [], []
    cursor = 0
    for k, place in enumerate(places + [end]):
        text_at += range(cursor, place)
        visual += [-1] * (place - cursor)
        cursor = place
        if k < len(places):
            text_at += [-1] * len(spans[k])
            visual += [int(v) for v in spans[k]]
    text_at, visual = np.asarray(text_at, np.int64), np.asarray(visual, np.int32)
    tokens = np.where(text_at >= 0, ids[np.maximum(text_at, 0)], 0).astype(np.int32)
    return tokens, visual, text_at


def mrope_positions(visual: np.ndarray, grids, video_frames: int = 0) -> np.ndarray:
    """Qwen2-VL's 3D positions ``[3, S]`` of one sequence (``get_rope_index``): a text token at
    ``(p, p, p)`` and the next at ``p + 1``; an image of ``rows × cols`` tokens from ``p`` at
    ``(p, p + i, p + j)`` and a video of ``t`` frames (its temporal patches, consecutive images
    when ``video_frames`` is ``t``) at ``(p + τ, p + i, p + j)``, the text after either at
    ``p + max(t, rows, cols)``. ``grids``: each image's ``(rows, cols)`` in order (one pair: all
    the same).

    A video's ``t · rows · cols`` visual tokens must follow each other, as in Qwen2-VL, whose
    processor puts a video in one ``<|vision_start|>…<|vision_end|>`` (``conversation_tokens`` wraps
    a video once for that). Text between its temporal patches (each wrapped on its own, e.g. by an
    example's ``image_texts``) has no place in Qwen2-VL's scheme: the video's τ positions would run
    past the text between them, so that is a ``ValueError`` rather than made-up positions."""
    grids = [tuple(grids)] * len(visual) if np.ndim(grids) == 1 else [tuple(g) for g in grids]
    out = np.zeros((3, len(visual)), np.int64)
    current, k, image = 0, 0, 0
    while k < len(visual):
        if visual[k] < 0:
            out[:, k] = current
            current, k = current + 1, k + 1
            continue
        rows, cols = grids[image]
        t, m = video_frames or 1, rows * cols
        if t > 1 and not (k + t * m <= len(visual) and np.all(visual[k:k + t * m] >= 0)):
            raise ValueError(f"mrope_positions: a video of video_frames={t} temporal patches of {rows}x{cols} tokens "
                             f"needs its {t * m} visual tokens together (Qwen2-VL's one <|vision_start|>..."
                             "<|vision_end|>), but text sits between them: an image_text or image_texts that wraps "
                             "each <image> splits them; let conversation_tokens wrap the video once (no image_texts "
                             "for a video).")
        tau, ij = np.divmod(np.arange(t * m), m)
        out[:, k:k + t * m] = current + np.stack([tau, ij // cols, ij % cols])
        current, k, image = current + max(t, rows, cols), k + t * m, image + t
    return out


def row_visual(visual: np.ndarray, segments: np.ndarray, image_segments: np.ndarray, num_visual: int) -> np.ndarray:
    """Each example's ``visual`` (its own image numbers) as the row's: image ``k`` of the example in
    segment ``s`` is the row's slot ``first(s) + k``, ``first(s)`` the first slot ``image_segments``
    gives ``s`` (the packer lays a row's images out in segment order)."""
    real = image_segments[image_segments > 0]
    first = np.searchsorted(real, segments)
    row = np.where((visual >= 0) & (segments > 0), first * num_visual + visual, -1)
    return np.where((visual == NEWLINE) & (segments > 0), NEWLINE, row).astype(np.int32)


def packed_batches(source, pp_fn, *, num_visual: int, length: int, max_images: int, rows: int, pack: bool = True,
                   bins: int = 8, seed: int = 0, num_epochs: int | None = None, process_index: int = 0,
                   process_count: int = 1, skip_bad: float | None = None, workers: int = 0,
                   mrope_grid: tuple[int, int] | None = None, tower: dict | None = None,
                   tower_length: int = 0, anyres: dict | None = None):
    """Batches of ``rows`` rows (``SEQUENCE_KEYS``, ``segment_ids``, ``positions`` ``[rows, length]``;
    ``images [rows, max_images, H, W, C]``) from ``source`` through ``pp_fn`` and ``to_sequence``;
    each process reads its own slice. ``skip_bad`` (raw data): bad examples are skipped and counted
    as ``skips.SkippingBatches`` does (its counts in the state). ``get_state``/``set_state`` resume
    the stream exactly (grain's packer keeps its open rows in the state). ``mrope_grid``: rows carry
    ``mrope [rows, length, 3]`` too (``mrope_positions``, restarting at each example). ``tower``:
    images at their own sizes (``to_sequence``), each row's tower tokens packed into
    ``tower_length`` (``tower_*`` ``[rows, tower_length, …]``, ``tower_segments`` each token's image
    in the row, ``grids [rows, max_images, 2]``: a ``models.packing.Packed`` batch) instead of
    ``images``. ``anyres``: each image's AnyRes views in the slots (``to_sequence``)."""
    import grain
    import grain.experimental

    from vitmm.data import workers as workers_lib
    from vitmm.data.pipeline import collate, process_seed

    def sequence(ex, rng):
        out = pp_fn(ex, rng)
        seq = to_sequence(out, num_visual, mrope_grid, tower, anyres)
        n = len(seq["grids" if tower else "images"])
        if len(seq["tokens"]) > length or n > max_images or len(seq.get("tower_kinds", ())) > tower_length:
            message = (f"An example of {len(seq['tokens'])} positions and {n} images does not fit a row of "
                       f"input.sequences.length={length} and max_images={max_images}"
                       + (f" (tower_length={tower_length}; it has {len(seq['tower_kinds'])} tower tokens)"
                          if tower else f" (each image is {num_visual} positions)")
                       + ": raise them or lower model.max_len.")
            if skip_bad is not None:  # raw data: one such example is skipped and counted, not the run's end
                raise skips.BadExample("too_long_for_row", message)
            raise ValueError(message)
        seq["_truncated"] = out.get("_truncated", 0)  # the pp's count (it copies the example)
        return seq

    auto, workers = workers == -1, workers_lib.resolve(workers, threads_per_worker=1)
    seed = process_seed(seed, process_index)
    ds = grain.MapDataset.source(source)[process_index::process_count].shuffle(seed=seed).repeat(num_epochs)
    read = grain.ReadOptions(num_threads=1, prefetch_buffer_size=8)
    if skip_bad is None:
        ds = ds.random_map(sequence, seed=seed).map(_without_meta).to_iter_dataset(read)
    else:  # bad examples counted and skipped one at a time, before packing
        ds = workers_lib.SkippingBatchesDataset(ds.random_map(skips.guard(sequence), seed=seed).to_iter_dataset(read),
                                                1, _single, skip_bad, min(1000, len(source) // process_count))
    keys = SEQUENCE_KEYS + (("mrope",) if mrope_grid is not None else ())
    visual_struct = {**{k: tower_length for k in TOWER_KEYS}, "grids": max_images} if tower else {"images": max_images}
    ds = grain.experimental.FirstFitPackIterDataset(
        ds, length_struct={**{k: length for k in keys}, **visual_struct},
        num_packing_bins=bins if pack else 1, shuffle_bins=False, max_sequences_per_bin=None if pack else 1)

    def to_row(row: dict) -> dict:
        out = {k: row[k] for k in SEQUENCE_KEYS}
        out["segment_ids"] = row["tokens_segment_ids"].astype(np.int32)
        out["positions"] = row["tokens_positions"].astype(np.int32)
        if tower:
            out.update(_tower_row(row, out["segment_ids"], tower.get("merge", 1)))
        else:
            out["visual"] = row_visual(row["visual"], out["segment_ids"], row["images_segment_ids"], num_visual)
            out["images"] = row["images"]
        if mrope_grid is not None:
            out["mrope"] = row["mrope"].astype(np.int32)
        return out

    ds = ds.map(to_row).batch(rows, drop_remainder=True, batch_fn=collate)
    return workers_lib.in_workers(ds, workers, 2, auto)


def _tower_row(row: dict, segments: np.ndarray, merge: int = 1) -> dict:
    """A packed row's tower fields: each tower token's image numbered within the row (the slot
    after those of the earlier examples), and ``visual`` as indices into the row's tower tokens
    (merged ``merge × merge`` at a time)."""
    token_examples = row["tower_kinds_segment_ids"]
    first_slot = np.searchsorted(row["grids_segment_ids"][row["grids_segment_ids"] > 0], token_examples)
    starts = np.searchsorted(token_examples[token_examples > 0], segments)  # each example's first tower token
    return {"tower_patches": row["tower_patches"], "tower_kinds": row["tower_kinds"],
            "tower_positions": row["tower_positions"], "grids": row["grids"],
            "tower_segments": np.where(token_examples > 0, first_slot + row["tower_image"], 0).astype(np.int32),
            "visual": np.where((row["visual"] >= 0) & (segments > 0), starts // merge**2 + row["visual"],
                               -1).astype(np.int32)}


def tower_batch(batch: dict):
    """The ``models.packing.Packed`` batch of a packed rows' tower fields."""
    from vitmm.models import packing

    grids = batch["grids"]
    return packing.Packed(patches=batch["tower_patches"], segment_ids=batch["tower_segments"],
                          kinds=batch["tower_kinds"], positions=batch["tower_positions"], grids=grids,
                          image_ids=grids[..., 0] * 0 - 1)


class RowOverflow(ValueError):
    """A sequence longer than a row (``one_row``)."""


def one_row(seq: dict, length: int, max_images: int, tower_length: int = 0) -> dict:
    """A sequence alone in a row of ``length`` positions and ``max_images`` image slots (what the
    packer makes of it with ``pack=False``; images at their own sizes: ``tower_length`` tower
    tokens): fixed shapes, for evaluation batches and prompts."""
    n, k = len(seq["tokens"]), len(seq["grids" if "grids" in seq else "images"])
    if n > length or k > max_images or len(seq.get("tower_kinds", ())) > tower_length * ("grids" in seq):
        raise RowOverflow(f"An example of {n} positions and {k} images does not fit a row of input.sequences.length="
                          f"{length} and max_images={max_images}"
                          + (f", tower_length={tower_length}" if "grids" in seq else "") + ".")
    row = {key: np.pad(seq[key], (0, length - n), constant_values=-1 if key == "visual" else 0)
           for key in SEQUENCE_KEYS if key in seq}
    if "mrope" in seq:
        row["mrope"] = np.pad(seq["mrope"], ((0, length - n), (0, 0))).astype(np.int32)
    row["segment_ids"] = (np.arange(length) < n).astype(np.int32)
    row["positions"] = np.where(row["segment_ids"] > 0, np.arange(length), 0).astype(np.int32)
    if "grids" in seq:  # the tower's tokens, one image after another
        t = len(seq["tower_kinds"])
        for key in TOWER_KEYS:
            row[key] = np.zeros((tower_length, *seq[key].shape[1:]), seq[key].dtype)
            row[key][:t] = seq[key]
        row["tower_segments"] = row.pop("tower_image")
        row["grids"] = np.zeros((max_images, 2), np.int32)
        row["grids"][:k] = seq["grids"]
        return row
    row["images"] = np.zeros((max_images, *seq["images"].shape[1:]), seq["images"].dtype)
    row["images"][:k] = seq["images"]
    return row


def _without_meta(seq: dict) -> dict:
    return {k: seq[k] for k in (*SEQUENCE_KEYS, "images", "mrope", *TOWER_KEYS, "grids") if k in seq}


def _single(examples: list) -> dict:
    (example,) = examples
    return example


def padding_share(batch: dict) -> float:
    """The share of a batch's positions that hold no example."""
    return float(np.mean(np.asarray(batch["segment_ids"]) == 0))
