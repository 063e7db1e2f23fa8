"""``python -m experiments.common.layout_overlap``: what a test split repeats of its training split."""

import numpy as np

from experiments.common import layout_overlap as lo


def _scene(objects, questions, pixel=0):
    keys = ("region", "shape", "color", "size")
    return {"objects": {k: [o[i] for o in objects] for i, k in enumerate(keys)}, "questions": questions,
            "image": np.full((2, 2, 3), pixel, np.uint8)}


def test_overlap_counts_identical_images_seen_layouts_and_seen_question_pairs():
    a, b = ("top left", "circle", "red", "large"), ("top right", "star", "blue", "large")
    train = [_scene([a], ["q1", "q2"], 1), _scene([a, b], ["q1"], 2)]
    test = [_scene([a], ["q1", "q3"], 1),  # the first training image again; one of its questions seen
            _scene([b, a], ["q1"], 3),  # the second's layout in another order, another image
            _scene([b], ["q1"], 4)]  # a new layout
    r = lo.overlap(train, test)
    assert (r["identical"], r["seen"], r["scenes"], r["train_layouts"]) == (1, 2, 3, 2)
    assert r["by_count"] == {1: (1, 2), 2: (1, 1)} and (r["seen_questions"], r["questions"]) == (2, 4)
    assert "| x | test | 1 | 2 of 3 | 1: 1/2, 2: 1/1 | 50.0% of 4 | 2 |" in lo.to_markdown([("x", "test", r)], 2)


def test_the_plain_easy_split_repeats_training_layouts_and_the_held_out_one_does_not():
    for difficulty, repeats in (("easy", True), ("easy-heldout", False)):
        r = lo.overlap(lo.scenes_of(difficulty, 32, "train", 300), lo.scenes_of(difficulty, 32, "test", 40))
        assert (r["seen"] > 10) == repeats and (r["seen"] == 0) != repeats


def test_region_fill_counts_shapes_mostly_outside_their_named_region():
    """Easy's grid keeps every shape inside its cell: no region-named question is ambiguous there;
    hard's free placement makes some (a shape past a region line, named by its centre)."""
    grid = lo.region_fill("easy", 32, "test", 30)
    assert grid["asked"] > 20 and grid["mostly_outside"] == grid["other_covers_more"] == 0
    free = lo.region_fill("hard", 32, "test", 150)
    assert 0 < free["mostly_outside"] < free["asked"] / 5
