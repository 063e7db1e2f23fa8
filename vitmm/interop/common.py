"""What every loader shares: a state dict that tracks what it used, PyTorch-to-Flax layouts, and
the final check of a converted tree against the model's own."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np

from vitmm import tree

IGNORED = re.compile(r".*(position_ids|attn_mask)$")  # buffers some checkpoints carry


class StateDict:
    """A checkpoint's tensors with bookkeeping: what was used, what is missing."""

    def __init__(self, tensors: dict[str, np.ndarray], source: str):
        self.tensors, self.source = tensors, source
        self.used: set[str] = set()
        self.missing: list[str] = []

    def has(self, key: str) -> bool:
        return key in self.tensors

    def take(self, key: str) -> np.ndarray:
        if key not in self.tensors:
            self.missing.append(key)
            return np.zeros((0,), np.float32)
        self.used.add(key)
        return np.asarray(self.tensors[key], np.float32)

    def unused(self) -> list[str]:
        return sorted(k for k in self.tensors if k not in self.used and not IGNORED.fullmatch(k))


def linear(sd: StateDict, prefix: str, bias: bool = True) -> dict:
    out = {"kernel": sd.take(prefix + ".weight").T}
    if bias:
        out["bias"] = sd.take(prefix + ".bias")
    return out


def norm(sd: StateDict, prefix: str) -> dict:
    return {"scale": sd.take(prefix + ".weight"), "bias": sd.take(prefix + ".bias")}


def finish(sd: StateDict, module, params: dict, example_args: tuple, what: str) -> dict:
    """Checks the converted tree against the model's own and the checkpoint's leftovers."""
    expected = jax.eval_shape(module.init, jax.random.key(0), *example_args)["params"]
    lines = [f"  missing in checkpoint: {k}" for k in sd.missing]
    lines += [f"  unused from checkpoint: {k} {tree.shape(sd.tensors[k])}" for k in sd.unused()]
    if not sd.missing:
        lines += tree.mismatches(expected, params)
    if lines:
        raise ValueError(f"Cannot load {sd.source} as {what}:\n" + "\n".join(lines))
    return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)


def resize(params: dict, kwargs: dict, image_size) -> dict:
    """Resamples a converted tower's learned position table for ``image_size`` (an int for a
    square image or ``(height, width)``), the way its source does (``kwargs["posemb_resample"]``)."""
    from vitmm.models.patch_embed import to_pair
    from vitmm.models.vit_tools import resize_posemb

    size = to_pair(image_size, "image_size")
    patch = to_pair(kwargs["patch_size"], "patch_size")
    if size[0] % patch[0] or size[1] % patch[1]:
        raise ValueError(f"image_size={size[0]}x{size[1]} is not a multiple of the patch size "
                         f"{patch[0]}x{patch[1]}; pick a size that the patches tile.")
    grid = (size[0] // patch[0], size[1] // patch[1])
    return resize_posemb(params, grid, kwargs.get("posemb_resample", "bicubic_aa"))


def grid_table(flat: np.ndarray, what: str, grid: tuple[int, int] | None = None) -> np.ndarray:
    """A flat ``[h·w, D]`` position table as vitmm's ``[1, h, w, D]``: row-major over ``grid``, or
    square when the grid is not known."""
    if grid is not None:
        return flat.reshape(1, *grid, flat.shape[-1])
    side = int(round(flat.shape[0] ** 0.5))
    if side * side != flat.shape[0]:
        raise ValueError(f"{what} has {flat.shape[0]} patch rows, not a square grid; resample it to a square "
                         "grid first or build the ViT with the grid given explicitly.")
    return flat.reshape(1, side, side, flat.shape[-1])


def standard_heads(width: int, depth: int, mlp_dim: int, src, option: str = "num_heads") -> int:
    """The head count of a ViT tower whose checkpoint does not record it (a wrong one loads without a
    shape error and computes another function): that of vitmm's ``VARIANTS`` entry with this width,
    depth and MLP size; else ``width // 64`` where every variant of this width has 64-wide heads;
    else a ``ValueError`` asking for ``option`` (ViT-H, g, G and So400m use 16 heads, not width / 64)."""
    from vitmm.models.vit import VARIANTS

    for w, d, m, heads in VARIANTS.values():
        if (w, d, m) == (width, depth, mlp_dim):
            return heads
    known = {name: heads for name, (w, _, _, heads) in VARIANTS.items() if w == width}
    if known and set(known.values()) == {width // 64}:
        return width // 64
    if known:
        seen = ", ".join(f"ViT-{name} {heads} heads" for name, heads in known.items())
        why = f"towers of width {width} have other head counts than width / 64 = {width // 64} ({seen})"
    else:
        why = f"vitmm knows no standard tower of width {width}"
    raise ValueError(f"{src}: the head count is not in the weights and {why}, with depth {depth} and MLP size "
                     f"{mlp_dim} matching none of vitmm's VARIANTS; pass {option} (the model's own config says it).")


def conv_kernel(weight: np.ndarray) -> np.ndarray:
    """PyTorch conv ``[D, C, ph, pw]`` → vitmm patch kernel ``[ph, pw, C, D]``."""
    return weight.transpose(2, 3, 1, 0)


TOWERS = ("both", "vision", "text")


def vision_only(kwargs: dict, img: dict) -> tuple[dict, dict]:
    """``(TwoTowers kwargs, params)`` of an image tower alone (no text tower, no projections)."""
    return {"image": kwargs, "text": None, "embed_dim": None}, {"img": img}


def text_only(kwargs: dict, txt: dict) -> tuple[dict, dict]:
    return {"image": None, "text": kwargs, "embed_dim": None}, {"txt": txt}


def pick_tower(model: dict, params: dict, tower: str, src) -> tuple[dict, dict]:
    """The ``vision`` or ``text`` half of a two-tower ``(model, params)``; ``both`` as is."""
    if tower not in TOWERS:
        raise ValueError(f"tower must be one of {TOWERS}, got {tower!r}.")
    if tower != "both" and model["image" if tower == "vision" else "text"] is None:
        raise ValueError(f"{src} has no {tower} tower.")
    if tower == "vision":
        return vision_only(model["image"], params["img"])
    if tower == "text":
        return text_only(model["text"], params["txt"])
    return model, params
