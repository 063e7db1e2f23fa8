"""The token budget: how many visual tokens a connector hands the LM, in one place.

Each family turns the requested ``budget`` into its own knob through one of the rules below
(keep every patch, merge k×k neighbours, a square side, a number of latents/queries; ``pool``
adds its strides) and answers ``tokens(budget, grid, **settings)``; a budget it cannot produce
exactly raises ``BudgetError`` naming the counts it reaches. ``num_visual_tokens`` asks the
family, ``reachable`` lists every count, and ``resolve`` picks the nearest reachable count for
a sweep. The tests check each family's answer against the shape it really produces.
"""

from __future__ import annotations

import dataclasses
import math
import numbers


class BudgetError(ValueError):
    """A connector cannot produce the requested number of visual tokens."""


def all_tokens(budget, grid, family: str) -> int:
    """Families that keep every patch token: the budget must be None/'all' or exactly h·w."""
    n = grid[0] * grid[1]
    if budget in (None, "all", n):
        return n
    raise BudgetError(f"{family} keeps every patch token ({grid[0]}x{grid[1]} = {n}); it cannot give "
                      f"{budget}. Use a reducing connector (pool, pixel_shuffle, patch_merger, qwen_resampler, "
                      "perceiver, idefics2_perceiver, qformer, c_abstractor, ldp) for a smaller budget.")


def merge_factor(budget, grid, family: str, merge: int | None = None) -> int:
    """k such that merging k×k neighbours of the grid gives exactly ``budget`` tokens; with a
    fixed ``merge`` (native resolution: the count follows the image), that k, checked."""
    h, w = grid
    if merge is not None:
        if h % merge or w % merge:
            raise BudgetError(f"{family} merges {merge}x{merge} neighbours but the patch grid {h}x{w} is not a "
                              f"multiple of {merge}; give the image sides that are multiples of patch x {merge}.")
        if budget not in (None, "all", (h // merge) * (w // merge)):
            raise BudgetError(f"{family} with merge={merge} gives {(h // merge) * (w // merge)} tokens on a "
                              f"{h}x{w} grid, not budget={budget}; set one of the two.")
        return merge
    if budget in (None, "all"):
        return 1
    for k in range(1, min(h, w) + 1):
        if h % k == 0 and w % k == 0 and (h // k) * (w // k) == budget:
            return k
    reachable = [(h // k) * (w // k) for k in range(1, min(h, w) + 1) if h % k == 0 and w % k == 0]
    raise BudgetError(f"{family} merges k×k neighbours of the {h}x{w} grid, which gives {reachable} "
                      f"tokens; {budget} is not among them.")


def square_side(budget, family: str) -> int:
    """Families that pool or query on a square side×side grid need a perfect-square budget."""
    if budget in (None, "all"):
        raise BudgetError(f"{family} needs an explicit budget (a perfect square, e.g. 16 or 64).")
    side = math.isqrt(int(budget))
    if side * side != budget or side == 0:
        raise BudgetError(f"{family} produces a side×side grid of tokens; {budget} is not a perfect "
                          f"square (nearest: {side * side} or {(side + 1) ** 2}).")
    return side


def latent_count(budget, family: str, what: str = "latents") -> int:
    """Families with M learned latents or queries: any positive integer."""
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        raise BudgetError(f"{family} needs a positive integer number of {what}, got {budget!r}.")
    return budget


def lookup(cfg: dict):
    """``(family class, settings)`` of a connector config ``{name, budget, ...}``."""
    from vitmm.models.connectors import REGISTRY  # the registry imports every family, which import this file

    settings = dict(cfg)
    name = settings.pop("name", None)
    if name not in REGISTRY:
        raise ValueError(f"Unknown connector {name!r}; choose one of {tuple(REGISTRY)}.")
    family = REGISTRY[name]
    known = {f.name for f in dataclasses.fields(family)} - {"parent", "name", "out_dim"}
    unknown = sorted(set(settings) - known)
    if unknown:  # a typo would otherwise size a sweep by the family's default (tokens() ignores extras)
        raise ValueError(f"Connector {name!r} has no setting {unknown[0]!r}; it takes {sorted(known)}.")
    if isinstance(settings.get("budget"), numbers.Integral) and not isinstance(settings["budget"], bool):
        settings["budget"] = int(settings["budget"])  # e.g. numpy's integers from a sweep
    return family, settings


def num_visual_tokens(cfg: dict, grid: tuple[int, int]) -> int:
    """How many tokens the connector ``cfg`` (``name``, ``budget``, family settings) hands the
    LM for a patch grid; raises ``BudgetError`` for a budget the family cannot produce."""
    family, settings = lookup(cfg)
    return family.tokens(settings.pop("budget", None), tuple(grid), **settings)


def token_grid(cfg: dict, grid: tuple[int, int]) -> tuple[int, int] | None:
    """The ``(rows, cols)`` in which the connector's tokens lie, in raster order (what M-RoPE and
    AnyRes's newline tokens need), or None for a family whose tokens are learned queries with no
    place in the image (perceiver, qformer, qwen_resampler)."""
    family, settings = lookup(cfg)
    rule = getattr(family, "token_grid", None)
    return None if rule is None else tuple(rule(settings.pop("budget", None), tuple(grid), **settings))


def reachable(cfg: dict | str, grid: tuple[int, int]) -> dict[int, int | str]:
    """``{tokens: budget setting}`` for every token count the connector can produce on ``grid``
    (``cfg``: a config dict, or a family name for its default settings)."""
    cfg = {"name": cfg} if isinstance(cfg, str) else dict(cfg)
    n = grid[0] * grid[1]
    out: dict[int, int | str] = {}
    for budget in (*range(1, n + 1), "all"):
        try:
            tokens = num_visual_tokens({**cfg, "budget": budget}, grid)
        except BudgetError:
            continue
        if tokens not in out or budget == tokens:
            out[tokens] = budget
    return out


def resolve(cfg: dict | str, requested: int | str, grid: tuple[int, int], max_ratio: float):
    """``(budget setting, tokens, note)``: the reachable count nearest the requested one (in
    ratio; ``"all"`` means h·w), with setting ``None`` when it is more than ``max_ratio`` away."""
    target = grid[0] * grid[1] if requested == "all" else int(requested)
    options = reachable(cfg, grid)
    tokens = min(options, key=lambda t: (abs(math.log(t / target)), t))
    if max(tokens / target, target / tokens) > max_ratio:
        return None, None, f"unreachable (reaches {sorted(options)})"
    note = "" if tokens == target else f"nearest to {target}"
    return options[tokens], tokens, note
