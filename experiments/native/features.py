"""The features of the native-resolution study (``tokens.py``): each scene's tower features along one path (square
resize, NaFlex, AnyRes) at one token budget, laid out in the LM's order and left-padded."""

from __future__ import annotations

import math
import os
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.common import qa_features
from vitmm.data import packing as data_packing
from vitmm.data import preprocess
from vitmm.models import anyres
from vitmm.models.vit import ViT
from vitmm.study import store

PATHS = ("square", "naflex", "anyres")


def anyres_settings(budget: int, patch: int) -> dict:
    """AnyRes at a budget of ``4·k²`` tokens: tiles of ``k × k`` patches, candidate resolutions of
    two or three tiles in a row or a column."""
    tile = patch * math.isqrt(budget // 4)
    return dict(tile=tile, pinpoints=[(tile, 2 * tile), (2 * tile, tile), (tile, 3 * tile), (3 * tile, tile)])


def check_budget(budget: int) -> None:
    k = math.isqrt(budget // 4)
    if budget < 4 or 4 * k * k != budget:
        raise SystemExit(f"--budgets: {budget} is not 4·k² (e.g. 16, 36, 64): the square path needs a square "
                         "grid of M patches and AnyRes tiles of M/4.")


def _tower_fn(tower: ViT):
    return jax.jit(lambda p, x: tower.apply({"params": p}, x)[1]["patch_tokens"])


def encode(fn, params, images: list[np.ndarray], batch: int = 256) -> list[np.ndarray]:
    """Patch tokens ``[h·w, C]`` of each image (float ``[H, W, 3]``); images of one size share
    batches, padded to a power of two so that few shapes compile."""
    out: list = [None] * len(images)
    by_size: dict = {}
    for i, image in enumerate(images):
        by_size.setdefault(image.shape, []).append(i)
    for indices in by_size.values():
        for start in range(0, len(indices), batch):
            chunk = indices[start:start + batch]
            x = np.stack([images[i] for i in chunk])
            x = np.concatenate([x, np.zeros((2 ** math.ceil(math.log2(len(x))) - len(x), *x.shape[1:]), x.dtype)])
            feats = np.asarray(fn(params, jnp.asarray(x)))
            for i, f in zip(chunk, feats, strict=False):
                out[i] = f
    return out


def path_features(path: str, budget: int, fn, params, images: list[np.ndarray], patch: int) -> list[tuple]:
    """``(features [n, C], newline [n])`` per image (uint8 ``[H, W, 3]``) along ``path`` at
    ``budget``: the tokens the LM reads, in its order (newline slots zero, flagged)."""
    rng = np.random.default_rng(0)  # the ops used here draw nothing
    if path in ("square", "naflex"):
        resize = f"resize({patch * math.isqrt(budget)})" if path == "square" else f"naflex({budget}, {patch})"
        pp = preprocess.parse(f"{resize}|value_range(-1, 1)")
        feats = encode(fn, params, [pp({"image": im}, rng)["image"] for im in images])
        return [(f, np.zeros(len(f), bool)) for f in feats]
    settings = anyres_settings(budget, patch)
    views = [anyres_views(im, settings) for im in images]
    flat = encode(fn, params, [v for vs in views for v in vs])
    out, start = [], 0
    for im, vs in zip(images, views, strict=True):
        out.append(anyres_layout(np.stack(flat[start:start + len(vs)]), im.shape[:2], settings))
        start += len(vs)
    return out


def anyres_views(image: np.ndarray, settings: dict) -> np.ndarray:
    """``[1 + rows·cols, tile, tile, 3]`` in [-1, 1]: the base view and the tiles of the image's
    best candidate resolution, made by the library's ``anyres`` op (PIL resizes, as the other
    paths' ops resize; black padding, as LLaVA-NeXT's processor pads), without its padding views."""
    tile = settings["tile"]
    views = preprocess.parse(f"anyres({settings['pinpoints']}, {tile})|value_range(-1, 1)")({"image": image}, None)
    rows, cols = anyres.plan(image.shape[:2], settings["pinpoints"], tile)["tiles"]
    return views["image"][:1 + rows * cols]


def anyres_layout(tiles: np.ndarray, image_hw, settings: dict) -> tuple[np.ndarray, np.ndarray]:
    """``(features [n, C], newline [n])`` from each view's patch tokens ``[1 + rows·cols, g·g, C]``:
    ``anyres.assemble``'s order, zero features in the newline slots."""
    n, g, d = len(tiles), math.isqrt(tiles.shape[1]), tiles.shape[-1]
    laid = anyres.assemble(jnp.asarray(tiles.reshape(1, n, g, g, d)), image_hw, settings["pinpoints"],
                           settings["tile"], jnp.zeros(d))[0]
    flags = anyres.assemble(jnp.zeros((1, n, g, g, 1)), image_hw, settings["pinpoints"], settings["tile"],
                            jnp.ones(1))[0, :, 0]
    return np.asarray(laid), np.asarray(flags) > 0


def left_pad(items: list[tuple], length: int) -> dict:
    """``patches [I, length, C]``, ``newline`` and ``visual_mask [I, length]``: each image's tokens
    at the end (``VLM(visual_mask=…)``), zeros before them."""
    d = items[0][0].shape[-1]
    patches = np.zeros((len(items), length, d), np.float32)
    newline, mask = np.zeros((len(items), length), bool), np.zeros((len(items), length), bool)
    for i, (f, flags) in enumerate(items):
        patches[i, length - len(f):], newline[i, length - len(f):], mask[i, length - len(f):] = f, flags, True
    return dict(patches=patches, newline=newline, visual_mask=mask)


def make_splits(args, tower: ViT, params, cache: pathlib.Path | None = None,
                tower_id: str = "") -> tuple[dict, object, int]:
    """Each split's questions (``qa_features.qa_arrays``), the subsets ``in_wide``/``in_squarish``,
    and per view ``@{path}{budget}`` the padded features; the tokenizer and ``max_len``.

    With ``cache`` (a folder) each view's features are kept there after they are encoded, named by
    the tower (``tower_id``, its parameters' fingerprint) and the data settings, and read back by a
    later sitting instead of encoding again (the default study's nine views took 20-40 minutes of a
    shared core at every restart)."""
    t0 = time.perf_counter()
    examples = {}
    for split, n in (("train", args.train_images), ("validation", args.val_images), ("test", args.test_images)):
        source = data_packing.SceneSource(args.difficulty, n, split, 0, min_side=args.min_side,
                                          max_side=args.max_side, max_aspect=args.max_aspect)
        examples[split] = [source[i] for i in range(n)]
    tokenizer, max_len = qa_features.tokenizer_for("words", examples["train"])
    fn, patch = _tower_fn(tower), tower.arch().patch_size[0]
    splits = {}
    for split, exs in examples.items():
        qa = qa_features.qa_arrays(exs, tokenizer, max_len)
        aspect = np.array([max(e["image"].shape[:2]) / min(e["image"].shape[:2]) for e in exs])
        qa["in_wide"], qa["in_squarish"] = aspect[qa["image"]] >= args.wide, aspect[qa["image"]] < 1.5
        qa["aspect"], qa["sizes"] = aspect, np.array([e["image"].shape[:2] for e in exs])
        splits[split] = qa
    data = [args.difficulty, args.train_images, args.val_images, args.test_images, args.min_side, args.max_side,
            args.max_aspect]
    for budget in args.budgets:
        for path in PATHS:
            file = cache and cache / f"{path}{budget}-{store.signature(dict(tower=tower_id, data=data, v=1))}.npz"
            if file and file.is_file():
                with np.load(file) as kept:
                    padded = {split: {k: kept[f"{split}/{k}"] for k in ("patches", "newline", "visual_mask")}
                              for split in examples}
            else:
                items = {s: path_features(path, budget, fn, params, [e["image"] for e in exs], patch)
                         for s, exs in examples.items()}
                length = max(len(f) for its in items.values() for f, _ in its)
                padded = {split: left_pad(its, length) for split, its in items.items()}
                if file:
                    _keep(file, padded)
            for split, arrays in padded.items():
                splits[split].update({f"{k}@{path}{budget}": v for k, v in arrays.items()})
    print(f"{len(examples['train'])} / {len(examples['validation'])} / {len(examples['test'])} images, "
          f"{len(splits['train']['ids'])} training questions, features for budgets {args.budgets} "
          f"({time.perf_counter() - t0:.0f} s)")
    return splits, tokenizer, max_len


def _keep(file: pathlib.Path, padded: dict) -> None:
    """``padded`` ({split: {name: array}}) in ``file``, whole or not at all (a temporary file renamed)."""
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_name(file.name + ".tmp.npz")
    np.savez(tmp, **{f"{split}/{k}": v for split, arrays in padded.items() for k, v in arrays.items()})
    os.replace(tmp, file)
