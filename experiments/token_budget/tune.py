"""How the token-budget sweep chooses each family's learning rate and warmup: the best on
validation in a grid that grows past an edge while the edge wins."""

from __future__ import annotations

import math

import numpy as np


def choose(tuned: dict) -> dict:
    """``{family: (lr, warmup)}`` with the best validation accuracy in the tuning grid (ties: the
    smaller lr, then the shorter warmup)."""
    best = {}
    for (family, _, lr, warmup), results in tuned.items():
        acc = np.mean([r["accuracy"] for r in results.values()])
        if family not in best or (acc, -lr, -warmup) > (best[family][1], -best[family][0][0], -best[family][0][1]):
            best[family] = ((lr, warmup), acc)
    return {family: setting for family, (setting, _) in best.items()}


def next_rate(lr: float, up: bool) -> float:
    """The next rate on the 1-3-10 ladder (…, 1e-4, 3e-4, 1e-3, …) above or below ``lr``."""
    ladder = [m * 10.0 ** e for e in range(math.floor(math.log10(lr)) - 1, math.floor(math.log10(lr)) + 2)
              for m in (1, 3)]
    return float(f"{(min(x for x in ladder if x > lr * 1.01) if up else max(x for x in ladder if x < lr / 1.01)):.3g}")


def extend_grid(tuned: dict, lrs: dict, base: list, max_extra: int, min_gain: float) -> dict:
    """``{family: next lr}`` for each family whose best rate sits at an edge of its grid ``lrs[family]``
    and beats its neighbour there by at least ``min_gain``: the grid continues one step past that
    edge on the 1-3-10 ladder, at most ``max_extra`` rates beyond ``base`` on each side. A flat
    edge (blind, whose rate hardly matters) is not extended."""
    out = {}
    for family, grid in lrs.items():
        acc = {lr: np.mean([r["accuracy"] for r in res.values()]) for (f, _, lr, _), res in tuned.items()
               if f == family and lr in grid}
        if len(acc) < 2:
            continue
        ordered = sorted(acc)
        best = max(ordered, key=lambda lr: (acc[lr], -lr))
        for edge, neighbour, up, beyond in ((ordered[0], ordered[1], False, sum(x < min(base) for x in grid)),
                                            (ordered[-1], ordered[-2], True, sum(x > max(base) for x in grid))):
            if best == edge and acc[edge] >= acc[neighbour] + min_gain and beyond < max_extra:
                out[family] = next_rate(edge, up)
    return out
