"""How the token-budget sweep chooses each family's learning rate and warmup: the best on
validation (the mean over the tuning seeds) in a grid that grows past an edge while the edge wins.
A family is tuned once, at one token count, or at every budget on its own (``--tune_each_budget``):
the tuning results are keyed ``(family, tokens, lr, warmup)`` either way, and a choice is kept under
``family`` or ``family@tokens`` (``label``; ``rate`` finds a run's)."""

from __future__ import annotations

import math

import numpy as np


def label(family: str, tokens: int, each_budget: bool) -> str:
    """The key of a choice: ``family``, or ``family@tokens`` when every budget is tuned on its own."""
    return f"{family}@{tokens}" if each_budget else family


def rate(chosen: dict, family: str, tokens: int) -> tuple:
    """The ``(lr, warmup)`` a run of ``family`` at ``tokens`` uses: the family's choice, or the one
    tuned at these tokens (at the nearest tuned count, e.g. for an encoder-side row)."""
    if family in chosen:
        return tuple(chosen[family])
    tuned = {int(k.rsplit("@", 1)[1]): v for k, v in chosen.items() if k.rsplit("@", 1)[0] == family}
    if not tuned:
        raise KeyError(f"no learning rate chosen for {family}")
    return tuple(tuned[min(tuned, key=lambda t: (abs(math.log(t / tokens)), t))])


def choose(tuned: dict, each_budget: bool = False) -> dict:
    """``{label: (lr, warmup)}`` with the best validation accuracy (the mean over the tuning seeds)
    in the tuning grid of each family (or each family and token count; ``label``); ties: the smaller
    lr, then the shorter warmup."""
    best = {}
    for (family, tokens, lr, warmup), results in tuned.items():
        unit = label(family, tokens, each_budget)
        acc = np.mean([r["accuracy"] for r in results.values()])
        if unit not in best or (acc, -lr, -warmup) > (best[unit][1], -best[unit][0][0], -best[unit][0][1]):
            best[unit] = ((lr, warmup), acc)
    return {unit: setting for unit, (setting, _) in best.items()}


def next_rate(lr: float, up: bool) -> float:
    """The next rate on the 1-3-10 ladder (…, 1e-4, 3e-4, 1e-3, …) above or below ``lr``."""
    ladder = [m * 10.0 ** e for e in range(math.floor(math.log10(lr)) - 1, math.floor(math.log10(lr)) + 2)
              for m in (1, 3)]
    return float(f"{(min(x for x in ladder if x > lr * 1.01) if up else max(x for x in ladder if x < lr / 1.01)):.3g}")


def extend_grid(tuned: dict, lrs: dict, base: list, max_extra: int, min_gain: float) -> dict:
    """``{(family, tokens): next lr}`` for each tuned point whose best rate sits at an edge of its grid
    ``lrs[(family, tokens)]`` and beats its neighbour there by at least ``min_gain``: the grid continues
    one step past that edge on the 1-3-10 ladder, at most ``max_extra`` rates beyond ``base`` on each
    side. A flat edge (blind, whose rate hardly matters) is not extended."""
    out = {}
    for unit, grid in lrs.items():
        acc = {lr: np.mean([r["accuracy"] for r in res.values()]) for (f, t, lr, _), res in tuned.items()
               if (f, t) == unit and lr in grid}
        if len(acc) < 2:
            continue
        ordered = sorted(acc)
        best = max(ordered, key=lambda lr: (acc[lr], -lr))
        for edge, neighbour, up, beyond in ((ordered[0], ordered[1], False, sum(x < min(base) for x in grid)),
                                            (ordered[-1], ordered[-2], True, sum(x > max(base) for x in grid))):
            if best == edge and acc[edge] >= acc[neighbour] + min_gain and beyond < max_extra:
                out[unit] = next_rate(edge, up)
    return out
