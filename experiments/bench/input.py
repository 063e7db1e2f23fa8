"""Input-pipeline benchmark: examples/s of the pretraining input vs. what a training step eats.

    python -m experiments.bench.input [--data scenes/easy_64] [--batch 256] [--repeats 5]

Measures, in one run:
  * the training input (scenes → grain → decode, flip, value range, tokenize, batch) in
    examples/s, median over repeats of ``--batches`` batches after a warm-up;
  * a jit-compiled AdamW training step of the image tower alone (ViT width 128, depth 4, patch 8,
    64×64 images: the tiny tower the CPU pretraining config uses) in examples/s, median over
    repeats. The real CLIP step also runs a text tower and a loss, so it consumes examples more
    slowly; but the two are timed one after the other, each with the machine to itself, where in
    training they share its cores: the ratio printed is an estimate of the headroom, not a bound.
The input must be at least 10× faster than the step so that it never limits training.
Results are written to ``results/bench_input/bench_input.{csv,md}``.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import pathlib
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from vitmm import xla_flags
from vitmm.data import pipeline, preprocess
from vitmm.models import vit
from vitmm.train import step as step_lib

DEFAULT_PP = ("decode|flip_lr|value_range(-1, 1)|tokenize('caption', 64)|"
              "keep('image', 'caption_tokens')")


def bench_input(args) -> list[float]:
    source = pipeline.get_source(args.data, "train", args.data_dir, keys=("image", "caption"))
    pp = preprocess.parse(args.pp)
    it = pipeline.train_iterator(source, pp, args.batch, seed=0, num_threads=args.threads)
    for _ in range(3):  # warm-up: threads started, first files opened
        next(it)
    rates = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        for _ in range(args.batches):
            next(it)
        rates.append(args.batches * args.batch / (time.perf_counter() - start))
    return rates


def bench_step(args, image_size: int) -> list[float]:
    model = vit.ViT(width=128, depth=4, mlp_dim=512, num_heads=4, patch_size=8, pool="gap",
                    class_token=False)
    images = jnp.asarray(np.random.default_rng(0).uniform(-1, 1, (args.batch, image_size, image_size, 3)),
                         jnp.float32)
    params = model.init(jax.random.key(0), images[:1])["params"]
    target = jax.random.normal(jax.random.key(1), (args.batch, 128))
    tx = optax.adamw(1e-3)
    opt_state = tx.init(params)

    def loss_fn(p, images):
        pooled, _ = model.apply({"params": p}, images, train=True)
        return jnp.mean((pooled - target) ** 2)

    step = jax.jit(step_lib.update_step(loss_fn, tx))

    params, opt_state, loss = step(params, opt_state, images)
    loss.block_until_ready()
    rates = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        for _ in range(args.steps):
            params, opt_state, loss = step(params, opt_state, images)
        loss.block_until_ready()
        rates.append(args.steps * args.batch / (time.perf_counter() - start))
    return rates


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="scenes/easy_64")
    parser.add_argument("--data_dir", default=None)
    parser.add_argument("--pp", default=DEFAULT_PP)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--batches", type=int, default=10)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    # Reading and decoding scenes is Python-bound (GIL): one worker thread is fastest
    # (results/bench_input/README.md).
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="results/bench_input")
    args = parser.parse_args(argv)

    image_size = int(pipeline.get_source(args.data, "train", args.data_dir)[0]["image"].shape[0])
    input_rates = bench_input(args)
    step_rates = bench_step(args, image_size)
    result = dict(
        date=datetime.date.today().isoformat(), machine=f"{platform.machine()}, {os.cpu_count()} cores",
        data=args.data, batch=args.batch,
        input_examples_per_s=statistics.median(input_rates),
        step_examples_per_s=statistics.median(step_rates),
    )
    result["headroom"] = result["input_examples_per_s"] / result["step_examples_per_s"]
    print(f"input pipeline ({args.data}, batch {args.batch}): {result['input_examples_per_s']:,.0f} "
          f"examples/s (median of {args.repeats}; runs {', '.join(f'{r:,.0f}' for r in input_rates)})")
    print(f"training step (image tower, AdamW): {result['step_examples_per_s']:,.0f} examples/s "
          f"(median of {args.repeats})")
    verdict = "OK" if result["headroom"] >= 10 else "TOO SLOW"
    print(f"headroom: input / step = {result['headroom']:.1f}x (target >= 10x): {verdict}")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "bench_input.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(result))
        writer.writeheader()
        writer.writerow(result)
    (out / "bench_input.md").write_text(
        "| date | machine | data | batch | input examples/s | step examples/s | headroom |\n"
        "|---|---|---|---:|---:|---:|---:|\n"
        f"| {result['date']} | {result['machine']} | {args.data} | {args.batch} | "
        f"{result['input_examples_per_s']:,.0f} | {result['step_examples_per_s']:,.0f} | "
        f"{result['headroom']:.1f}x |\n"
    )
    return result


if __name__ == "__main__":
    xla_flags.use_vitmm_defaults()  # before JAX opens a backend
    main()
