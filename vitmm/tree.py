"""Pytree helpers and the one report of how two parameter trees differ.

Parameter trees are nested dicts; ``flatten`` names each leaf by its ``/``-joined path
(``"encoder/block_00/attn/q/kernel"``), the names every report and ``dont_load`` regex uses.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from flax import traverse_util


def flatten(tree) -> dict:
    """``{"a/b/c": leaf}`` of a nested dict."""
    return {"/".join(str(k) for k in path): v for path, v in traverse_util.flatten_dict(tree).items()}


def unflatten(flat: dict) -> dict:
    return traverse_util.unflatten_dict({tuple(k.split("/")): v for k, v in flat.items()})


def shape(x) -> tuple:
    return tuple(getattr(x, "shape", ()))


def count(tree) -> int:
    """Number of scalars in a pytree (works on ``jax.eval_shape`` output too)."""
    return int(sum(x.size for x in jax.tree.leaves(tree)))


def mismatches(model, checkpoint, skip: Callable[[str], bool] = lambda name: False) -> list[str]:
    """One line per entry that does not fit, between the model's tree and a checkpoint's:
    ``missing in checkpoint``, ``unused from checkpoint`` (no place in the model) and
    ``shape mismatch``, each with its name and shape(s); names for which ``skip`` holds are left out."""
    want, have = flatten(model), flatten(checkpoint)
    lines = [f"  missing in checkpoint: {k} {shape(v)}" for k, v in want.items() if k not in have and not skip(k)]
    lines += [f"  unused from checkpoint: {k} {shape(v)}" for k, v in have.items() if k not in want and not skip(k)]
    lines += [f"  shape mismatch: {k}: model {shape(v)} vs checkpoint {shape(have[k])}"
              for k, v in want.items() if k in have and not skip(k) and shape(v) != shape(have[k])]
    return lines


def summarise(lines: list[str], limit: int = 20) -> str:
    """``lines`` of ``mismatches`` as they are if there are at most ``limit``; otherwise the
    counts per kind and top-level module, the first few lines, and the whole list in a file of the
    system's temporary folder (not the workdir: a refused run writes nothing there)."""
    if len(lines) <= limit:
        return "\n".join(lines)
    import collections
    import tempfile

    counts = collections.defaultdict(collections.Counter)
    for line in lines:
        kind, _, rest = line.strip().partition(": ")
        counts[kind][rest.split("/", 1)[0].split(" ", 1)[0].rstrip(":")] += 1
    with tempfile.NamedTemporaryFile("w", prefix="vitmm-mismatches-", suffix=".txt", delete=False) as f:
        f.write("\n".join(line.strip() for line in lines) + "\n")
    summary = [f"  {sum(c.values())} {kind} ({', '.join(f'{top} {n}' for top, n in c.most_common())})"
               for kind, c in counts.items()]
    shown = limit // 2
    return "\n".join([*summary, f"  the first {shown}:", *lines[:shown], f"  all {len(lines)} lines: {f.name}"])


def fitting(model, checkpoint) -> int:
    """How many of the model's entries the checkpoint has with the same name and shape."""
    want, have = flatten(model), flatten(checkpoint)
    return sum(1 for k, v in want.items() if k in have and shape(v) == shape(have[k]))
