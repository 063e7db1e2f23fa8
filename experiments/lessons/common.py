"""What the lessons' experiments share (``experiments/lessons/``): labelled scenes made in
process, a small ViT classifier trained with the library's optimizer and update step, and its
evaluation.

Images come from ``vitmm.data.scenes.generate`` (a pure function of difficulty, resolution, split
and index): no dataset build, any resolution. The single-shape images of a difficulty carry two
labels: ``shape`` (which of its shapes: position-free) and ``region`` (where: the 3×3 or 2×2
cell it sits in, which needs positions).
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from vitmm import losses
from vitmm.data import scenes
from vitmm.models.vit import ViT
from vitmm.study import outputs, store
from vitmm.train import optim
from vitmm.train import step as step_lib

TASKS = ("shape", "region")


def single_shape_set(difficulty: str, resolution: int, split: str, n: int) -> dict:
    """The first ``n`` single-shape scenes of ``split``: ``images`` uint8 ``[n, R, R, 3]``,
    ``shape``, ``region`` and ``color`` labels (indices into the difficulty's shapes, into
    ``scenes.REGIONS`` and into its colours), and ``num_classes`` per label."""
    diff = scenes.DIFFICULTIES[difficulty]
    images, shape, region, color, index = [], [], [], [], 0
    while len(images) < n:
        ex = scenes.generate(difficulty, resolution, index, split)
        index += 1
        if ex["label"] < 0:
            continue
        images.append(ex["image"])
        shape.append(ex["label"])
        region.append(scenes.REGIONS.index(ex["objects"]["region"][0]))
        color.append(diff.colors.index(ex["objects"]["color"][0]))
    return {"images": np.stack(images), "shape": np.asarray(shape, np.int32), "region": np.asarray(region, np.int32),
            "color": np.asarray(color, np.int32),
            "num_classes": {"shape": len(diff.shapes), "region": len(scenes.REGIONS), "color": len(diff.colors)}}


def to_input(images: np.ndarray) -> jnp.ndarray:
    """uint8 images to the towers' ``[-1, 1]`` range."""
    return jnp.asarray(images, jnp.float32) / 127.5 - 1.0


def adamw_config(lr: float, steps: int, warmup: int, weight_decay: float = 0.05) -> ml_collections.ConfigDict:
    """The library's AdamW (``vitmm.train.optim.config``) with PyTorch's and timm's b2 and eps
    (0.999, 1e-8), which the lessons' classifiers trained from scratch were tuned with."""
    return optim.config(lr=lr, warmup_steps=warmup, total_steps=steps, weight_decay=weight_decay, b2=0.999, eps=1e-8)


class Classifier:
    """A ViT classifier's compiled training step (AdamW, warmup + cosine over ``steps``) and
    forward, built once and shared by every seed."""

    def __init__(self, model: ViT, steps: int, lr: float, image_shape: tuple, warmup: int | None = None):
        self.model, self.steps = model, steps
        self._init = jax.jit(lambda key: model.init(key, jnp.zeros((1, *image_shape), jnp.float32))["params"])
        shapes = jax.eval_shape(self._init, jax.random.key(0))
        warmup = max(steps // 10, 1) if warmup is None else warmup
        self.tx, _ = optim.make_optimizer(adamw_config(lr, steps, warmup), shapes)

        def loss_fn(p, x, y):
            logits, _ = model.apply({"params": p}, x)
            return losses.token_nll(logits, y).mean()  # softmax cross-entropy per image

        self._step = jax.jit(step_lib.update_step(loss_fn, self.tx), donate_argnums=(0, 1))
        self.logits = jax.jit(lambda p, x: model.apply({"params": p}, x)[0])
        self.patch_tokens = jax.jit(lambda p, x: model.apply({"params": p}, x)[1]["patch_tokens"])

    def train(self, images: np.ndarray, labels: np.ndarray, batch_size: int, seed: int) -> tuple[dict, list[float]]:
        """``steps`` steps of ``batch_size`` examples in a seeded order (epochs without
        replacement); ``(params, loss per step)``."""
        params = self._init(jax.random.key(seed))
        opt_state, rng, history = self.tx.init(params), np.random.default_rng(seed), []
        order = np.zeros(0, np.int64)
        for _ in range(self.steps):
            if len(order) < batch_size:
                order = np.concatenate([order, rng.permutation(len(images))])
            index, order = order[:batch_size], order[batch_size:]
            params, opt_state, loss = self._step(params, opt_state, to_input(images[index]), jnp.asarray(labels[index]))
            history.append(float(loss))
            if not math.isfinite(history[-1]):
                raise FloatingPointError(f"loss became {history[-1]} at step {len(history)} (seed {seed}).")
        return params, history

    def accuracy(self, params: dict, images: np.ndarray, labels: np.ndarray, batch_size: int = 250) -> float:
        hits = [np.asarray(jnp.argmax(self.logits(params, to_input(images[i:i + batch_size])), -1))
                == labels[i:i + batch_size] for i in range(0, len(images), batch_size)]
        return float(np.concatenate(hits).mean())


# ------------------------------------------------------------------------------------ sweeps
def parse_args(description: str, out: str, presets: dict, argv=None, extra=()) -> tuple:
    """The options every lessons' script takes (``--out``, ``--seeds``, ``--workers``,
    ``--smoke``, and ``extra``: ``(name, type)`` pairs overriding a preset key); ``(args, preset,
    seeds)`` with the chosen preset's values overridden by the options given."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", default=out)
    parser.add_argument("--seeds", default=None, help="comma-separated seeds (default: the preset's)")
    parser.add_argument("--workers", type=int, default=None, help="single-core worker processes")
    for name, kind in extra:
        parser.add_argument(f"--{name}", type=kind, default=None, help="default: the preset's")
    parser.add_argument("--smoke", action="store_true", help="a tiny run of every cell (the tests run it)")
    parser.add_argument("--report", action="store_true", help="train nothing: the report again from the finished "
                        "run's CSV files and setup.json in --out")
    args = parser.parse_args(argv)
    preset = dict(presets["smoke" if args.smoke else "default"])
    for key in ("seeds", "workers", *(name for name, _ in extra)):
        if getattr(args, key) is not None:
            preset[key] = getattr(args, key)
    return args, preset, [int(s) for s in str(preset["seeds"]).split(",")]








def rewrite(out: pathlib.Path, name: str, csvs: tuple[str, ...], render) -> pathlib.Path:
    """``--report``: ``NAME.md`` again from a finished run's ``csvs`` (read with numbers as numbers)
    and ``setup.json``, through ``render(*rows, setup)``: a report whose tests or wording changed, on
    the committed runs."""
    missing = [f for f in (*csvs, "setup.json") if not (out / f).is_file()]
    if missing:
        raise SystemExit(f"--report: {out} has no {', '.join(missing)}; a finished run writes them.")
    setup = json.loads((out / "setup.json").read_text())
    text = render(*(outputs.read_rows(out / f) for f in csvs), setup)
    (out / f"{name}.md").write_text(text)
    print(f"wrote {out / name}.md from {', '.join(csvs)} and setup.json")
    return out / f"{name}.md"


def linear_probe(x: np.ndarray, y: np.ndarray, test_x: np.ndarray, test_y: np.ndarray, num_classes: int,
                 fit_size: int, l2s=(1e-4, 1e-3, 1e-2, 1e-1), steps: int = 500) -> dict:
    """A softmax regression on frozen features: fitted (full batch, Adam) on ``x[:fit_size]``
    (standardised with their statistics) at each L2 strength, the one with the best accuracy on
    ``x[fit_size:]`` kept; its accuracy on the fitted features (separability) and on the test set."""
    import optax

    mean, std = x[:fit_size].mean(0), x[:fit_size].std(0) + 1e-6
    fx, fy = jnp.asarray((x[:fit_size] - mean) / std), jnp.asarray(y[:fit_size])
    vx, vy = (x[fit_size:] - mean) / std, y[fit_size:]
    tx = optax.adam(1e-2)

    def fit(l2):
        w = {"w": jnp.zeros((x.shape[1], num_classes)), "b": jnp.zeros(num_classes)}

        def loss(w):
            logits = fx @ w["w"] + w["b"]
            return losses.token_nll(logits, fy).mean() + l2 * jnp.sum(w["w"] ** 2)

        @jax.jit
        def run(w):
            def body(carry, _):
                w, state = carry
                updates, state = tx.update(jax.grad(loss)(w), state, w)
                return (optax.apply_updates(w, updates), state), None

            return jax.lax.scan(body, (w, tx.init(w)), None, length=steps)[0][0]

        return run(w)

    def acc(w, a, b):
        return float((np.argmax(np.asarray(a) @ np.asarray(w["w"]) + np.asarray(w["b"]), -1) == b).mean())

    best = max(((acc(w, vx, vy), -l2, l2, w) for l2 in l2s for w in [fit(l2)]), key=lambda t: t[:2])
    w = best[3]
    return {"train_accuracy": acc(w, fx, np.asarray(fy)), "val_accuracy": best[0], "l2": best[2],
            "accuracy": acc(w, (test_x - mean) / std, test_y)}


def train_per_seed(model, train: dict, test: dict, label: str, context: dict, progress) -> dict:
    """``{seed: {accuracy, final_loss, steps}}``: ``model`` trained on ``train[label]`` for
    ``context["epochs"]`` epochs per seed (one compiled ``Classifier``), scored on ``test``."""
    steps = context["epochs"] * len(train["images"]) // context["batch_size"]
    clf = Classifier(model, steps, context["lr"], train["images"].shape[1:])
    out = {}
    for seed in context["seeds"]:
        params, history = clf.train(train["images"], train[label], context["batch_size"], seed)
        out[seed] = {"accuracy": clf.accuracy(params, test["images"], test[label]),
                     "final_loss": float(np.mean(history[-10:])), "steps": steps}
        progress.update(1)
    return out


def run_cells(out: pathlib.Path, settings: dict, keys: list, fn, arrays: dict, context: dict, n_workers: int,
              desc: str, runs_per_key: int) -> dict:
    """``{key: {seed: result}}``: the cells ``out/cells.jsonl`` holds for these settings, and the
    rest computed now (``vitmm.study.store.run_cells``) and appended as each finishes."""
    return store.run_cells(out / "cells.jsonl", store.signature(settings), keys, fn, arrays, context, n_workers,
                           desc, runs_per_key)
