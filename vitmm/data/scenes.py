"""Synthetic scenes: coloured shapes on a background, with captions, labels, facts and questions.

Every example is a pure function of ``(difficulty, resolution, seed, split, index)``, so any
example can be regenerated alone and two builds give identical bytes.

Question kinds and what they need (the reason the token-budget experiment asks all of them):

============  =======================================================  =========================
kind          example                                                  needs
============  =======================================================  =========================
``exists``    "is there a star?" → "yes"                               coarse content only: a
                                                                       pooled summary suffices
``count``     "how many circles are there?" → "2"                      individual objects, but
                                                                       not where they are
``color_at``  "what colour is the shape at the top left?" → "red"     fine spatial detail:
                                                                       binding place to colour
``shape_at``  "what shape is at the bottom right?" → "triangle"        fine spatial detail:
                                                                       binding place to shape
``relative``  "is the red circle left of the blue star?" → "yes"       spatial relations
                                                                       between two objects
============  =======================================================  =========================

Positions are named on a 3×3 layout (``top left`` … ``center`` … ``bottom right``), or on a
2×2 layout (the four corners) for the 2×2 grid of the ``easy`` difficulty.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import math
import re
import zlib

import numpy as np
from PIL import Image, ImageDraw

SHAPES = ("circle", "square", "triangle", "star", "diamond", "cross")
COLORS = {
    "red": (214, 39, 40),
    "green": (44, 160, 44),
    "blue": (31, 90, 220),
    "yellow": (240, 200, 30),
    "purple": (140, 70, 180),
    "orange": (255, 127, 14),
    "cyan": (23, 190, 207),
    "pink": (240, 110, 180),
}
SIZES = ("small", "medium", "large")
REGIONS_3X3 = ("top left", "top", "top right", "left", "center", "right",
               "bottom left", "bottom", "bottom right")
REGIONS_2X2 = ("top left", "top right", "bottom left", "bottom right")
REGIONS = REGIONS_3X3  # the label space of ``region`` (2×2 names are a subset)
QUESTION_KINDS = ("exists", "count", "color_at", "shape_at", "relative")
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


@dataclasses.dataclass(frozen=True)
class Difficulty:
    """What a difficulty level varies. ``grid=0`` means free placement (shapes kept apart by their
    radii plus a margin). ``held_out``: validation and test scenes have layouts (each object's
    region, shape, colour and size) that no training scene has (``layout_split``)."""

    shapes: tuple[str, ...]
    colors: tuple[str, ...]
    sizes: tuple[str, ...]
    max_shapes: int
    grid: int
    noisy_background: bool
    held_out: bool = False


DIFFICULTIES = {
    # Four shapes (the four-class shapes task), six colours, a 2×2 grid, plain background.
    "easy": Difficulty(SHAPES[:4], tuple(COLORS)[:6], ("large",), 2, 2, False),
    # Up to four shapes on a 3×3 grid, two sizes, noisy background.
    "medium": Difficulty(SHAPES[:4], tuple(COLORS)[:6], ("medium", "large"), 4, 3, True),
    # Six shapes, eight colours, three sizes, placed freely, up to six per image.
    "hard": Difficulty(SHAPES, tuple(COLORS), SIZES, 6, 0, True),
}
# On a grid the layouts are few (easy: 96 one-shape and 3,456 two-shape ones), so independent draws
# repeat training layouts in the validation and test splits (easy: 72% of test questions ask about a
# layout seen in training, with the same question). These two hold each split's layouts apart.
DIFFICULTIES["easy-heldout"] = dataclasses.replace(DIFFICULTIES["easy"], held_out=True)
DIFFICULTIES["medium-heldout"] = dataclasses.replace(DIFFICULTIES["medium"], held_out=True)
SPLIT_IDS = {"train": 0, "validation": 1, "test": 2}
# Radius of a shape as a fraction of its grid cell's half-width, or of the image for free placement.
_GRID_RADIUS = {"small": 0.45, "medium": 0.6, "large": 0.8}
_FREE_RADIUS = {"small": 0.06, "medium": 0.09, "large": 0.12}


def region_of(x: float, y: float, layout: int) -> str:
    """Name of the region that contains the normalised point ``(x, y)`` (origin top left)."""
    col, row = min(int(x * layout), layout - 1), min(int(y * layout), layout - 1)
    if layout == 2:
        return REGIONS_2X2[row * 2 + col]
    return REGIONS_3X3[row * 3 + col]


def _polygon(shape: str, cx: float, cy: float, r: float) -> list[tuple[float, float]] | None:
    if shape == "triangle":
        return [(cx + r * math.cos(a), cy - r * math.sin(a))
                for a in (math.pi / 2, math.pi / 2 + 2 * math.pi / 3, math.pi / 2 + 4 * math.pi / 3)]
    if shape == "star":
        return [(cx + (r if k % 2 == 0 else 0.45 * r) * math.cos(math.pi / 2 + k * math.pi / 5),
                 cy - (r if k % 2 == 0 else 0.45 * r) * math.sin(math.pi / 2 + k * math.pi / 5))
                for k in range(10)]
    if shape == "diamond":
        return [(cx, cy - r), (cx + 0.75 * r, cy), (cx, cy + r), (cx - 0.75 * r, cy)]
    if shape == "cross":
        a, b = 0.35 * r, r
        pts = [(a, b), (a, a), (b, a), (b, -a), (a, -a), (a, -b),
               (-a, -b), (-a, -a), (-b, -a), (-b, a), (-a, a), (-a, b)]
        return [(cx + px, cy + py) for px, py in pts]
    return None


def _draw(draw: ImageDraw.ImageDraw, shape: str, color, cx: float, cy: float, r: float) -> None:
    if shape == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=color)
    elif shape == "square":
        s = r * 0.85
        draw.rectangle([cx - s, cy - s, cx + s, cy + s], fill=color)
    else:
        draw.polygon(_polygon(shape, cx, cy, r), fill=color)


def _place(rng: np.random.Generator, diff: Difficulty, n: int) -> list[tuple[float, float, str]]:
    """Centres (normalised) and sizes of ``n`` non-overlapping shapes."""
    if diff.grid:
        cells = rng.choice(diff.grid * diff.grid, size=n, replace=False)
        out = []
        for cell in cells:
            size = diff.sizes[rng.integers(len(diff.sizes))]
            half = 0.5 / diff.grid
            jitter = (1 - _GRID_RADIUS[size]) * half * 0.5
            row, col = divmod(int(cell), diff.grid)
            out.append(((col + 0.5) / diff.grid + rng.uniform(-jitter, jitter),
                        (row + 0.5) / diff.grid + rng.uniform(-jitter, jitter), size))
        return out
    placed: list[tuple[float, float, str]] = []
    for _ in range(n):
        size = diff.sizes[rng.integers(len(diff.sizes))]
        r = _FREE_RADIUS[size]
        for _attempt in range(200):
            x, y = rng.uniform(r + 0.02, 1 - r - 0.02, size=2)
            if all(math.hypot(x - px, y - py) > r + _FREE_RADIUS[ps] + 0.03 for px, py, ps in placed):
                placed.append((float(x), float(y), size))
                break
    return placed


def layout_split(objects: list[dict]) -> int:
    """The split (``SPLIT_IDS``' number) a layout belongs to in a ``held_out`` difficulty: a stable
    hash of its objects' (region, shape, colour, size) sends 80% of layouts to train, 10% to
    validation and 10% to test."""
    layout = sorted((o["region"], o["shape"], o["color"], o["size"]) for o in objects)
    bucket = int(hashlib.sha1(repr(layout).encode()).hexdigest()[:8], 16) % 10
    return 0 if bucket < 8 else 1 if bucket == 8 else 2


def _radius(diff: Difficulty, size: str) -> float:
    return _GRID_RADIUS[size] * 0.5 / diff.grid if diff.grid else _FREE_RADIUS[size]


# ``left``/``right`` and the words made of them (``leftmost``, ``rightward(s)``): RefCOCO-style
# phrases ("the leftmost man") are as wrong after a flip as "the man on the left".
LEFT_RIGHT = re.compile(r"\b(left|right)(most|wards?)?\b", re.IGNORECASE)


def swap_left_right(text: str) -> str:
    """Swaps the words ``left`` and ``right`` (and ``leftmost``/``rightmost``,
    ``leftward(s)``/``rightward(s)``) in any case, keeping it (``Left`` → ``Right``): what a
    horizontal flip does to a description."""
    def swap(match):
        word, rest = match.group(1), match.group(2) or ""
        other = "right" if word.lower() == "left" else "left"
        return (other.upper() if word.isupper() else other.capitalize() if word[0].isupper() else other) + rest

    return LEFT_RIGHT.sub(swap, text)


def _describe(obj: dict) -> str:
    return f"{obj['color']} {obj['shape']}"


def _a(obj: dict) -> str:
    """``"a red circle"``, ``"an orange star"``."""
    name = _describe(obj)
    return ("an " if name[0] in "aeiou" else "a ") + name


def at(region: str) -> str:
    """The phrase that places something in ``region``: "at the top left", "on the left", …"""
    if region == "center":
        return "in the center"
    if region in ("left", "right"):
        return f"on the {region}"
    return f"at the {region}"


def _relation(a: dict, b: dict, margin: float) -> str | None:
    """An unambiguous relation of ``a`` to ``b`` ("left of", "above", …), or None."""
    dx, dy = b["x"] - a["x"], b["y"] - a["y"]
    if abs(dx) >= abs(dy) and abs(dx) > margin:
        return "left of" if dx > 0 else "right of"
    if abs(dy) > margin:
        return "above" if dy > 0 else "below"
    return None


def _caption(rng: np.random.Generator, objects: list[dict], margin: float) -> str:
    parts_at = [f"{_a(o)} {at(o['region'])}" for o in objects]
    template = int(rng.integers(4))
    if template == 1:
        listed = ", ".join(f"{_a(o)} ({o['region']})" for o in objects)
        return f"{NUMBER_WORDS[len(objects)]} shape{'s' if len(objects) > 1 else ''}: {listed}."
    if template == 2 and len(objects) >= 2:
        rel = _relation(objects[0], objects[1], margin)
        if rel is not None:
            rel = {"above": "above", "below": "below", "left of": "to the left of",
                   "right of": "to the right of"}[rel]
            rest = "".join(f", and {p}" for p in parts_at[2:])
            return f"{_a(objects[0])} {rel} {_a(objects[1])}{rest}."
    if template == 3:
        return "there is " + ", and ".join(parts_at) + "."
    return " and ".join(parts_at) + "."


def _questions(rng: np.random.Generator, diff: Difficulty, objects: list[dict], margin: float):
    qa: list[tuple[str, str, str]] = []
    present = {o["shape"] for o in objects}
    absent = [s for s in diff.shapes if s not in present]
    # exists: one positive and, when possible, one negative, so yes/no are balanced.
    qa.append(("exists", f"is there a {objects[int(rng.integers(len(objects)))]['shape']}?", "yes"))
    if absent:
        qa.append(("exists", f"is there a {absent[int(rng.integers(len(absent)))]}?", "no"))
    # count: all shapes, and one shape type (which may be absent: answer 0).
    qa.append(("count", "how many shapes are there?", str(len(objects))))
    shape = diff.shapes[int(rng.integers(len(diff.shapes)))]
    qa.append(("count", f"how many {shape}s are there?", str(sum(o["shape"] == shape for o in objects))))
    # color_at / shape_at: a region holding exactly one shape.
    by_region: dict[str, list[dict]] = {}
    for o in objects:
        by_region.setdefault(o["region"], []).append(o)
    unique = [r for r, objs in by_region.items() if len(objs) == 1]
    if unique:
        region = unique[int(rng.integers(len(unique)))]
        qa.append(("color_at", f"what colour is the shape {at(region)}?", by_region[region][0]["color"]))
        region = unique[int(rng.integers(len(unique)))]
        qa.append(("shape_at", f"what shape is {at(region)}?", by_region[region][0]["shape"]))
    # relative: a pair of uniquely described shapes with an unambiguous relation.
    names = [_describe(o) for o in objects]
    nameable = [o for o, name in zip(objects, names, strict=True) if names.count(name) == 1]
    pairs = [(a, b) for a in nameable for b in nameable if a is not b and _relation(a, b, margin)]
    if pairs:
        a, b = pairs[int(rng.integers(len(pairs)))]
        true_rel = _relation(a, b, margin)
        opposite = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}
        asked = true_rel if rng.random() < 0.5 else opposite[true_rel]
        qa.append(("relative", f"is the {_describe(a)} {asked} the {_describe(b)}?",
                   "yes" if asked == true_rel else "no"))
    return qa


def generate(difficulty: str, resolution: int | tuple[int, int], index: int, split: str = "train",
             seed: int = 0) -> dict:
    """One scene as a dict of numpy/python values (see ``vitmm.data.scenes_builder`` for types).

    ``resolution`` is a side (square images) or ``(height, width)``: positions are then fractions
    of each axis (regions a 3×3 or 2×2 layout of the whole image) and shapes stay round, their
    radius a share of the shorter side.

    Keys: ``image`` uint8 ``[H, W, 3]``; ``caption``; ``label`` (index of the shape in
    ``DIFFICULTIES[difficulty].shapes`` for single-shape images, else -1); ``objects``
    (per-shape ``shape``, ``color``, ``size``, ``region`` names and ``x``, ``y`` centres in
    [0, 1] from the top left); ``shape_counts`` and ``color_counts`` (over the difficulty's
    shapes and colours); ``questions``, ``answers``, ``question_kinds``.
    """
    if difficulty not in DIFFICULTIES:
        raise ValueError(f"Unknown scenes difficulty {difficulty!r}; choose one of {tuple(DIFFICULTIES)}.")
    if split not in SPLIT_IDS:
        raise ValueError(f"Unknown split {split!r}; choose one of {tuple(SPLIT_IDS)}.")
    diff = DIFFICULTIES[difficulty]
    square = isinstance(resolution, int | np.integer)
    height, width = (int(resolution),) * 2 if square else (int(resolution[0]), int(resolution[1]))
    if min(height, width) < 1:
        raise ValueError(f"Scenes need a positive size, got {resolution!r}.")
    key = [seed, SPLIT_IDS[split], index, *((height,) if height == width else (height, width))]
    layout = 2 if diff.grid == 2 else 3
    # A held-out difficulty draws again (the next attempt's stream, its own name in the key) until
    # the layout belongs to the split, keeping the first draw's shape count (so every split has the
    # same mix of counts); the others keep the key every committed result was made with.
    n = None
    for attempt in itertools.count():
        rng = np.random.default_rng([*key, zlib.crc32(difficulty.encode()), attempt] if diff.held_out else key)
        drawn = int(rng.integers(1, diff.max_shapes + 1))
        n = drawn if n is None else n
        objects = []
        for x, y, size in _place(rng, diff, n):
            objects.append(dict(
                shape=diff.shapes[int(rng.integers(len(diff.shapes)))],
                color=diff.colors[int(rng.integers(len(diff.colors)))],
                size=size, x=x, y=y, region=region_of(x, y, layout),
            ))
        if not diff.held_out or layout_split(objects) == SPLIT_IDS[split]:
            break

    scale = 4 if max(height, width) <= 64 else 2  # supersampling for anti-aliased edges
    canvas_h, canvas_w = height * scale, width * scale
    if diff.noisy_background:
        background = tuple(int(v) for v in rng.integers(200, 246, size=3))
    else:
        background = (235, 235, 235)
    image = Image.new("RGB", (canvas_w, canvas_h), background)
    draw = ImageDraw.Draw(image)
    for o in objects:
        _draw(draw, o["shape"], COLORS[o["color"]], o["x"] * canvas_w, o["y"] * canvas_h,
              _radius(diff, o["size"]) * min(canvas_h, canvas_w))
    pixels = np.asarray(image.resize((width, height), Image.Resampling.BOX), dtype=np.float32)
    if diff.noisy_background:
        pixels = pixels + rng.normal(0.0, 12.0, size=pixels.shape)
    pixels = np.clip(np.round(pixels), 0, 255).astype(np.uint8)

    margin = 0.5 / diff.grid if diff.grid else 0.1
    qa = _questions(rng, diff, objects, margin)
    return dict(
        image=pixels,
        caption=_caption(rng, objects, margin),
        label=diff.shapes.index(objects[0]["shape"]) if len(objects) == 1 else -1,
        objects={k: [o[k] for o in objects] for k in ("shape", "color", "size", "region", "x", "y")},
        shape_counts=np.array([sum(o["shape"] == s for o in objects) for s in diff.shapes], np.int64),
        color_counts=np.array([sum(o["color"] == c for o in objects) for c in diff.colors], np.int64),
        questions=[q for _, q, _ in qa],
        answers=[a for _, _, a in qa],
        question_kinds=[k for k, _, _ in qa],
    )
