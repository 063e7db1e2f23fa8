"""The optimizer from config: AdamW, warmup + cosine, clipping, weight-decay mask, freezing,
gradient accumulation. Per-parameter rules are regexes over ``/``-joined parameter paths."""

from __future__ import annotations

import re
from collections.abc import Sequence

import jax
import ml_collections
import optax
from flax import traverse_util

# No weight decay on biases, norm scales (every "scale" in vitmm is a LayerNorm's or an RMSNorm's,
# whatever the norm is called: norm1, ln_q, ...), temperature/bias, positions, CLS/registers, MAP probe,
# and the connectors' learned tokens of the same kinds: Perceiver latents, Q-Former queries, Qwen's
# resampler query, C-Abstractor's position table, the VLM's image_newline. Those match a whole leaf
# name, so a layer that happens to be called ``query`` keeps its ``query/kernel`` decayed.
NO_DECAY = (r".*/bias$", r"(.*/)?scale$", r"^t$", r"^b$", r".*pos_embedding$", r".*/cls$",
            r"^cls$", r".*registers$", r".*/probe$", r".*/ls[12]$",
            r"(.*/)?(latents|queries|query|pos_emb|image_newline)$")


def path_names(params) -> dict:
    """``{"img/encoder/block_00/attn/qkv/kernel": leaf, ...}`` for a nested parameter dict."""
    return {"/".join(k): v for k, v in traverse_util.flatten_dict(params).items()}


def regex_mask(params, patterns: Sequence[str]):
    """A pytree of bools like ``params``: True where the path fully matches any pattern."""
    compiled = [re.compile(p) for p in patterns]
    flat = traverse_util.flatten_dict(params)
    mask = {k: any(c.fullmatch("/".join(k)) for c in compiled) for k in flat}
    return traverse_util.unflatten_dict(mask)


def config(*, lr: float, warmup_steps: int, weight_decay: float = 0.0, end_factor: float = 0.0, b1: float = 0.9,
           b2: float = 0.98, eps: float = 1e-6, clip_norm: float = 1.0, freeze=(), lr_mult=(),
           **more) -> ml_collections.ConfigDict:
    """The settings ``make_optimizer`` reads, with vitmm's defaults: AdamW with CLIP's b1/b2/eps
    (0.9, 0.98, 1e-6), gradients clipped at global norm 1, a linear warmup then a cosine decay to
    ``end_factor``·lr at ``total_steps`` (in ``more``, or set by the trainer from the run's length).
    Every caller builds its optimizer settings here: configs, studies and tests."""
    return ml_collections.ConfigDict(dict(lr=lr, warmup_steps=warmup_steps, end_factor=end_factor,
                                          weight_decay=weight_decay, b1=b1, b2=b2, eps=eps, clip_norm=clip_norm,
                                          freeze=tuple(freeze), lr_mult=tuple(tuple(x) for x in lr_mult), **more))


def schedule(cfg) -> optax.Schedule:
    """Linear warmup from 0 to ``cfg.lr`` over ``warmup_steps``, then cosine decay to
    ``lr * end_factor`` at ``total_steps``."""
    warmup = min(cfg.warmup_steps, max(cfg.total_steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        0.0, cfg.lr, warmup, max(cfg.total_steps, warmup + 1), cfg.lr * cfg.get("end_factor", 0.0)
    )


def make_optimizer(cfg, params) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """``cfg``: lr, total_steps, warmup_steps, weight_decay, b1, b2, eps, clip_norm, freeze
    (regexes of parameters that never change). Gradient accumulation lives in the train step
    (micro-batches summed before one update), so schedules count updates."""
    lr = schedule(cfg)
    decay = jax.tree.map(lambda no: not no, regex_mask(params, NO_DECAY))
    tx = optax.chain(
        optax.clip_by_global_norm(cfg.clip_norm) if cfg.get("clip_norm") else optax.identity(),
        optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay, mask=decay),
        *lr_multipliers(cfg, params),
    )
    trainable = trainable_mask(cfg, params)
    if trainable is not None:
        labels = jax.tree.map(lambda t: "train" if t else "frozen", trainable)
        tx = optax.multi_transform({"train": tx, "frozen": optax.set_to_zero()}, labels)
    return tx, lr


def lr_multipliers(cfg, params) -> list[optax.GradientTransformation]:
    """``cfg.lr_mult`` (``((regex, factor), ...)``): the matching parameters' updates, decay
    included, scaled by ``factor`` (LLaVA-1.5's LoRA recipe: the projector at a tenth of the LM's rate)."""
    out = []
    for pattern, factor in tuple(cfg.get("lr_mult") or ()):
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor < 0:
            raise ValueError(f"optim.lr_mult[{pattern!r}]={factor!r}: must be a number >= 0.")
        mask = regex_mask(params, (pattern,))
        if not any(jax.tree.leaves(mask)):
            raise ValueError(f"optim.lr_mult pattern {pattern!r} matches no parameter; paths look like "
                             f"{sorted(path_names(params))[:4]}.")
        out.append(optax.masked(optax.scale(float(factor)), mask))
    return out


def trainable_mask(cfg, params):
    """Booleans like ``params``, False where a ``cfg.freeze`` regex matches (those never change);
    ``None`` when nothing is frozen."""
    freeze = tuple(cfg.get("freeze", ()) or ())
    if not freeze:
        return None
    frozen = regex_mask(params, freeze)
    if not any(jax.tree.leaves(frozen)):
        raise ValueError(f"freeze={freeze} matches no parameter; paths look like "
                         f"{sorted(path_names(params))[:4]}.")
    return jax.tree.map(lambda f: not f, frozen)
