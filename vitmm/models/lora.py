"""LoRA (Hu et al. 2021): low-rank adapters on chosen dense layers, outside the model's own tree.

    adapters = lora.init(params, targets=(r".*attn/(q|v)$",), rank=8, key=key)
    logits = lora.apply(model, params, adapters, alpha=16, ids)          # y = xW + (α/r)·drop(x)AB
    merged = lora.merge(params, adapters, alpha=16)                        # W + (α/r)·AB, same outputs

``targets`` are regexes matched against a dense layer's path (``language/block_00/attn/q``);
each matching 2-D ``kernel [in, out]`` gets ``a [in, r]`` (uniform on ±1/√in: PEFT's default,
``kaiming_uniform_(a=√5)``, which LLaVA's LoRA runs use; the paper's normal draw with std 1/r is
PEFT's ``init_lora_weights="gaussian"``, ~5× larger at rank 8 on a 576-wide LM) and ``b [r, out]``
(zeros, so the adapted model starts as the base one). The
adapters live in their own tree (``{"language.block_00.attn.q": {"a", "b"}}``: dotted, so the
tree can sit in a checkpoint beside the parameters), so an optimizer can train them alone
and a checkpoint can hold them apart; ``apply`` adds the low-rank branch through flax's method
interception, which is where LoRA's input dropout goes; ``merge`` folds them into the kernels
for export or inference (equal outputs, tested).
"""

from __future__ import annotations

import re

import flax.linen as nn
import jax
import jax.numpy as jnp

from vitmm import tree


def init(params: dict, targets, rank: int, key) -> dict:
    """Adapters for every 2-D kernel whose layer path fully matches one of ``targets``; a target that
    matches a stacked kernel (``scan=True``'s ``[depth, in, out]``) is refused rather than skipped."""
    if rank < 1:
        raise ValueError(f"LoRA rank must be a positive integer, got {rank}.")
    patterns = [re.compile(t) for t in targets]
    adapters, stacked = {}, []
    for i, (name, leaf) in enumerate(sorted(tree.flatten(params).items())):
        layer, _, leaf_name = name.rpartition("/")
        if leaf_name != "kernel" or not any(p.fullmatch(layer) for p in patterns):
            continue
        if getattr(leaf, "ndim", 0) != 2:  # e.g. a scan=True tower's [depth, in, out] kernels
            stacked.append(layer)
            continue
        fan_in, fan_out = leaf.shape
        bound = fan_in ** -0.5
        a = jax.random.uniform(jax.random.fold_in(key, i), (fan_in, rank), jnp.float32, -bound, bound)
        adapters[layer.replace("/", ".")] = {"a": a, "b": jnp.zeros((rank, fan_out), jnp.float32)}
    if stacked:
        raise ValueError(f"The LoRA targets {list(targets)} match stacked kernels, one per layer of a scanned stack "
                         f"({stacked[:3]}): LoRA adapts 2-D kernels; build that model with scan=False, or leave it "
                         "out of the targets.")
    if not adapters:
        raise ValueError(f"No dense layer matches the LoRA targets {list(targets)}; layer paths look like "
                         f"{sorted({n.rpartition('/')[0] for n in tree.flatten(params)})[:4]}.")
    return adapters


def _scale(adapters: dict, alpha: float) -> float:
    rank = next(iter(adapters.values()))["a"].shape[1]
    return alpha / rank


def merge(params: dict, adapters: dict, alpha: float) -> dict:
    """``params`` with each adapted kernel replaced by ``W + (α/r)·A·B``."""
    scale = _scale(adapters, alpha)
    flat = dict(tree.flatten(params))
    for layer, ab in adapters.items():
        name = f"{layer.replace('.', '/')}/kernel"
        flat[name] = (flat[name] + scale * ab["a"] @ ab["b"]).astype(flat[name].dtype)
    return tree.unflatten(flat)


def apply(model: nn.Module, params: dict, adapters: dict, alpha: float, *args, dropout: float = 0.0, rng=None,
          **kwargs):
    """``model.apply({"params": params}, *args, **kwargs)`` with the low-rank branch added to
    every adapted dense layer: ``y = xW + (α/r)·dropout(x)·A·B`` (dropout needs ``rng``)."""
    scale = _scale(adapters, alpha)
    if dropout and rng is None:
        raise ValueError("LoRA dropout needs an rng.")
    counter, inside = [0], set()

    def interceptor(next_fun, call_args, call_kwargs, context):
        if context.method_name != "__call__" or not isinstance(context.module, nn.Dense):
            return next_fun(*call_args, **call_kwargs)
        layer = ".".join(context.module.path)
        if layer in inside:  # a Dense's __call__ calling its parent's (vitmm's Dense off CPU): the branch once
            return next_fun(*call_args, **call_kwargs)
        inside.add(layer)
        try:
            out = next_fun(*call_args, **call_kwargs)
        finally:
            inside.discard(layer)
        ab = adapters.get(layer)
        if ab is None:
            return out
        x = call_args[0]
        if dropout:
            counter[0] += 1
            keep = jax.random.bernoulli(jax.random.fold_in(rng, counter[0]), 1.0 - dropout, x.shape)
            x = jnp.where(keep, x / (1.0 - dropout), 0.0)
        return out + (scale * (x @ ab["a"]) @ ab["b"]).astype(out.dtype)

    with nn.intercept_methods(interceptor):
        return model.apply({"params": params}, *args, **kwargs)
