"""What the lessons' experiments share (``experiments/lessons_*.py``): labelled scenes made in
process, a small ViT classifier trained with the library's optimizer and update step, and its
evaluation.

Images come from ``vitmm.data.scenes.generate`` (a pure function of difficulty, resolution, split
and index): no dataset build, any resolution. The single-shape images of a difficulty carry two
labels: ``shape`` (which of its shapes: position-free) and ``region`` (where: the 3×3 or 2×2
cell it sits in, which needs positions).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from vitmm import losses
from vitmm.data import scenes
from vitmm.models.vit import ViT
from vitmm.train import optim
from vitmm.train import step as step_lib

TASKS = ("shape", "region")


def single_shape_set(difficulty: str, resolution: int, split: str, n: int) -> dict:
    """The first ``n`` single-shape scenes of ``split``: ``images`` uint8 ``[n, R, R, 3]``,
    ``shape`` and ``region`` labels (indices into the difficulty's shapes and into
    ``scenes.REGIONS``), and ``num_classes`` per task."""
    diff = scenes.DIFFICULTIES[difficulty]
    images, shape, region, index = [], [], [], 0
    while len(images) < n:
        ex = scenes.generate(difficulty, resolution, index, split)
        index += 1
        if ex["label"] < 0:
            continue
        images.append(ex["image"])
        shape.append(ex["label"])
        region.append(scenes.REGIONS.index(ex["objects"]["region"][0]))
    return {"images": np.stack(images), "shape": np.asarray(shape, np.int32), "region": np.asarray(region, np.int32),
            "num_classes": {"shape": len(diff.shapes), "region": len(scenes.REGIONS)}}


def to_input(images: np.ndarray) -> jnp.ndarray:
    """uint8 images to the towers' ``[-1, 1]`` range."""
    return jnp.asarray(images, jnp.float32) / 127.5 - 1.0


def adamw_config(lr: float, steps: int, warmup: int, weight_decay: float = 0.05) -> ml_collections.ConfigDict:
    """The optimizer settings ``vitmm.train.optim.make_optimizer`` reads (warmup, cosine to 0)."""
    return ml_collections.ConfigDict(dict(lr=lr, total_steps=steps, warmup_steps=warmup, end_factor=0.0,
                                          weight_decay=weight_decay, b1=0.9, b2=0.999, eps=1e-8, clip_norm=1.0,
                                          freeze=()))


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
