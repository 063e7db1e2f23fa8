"""How much of a scenes test split repeats training layouts (a layout: each object's region,
shape, colour and size), for the scene sets the studies train and test on:

    python -m experiments.common.layout_overlap     # writes results/token_budget/layout_overlap.md

For each set, over its first ``--train`` training and ``--eval`` validation and test scenes: the
test images byte-for-byte equal to a training image, the test scenes whose layout a training scene
has (by number of shapes), and the share of test questions that are a (layout, question) pair
seen in training. The plain grid difficulties draw each split independently from few layouts;
``easy-heldout`` and ``medium-heldout`` keep them apart (``vitmm.data.scenes.layout_split``).
On freely placed (``hard``) scenes it also counts the region-named questions (colour or shape at
a region, which names the region of the shape's centre) whose shape lies mostly outside that
region, or where another shape covers more of it (``region_fill``)."""

from __future__ import annotations

import argparse
import collections
import hashlib
import pathlib
import time

import numpy as np
from PIL import Image, ImageDraw

from vitmm.data import packing, scenes

ROOT = pathlib.Path(__file__).resolve().parents[2]
# (name in the report, difficulty, resolution or None: the native study's random sizes)
SETS = (("scenes/easy_64 (token budget: main stage, horizon, frozen SmolLM2)", "easy", 64),
        ("scenes/medium_64", "medium", 64), ("scenes/hard_64 (token budget: hard)", "hard", 64),
        ("easy at random sizes 32–160 px, aspect ≤ 3 (native study)", "easy", None),
        ("scenes/easy-heldout_64", "easy-heldout", 64), ("scenes/medium-heldout_64", "medium-heldout", 64))


def layout(example: dict) -> tuple:
    """A scene's layout: its objects' (region, shape, colour, size), sorted."""
    o = example["objects"]
    return tuple(sorted(zip(o["region"], o["shape"], o["color"], o["size"], strict=True)))


def scenes_of(difficulty: str, resolution: int | None, split: str, n: int) -> list[dict]:
    if resolution is None:  # as experiments/native/features.py draws them
        source = packing.SceneSource(difficulty, n, split, 0, min_side=32, max_side=160, max_aspect=3.0)
        return [source[i] for i in range(n)]
    return [scenes.generate(difficulty, resolution, i, split) for i in range(n)]


def overlap(train: list[dict], test: list[dict]) -> dict:
    """What ``test`` repeats of ``train``: identical images, seen layouts (by shape count) and the
    share of (layout, question) pairs seen."""
    images = {hashlib.sha1(e["image"].tobytes()).hexdigest() for e in train}
    layouts = {layout(e) for e in train}
    pairs = {(layout(e), q) for e in train for q in e["questions"]}
    by_count = collections.defaultdict(lambda: [0, 0])
    for e in test:
        by_count[len(e["objects"]["shape"])][0] += layout(e) in layouts
        by_count[len(e["objects"]["shape"])][1] += 1
    questions = [(layout(e), q) in pairs for e in test for q in e["questions"]]
    return {"identical": sum(hashlib.sha1(e["image"].tobytes()).hexdigest() in images for e in test),
            "seen": sum(s for s, _ in by_count.values()), "scenes": len(test),
            "by_count": {k: tuple(v) for k, v in sorted(by_count.items())},
            "questions": len(questions), "seen_questions": sum(questions), "train_layouts": len(layouts)}


def region_fill(difficulty: str, resolution: int, split: str, n: int) -> dict:
    """Of the region-named questions (``color_at``, ``shape_at``) of the first ``n`` scenes: how
    many ask about a shape less than half of which lies in the named region, and how many where
    another shape covers more of that region than the answer's shape (pixels of each shape as
    ``scenes.generate`` draws it, on its supersampled canvas)."""
    diff = scenes.DIFFICULTIES[difficulty]
    k, names = (2, scenes.REGIONS_2X2) if diff.grid == 2 else (3, scenes.REGIONS_3X3)  # the layout regions name
    phrases = {scenes.at(r): r for r in names}
    side = resolution * (4 if resolution <= 64 else 2)
    out = {"asked": 0, "mostly_outside": 0, "other_covers_more": 0}
    for i in range(n):
        ex = scenes.generate(difficulty, resolution, i, split)
        o = ex["objects"]
        masks = []
        for shape, x, y, size in zip(o["shape"], o["x"], o["y"], o["size"], strict=True):
            canvas = Image.new("L", (side, side), 0)
            scenes._draw(ImageDraw.Draw(canvas), shape, 255, x * side, y * side, scenes._radius(diff, size) * side)
            masks.append(np.asarray(canvas) > 0)
        for question, kind in zip(ex["questions"], ex["question_kinds"], strict=True):
            if kind not in ("color_at", "shape_at"):
                continue
            region = next(r for phrase, r in phrases.items() if question.endswith(f" {phrase}?"))
            row, col = divmod(names.index(region), k)
            inside = np.zeros((side, side), bool)
            inside[row * side // k:(row + 1) * side // k, col * side // k:(col + 1) * side // k] = True
            answer = o["region"].index(region)  # the one shape whose centre is there
            area = [(m & inside).sum() for m in masks]
            out["asked"] += 1
            out["mostly_outside"] += int(area[answer] < masks[answer].sum() / 2)
            out["other_covers_more"] += any(a > area[answer] for j, a in enumerate(area) if j != answer)
    return out


def to_markdown(rows: list[tuple[str, str, dict]], n_train: int, fill: dict | None = None) -> str:
    lines = ["# Test scenes that repeat training layouts", "",
             f"`python -m experiments.common.layout_overlap` ({time.strftime('%Y-%m-%d')}): each set's first "
             f"{n_train:,} training scenes against its first validation and test scenes. A layout is each "
             "object's region, shape, colour and size; a (layout, question) pair seen in training differs from "
             "it only by the jitter (and, with a noisy background, the noise).", "",
             "| scenes | split | identical images | scenes whose layout is a training one | by number of shapes "
             "| questions: (layout, question) seen in training | distinct training layouts |",
             "|---|---|---:|---:|---|---:|---:|"]
    for name, split, r in rows:
        counts = ", ".join(f"{k}: {seen}/{n}" for k, (seen, n) in r["by_count"].items())
        lines.append(f"| {name} | {split} | {r['identical']} | {r['seen']} of {r['scenes']:,} | {counts} | "
                     f"{100 * r['seen_questions'] / r['questions']:.1f}% of {r['questions']:,} | "
                     f"{r['train_layouts']:,} |")
    if fill:
        lines += ["", f"Region-named questions on `hard` (its {fill['scenes']:,} test scenes): the region is the one "
                  "holding the shape's centre.", "",
                  "| questions | the shape lies mostly outside the named region | another shape covers more of it |",
                  "|---:|---:|---:|",
                  f"| {fill['asked']:,} | " + " | ".join(f"{fill[k]} ({100 * fill[k] / fill['asked']:.1f}%)"
                                                           for k in ("mostly_outside", "other_covers_more")) + " |"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> pathlib.Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "results/token_budget/layout_overlap.md"),
                        help="the report (default results/token_budget/layout_overlap.md)")
    parser.add_argument("--train", type=int, default=10_000, help="training scenes (the studies' 10,000)")
    parser.add_argument("--eval", type=int, default=1_000, help="validation and test scenes (the studies' 1,000)")
    args = parser.parse_args(argv)
    rows = []
    for name, difficulty, resolution in SETS:
        train = scenes_of(difficulty, resolution, "train", args.train)
        for split in ("validation", "test"):
            rows.append((name, split, overlap(train, scenes_of(difficulty, resolution, split, args.eval))))
        print(f"{name}: {rows[-1][2]['seen']} of {args.eval} test scenes repeat a training layout", flush=True)
    fill = {**region_fill("hard", 64, "test", args.eval), "scenes": args.eval}
    out = pathlib.Path(args.out)
    out.write_text(to_markdown(rows, args.train, fill))
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()
