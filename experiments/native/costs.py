"""What images at their own sizes cost: packed NaFlex batches against padded squares, and FLIP.

    python -m experiments.native.costs                  # about 5 minutes on a 2-core CPU
    python -m experiments.native.costs --smoke --out /tmp/nc

1. **Packing vs padded squares** at one patch budget (``--budget`` patches of ``--patch`` px, the
   demo tower's 64 px / 8 px = 64): scenes at random sizes and aspect ratios
   (``data.packing.SceneSource``) either letterboxed to the budget's square (``letterbox``: every
   image 64 tokens, the bars padding) or resized by NaFlex to fit the budget and packed, by grain's
   first-fit, into rows of ``--seq_len`` tokens (``--bins`` open rows). Reported: the share of
   the encoder's tokens that carry no image (padding tokens; for squares, patches wholly inside
   the bars, and the share of padded pixels), images per token, the input pipeline's images/s
   and the encoder forward's images/s (the demo's image tower, ``jit``, the batch sizes giving
   about the same tokens per batch), medians over ``--repeats`` rounds in which both take turns.
2. **FLIP** (``ViT.patch_keep``): the CLIP demo's training step (both towers, softmax loss,
   AdamW; ``configs/clip_scenes.py``) with ``patch_keep`` 1, 0.5 and 0.25, taking turns; the
   speed-up is each setting's median step time over the full one's.

Writes ``native_costs.md``, ``packing.csv``, ``flip.csv`` and ``setup.json`` to ``--out``
(default ``results/native/``).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from vitmm import losses, xla_flags
from vitmm.data import packing as data_packing
from vitmm.data import preprocess
from vitmm.data.pipeline import collate
from vitmm.models import packing, two_towers
from vitmm.models.vit import ViT
from vitmm.study import outputs
from vitmm.train.step import update_step

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _tower_config() -> dict:
    from configs import clip_scenes

    return clip_scenes.get_config().model.to_dict()


def _median_range(times) -> tuple[float, float, float]:
    t = np.asarray(times)
    return float(np.median(t)), float(t.min()), float(t.max())


def packing_vs_squares(args) -> list[dict]:
    side = int(round(args.budget ** 0.5)) * args.patch
    source = data_packing.SceneSource("medium", args.examples, min_side=32, max_side=160, max_aspect=3.0)
    model = ViT(**_tower_config()["image"])
    square_pp = preprocess.parse(f"letterbox({side})|value_range(-1, 1)")
    flex_pp = preprocess.parse(f"naflex({args.budget}, {args.patch})|value_range(-1, 1)")
    square_batch = args.seq_len * args.rows // args.budget  # about the same tokens per batch

    def square_batches():
        for start in range(0, args.examples - square_batch + 1, square_batch):
            yield collate([square_pp(dict(source[i]), None) for i in range(start, start + square_batch)])

    def packed_batches():
        it = data_packing.packed_iterator(source, flex_pp, patch_size=args.patch, seq_len=args.seq_len,
                                          max_images=args.max_images, rows=args.rows, num_bins=args.bins,
                                          class_token=model.class_token, num_epochs=1)
        for b in it:
            yield packing.Packed(**{k: b[k] for k in ("patches", "segment_ids", "kinds", "positions", "grids",
                                                       "image_ids")})

    params = model.init(jax.random.key(0), jnp.zeros((1, side, side, 3)))["params"]
    forward = jax.jit(lambda p, x: model.apply({"params": p}, x)[0])
    stats = {}
    for name, make in (("padded square", square_batches), ("NaFlex + packing", packed_batches)):
        start = time.perf_counter()
        batches = list(make())
        host_s = time.perf_counter() - start
        if name == "padded square":
            images = sum(len(b["image"]) for b in batches)
            tokens = images * args.budget
            valid = np.concatenate([b["image_valid"] for b in batches])
            pixels = 1 - valid.prod(-1).sum() / (images * side * side)
            live = sum(int(np.ceil(h / args.patch) * np.ceil(w / args.patch)) for h, w in valid)
            pad_tokens = 1 - live / tokens
            content = live / images
            arrays = [jnp.asarray(b["image"]) for b in batches]
        else:
            images = sum(int((np.asarray(b.image_ids) >= 0).sum()) for b in batches)
            tokens = sum(b.segment_ids.size for b in batches)
            pad_tokens = float(np.mean([b.padding_fraction() for b in batches]))
            pixels = float("nan")
            content = sum(int((np.asarray(b.kinds)[np.asarray(b.segment_ids) > 0] == packing.PATCH).sum())
                          for b in batches) / images
            arrays = [jax.tree.map(jnp.asarray, b) for b in batches]
        stats[name] = dict(layout=name, images=images, batches=len(batches),
                           tokens_per_batch=tokens // len(batches), padding_tokens=pad_tokens,
                           padding_pixels=pixels, image_tokens_per_image=content,
                           images_per_1k_tokens=1000 * images / tokens,
                           pipeline_images_per_s=images / host_s, arrays=arrays)
        jax.block_until_ready(forward(params, arrays[0]))  # compile
    times = {name: [] for name in stats}
    for _ in range(args.repeats):
        for name, s in stats.items():
            start = time.perf_counter()
            for x in s["arrays"]:
                jax.block_until_ready(forward(params, x))
            times[name].append(time.perf_counter() - start)
    rows = []
    for name, s in stats.items():
        med, lo, hi = _median_range(times[name])
        s.pop("arrays")
        rows.append({**s, "encoder_images_per_s": s["images"] / med, "encoder_images_per_s_range":
                     f"{s['images'] / hi:.0f}–{s['images'] / lo:.0f}"})
    return rows


def flip(args) -> list[dict]:
    cfg = _tower_config()
    rng = np.random.default_rng(0)
    images = jnp.asarray(rng.normal(size=(args.flip_batch, 64, 64, 3)), jnp.float32)
    ids = jnp.asarray(rng.integers(1, 259, size=(args.flip_batch, cfg["text"]["max_len"])), jnp.int32)
    tx = optax.adamw(1e-3, weight_decay=0.1)
    steps = {}
    for keep in args.keeps:
        model = two_towers.TwoTowers(**{**cfg, "image": {**cfg["image"], "patch_keep": keep}})
        params = model.init(jax.random.key(0), images[:1], ids[:1])["params"]

        def loss_fn(p, x, t, key, model=model):
            zi, zt, out = model.apply({"params": p}, x, t, train=True, rngs={"dropout": key})
            return losses.softmax_loss(zi, zt, out["t"])

        step = jax.jit(update_step(loss_fn, tx))
        state = [params, tx.init(params)]
        jax.block_until_ready(step(*state, images, ids, jax.random.key(1)))
        steps[keep] = (step, state)
    times = {keep: [] for keep in args.keeps}
    for r in range(args.repeats):
        for keep, (step, state) in steps.items():
            start = time.perf_counter()
            for i in range(args.flip_steps):
                state[0], state[1], loss = step(*state, images, ids, jax.random.key(100 * r + i))
            jax.block_until_ready(loss)
            times[keep].append((time.perf_counter() - start) / args.flip_steps)
    full = np.asarray(times[1.0]) if 1.0 in times else None
    rows = []
    for keep in args.keeps:
        med, lo, hi = _median_range(times[keep])
        ratio = np.asarray(times[keep]) / full if full is not None else np.full(args.repeats, np.nan)
        tokens = max(1, round(keep * 64))
        rows.append(dict(patch_keep=keep, image_tokens=tokens, step_ms=1000 * med,
                         step_ms_range=f"{1000 * lo:.0f}–{1000 * hi:.0f}", speedup=float(1 / np.median(ratio)),
                         speedup_range=f"{1 / ratio.max():.2f}–{1 / ratio.min():.2f}"))
    return rows


def to_markdown(pack_rows, flip_rows, setup) -> str:
    lines = ["# What images at their own sizes cost", "",
             f"{setup['date']}, {setup['backend']} ({setup['devices']}), `{setup['command']}`.", "",
             f"## Packing vs padded squares (budget {setup['budget']} patches of {setup['patch']} px; "
             f"{setup['examples']} scenes at random sizes, sides 32–160 px, aspect ≤ 3)", "",
             "| layout | tokens/batch | padding tokens | padding pixels | image tokens per image "
             "| images per 1k tokens | pipeline img/s | encoder img/s (median, range) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in pack_rows:
        pix = "—" if np.isnan(r["padding_pixels"]) else f"{r['padding_pixels']:.1%}"
        lines.append(f"| {r['layout']} | {r['tokens_per_batch']} | {r['padding_tokens']:.1%} | {pix} | "
                     f"{r['image_tokens_per_image']:.1f} | "
                     f"{r['images_per_1k_tokens']:.1f} | {r['pipeline_images_per_s']:.0f} | "
                     f"{r['encoder_images_per_s']:.0f} ({r['encoder_images_per_s_range']}) |")
    lines += ["", f"Packed rows: {setup['seq_len']} tokens, at most {setup['max_images']} images, "
              f"{setup['bins']} open bins. Padding pixels: the share of a padded square's pixels outside the "
              "image. Image tokens per image: the patches that show some of the image. Encoder: the demo's "
              f"image tower forward (no packing-aware kernel: a row's attention spans all its {setup['seq_len']} "
              f"tokens, masked), medians over {setup['repeats']} rounds taking turns.", "",
              f"## FLIP: the CLIP demo's training step (batch {setup['flip_batch']}, 64 px, patch 8)", "",
              "| patch_keep | image tokens | step ms (median, range) | speed-up (median, range) |", "|---|---|---|---|"]
    for r in flip_rows:
        lines.append(f"| {r['patch_keep']} | {r['image_tokens']} | {r['step_ms']:.0f} ({r['step_ms_range']}) | "
                     f"{r['speedup']:.2f}× ({r['speedup_range']}) |")
    lines += ["", f"Step times: {setup['flip_steps']} steps per round, {setup['repeats']} rounds taking turns; the "
              "speed-up is the median of the rounds' ratios to patch_keep 1 (the text tower is unchanged)."]
    return "\n".join(lines) + "\n"




def main(argv=None) -> pathlib.Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(ROOT / "results/native"))
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--budget", type=int, default=64)
    parser.add_argument("--patch", type=int, default=8)
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--max_images", type=int, default=16)
    parser.add_argument("--bins", type=int, default=8)
    parser.add_argument("--examples", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--flip_batch", type=int, default=128)
    parser.add_argument("--flip_steps", type=int, default=5)
    parser.add_argument("--keeps", default="1.0,0.5,0.25")
    args = parser.parse_args(argv)
    if args.smoke:
        args.examples, args.repeats, args.flip_batch, args.flip_steps, args.rows = 64, 2, 8, 1, 2
    args.keeps = [float(k) for k in args.keeps.split(",")]
    xla_flags.use_vitmm_defaults()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    setup = dict(vars(args), date=time.strftime("%Y-%m-%d"), backend=jax.default_backend(),
                 devices=str(jax.devices()[0].device_kind), command=outputs.command())
    pack_rows = packing_vs_squares(args)
    flip_rows = flip(args)
    outputs.write_rows(pack_rows, out / "packing.csv")
    outputs.write_rows(flip_rows, out / "flip.csv")
    (out / "setup.json").write_text(json.dumps(setup, indent=1) + "\n")
    (out / "native_costs.md").write_text(to_markdown(pack_rows, flip_rows, setup))
    print((out / "native_costs.md").read_text())
    return out


if __name__ == "__main__":
    main()
