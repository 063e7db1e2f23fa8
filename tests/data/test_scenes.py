"""The synthetic scenes generator: determinism, facts that match the pixels, questions."""

import numpy as np
import pytest

from vitmm.data import scenes


@pytest.mark.parametrize("difficulty", sorted(scenes.DIFFICULTIES))
@pytest.mark.parametrize("resolution", [32, 64, 224])
def test_deterministic_and_well_formed(difficulty, resolution):
    a = scenes.generate(difficulty, resolution, 7, "train", seed=1)
    b = scenes.generate(difficulty, resolution, 7, "train", seed=1)
    assert a["image"].shape == (resolution, resolution, 3) and a["image"].dtype == np.uint8
    np.testing.assert_array_equal(a["image"], b["image"])
    assert a["caption"] == b["caption"] and a["questions"] == b["questions"]
    c = scenes.generate(difficulty, resolution, 7, "validation", seed=1)
    assert not np.array_equal(a["image"], c["image"]) or a["caption"] != c["caption"]


def test_splits_and_seeds_differ():
    imgs = {(split, seed): scenes.generate("medium", 32, 0, split, seed)["image"].tobytes()
            for split in scenes.SPLIT_IDS for seed in (0, 1)}
    assert len(set(imgs.values())) == len(imgs)


@pytest.mark.parametrize("difficulty", sorted(scenes.DIFFICULTIES))
def test_facts_agree_with_each_other(difficulty):
    diff = scenes.DIFFICULTIES[difficulty]
    for index in range(40):
        ex = scenes.generate(difficulty, 64, index)
        objs = ex["objects"]
        n = len(objs["shape"])
        assert 1 <= n <= diff.max_shapes
        assert ex["shape_counts"].sum() == n == ex["color_counts"].sum()
        for s, count in zip(diff.shapes, ex["shape_counts"], strict=True):
            assert count == objs["shape"].count(s)
        assert ex["label"] == (diff.shapes.index(objs["shape"][0]) if n == 1 else -1)
        for x, y, region in zip(objs["x"], objs["y"], objs["region"], strict=True):
            assert 0 < x < 1 and 0 < y < 1
            assert region == scenes.region_of(x, y, 2 if diff.grid == 2 else 3)
        # The caption names every object.
        for shape, color in zip(objs["shape"], objs["color"], strict=True):
            assert f"{color} {shape}" in ex["caption"]
        assert len(ex["questions"]) == len(ex["answers"]) == len(ex["question_kinds"])


def test_objects_are_drawn_where_the_facts_say():
    for index in range(20):
        ex = scenes.generate("easy", 64, index)
        for x, y, color in zip(ex["objects"]["x"], ex["objects"]["y"], ex["objects"]["color"], strict=True):
            pixel = ex["image"][int(y * 64), int(x * 64)].astype(int)
            assert np.abs(pixel - np.array(scenes.COLORS[color])).max() < 40, (index, color, pixel)


@pytest.mark.parametrize("difficulty", ["easy", "medium", "hard"])
def test_scenes_at_any_size_draw_round_shapes_where_the_facts_say(difficulty):
    for index, (h, w) in enumerate([(48, 128), (160, 40), (72, 72), (33, 65)]):
        ex = scenes.generate(difficulty, (h, w), index)
        assert ex["image"].shape == (h, w, 3)
        np.testing.assert_array_equal(ex["image"], scenes.generate(difficulty, (h, w), index)["image"])
        for x, y, color in zip(ex["objects"]["x"], ex["objects"]["y"], ex["objects"]["color"], strict=True):
            pixel = ex["image"][int(y * h), int(x * w)].astype(int)
            assert np.abs(pixel - np.array(scenes.COLORS[color])).max() < 60, (difficulty, index, color, pixel)
    # a square size given as a pair is the square scene
    np.testing.assert_array_equal(scenes.generate(difficulty, (64, 64), 3)["image"],
                                  scenes.generate(difficulty, 64, 3)["image"])


def test_answers_are_true():
    for index in range(60):
        ex = scenes.generate("hard", 64, index)
        objs = ex["objects"]
        for kind, q, a in zip(ex["question_kinds"], ex["questions"], ex["answers"], strict=True):
            if kind == "count" and q == "how many shapes are there?":
                assert int(a) == len(objs["shape"])
            elif kind == "count":
                shape = q.split("how many ")[1].split("s are there")[0]
                assert int(a) == objs["shape"].count(shape)
            elif kind == "exists":
                shape = q[len("is there a "):-1]
                assert a == ("yes" if shape in objs["shape"] else "no")
            elif kind == "color_at":
                region = next(r for r in objs["region"] if q.endswith(scenes.at(r) + "?"))
                assert [c for c, r in zip(objs["color"], objs["region"], strict=True) if r == region] == [a]
            elif kind == "relative":
                assert a in ("yes", "no")


def test_question_kinds_all_occur_and_yes_no_is_balanced():
    kinds, yes, no = set(), 0, 0
    for index in range(200):
        ex = scenes.generate("medium", 32, index)
        kinds.update(ex["question_kinds"])
        yes += ex["answers"].count("yes")
        no += ex["answers"].count("no")
    assert kinds == set(scenes.QUESTION_KINDS)
    assert 0.35 < yes / (yes + no) < 0.65


def test_single_shape_images_cover_every_class():
    labels = [scenes.generate("easy", 32, i)["label"] for i in range(200)]
    assert set(labels) == {-1, 0, 1, 2, 3}
    assert labels.count(-1) < 150  # about half of easy images hold one shape


def test_swap_left_right_swaps_words_only():
    assert scenes.swap_left_right("a star on the left of the bright top right") == \
        "a star on the right of the bright top left"


def test_bad_arguments():
    with pytest.raises(ValueError, match="Unknown scenes difficulty"):
        scenes.generate("extreme", 32, 0)
    with pytest.raises(ValueError, match="Unknown split"):
        scenes.generate("easy", 32, 0, split="dev")


def _digest(difficulty: str) -> str:
    import hashlib
    import json

    h = hashlib.sha1()
    for split in ("train", "validation", "test"):
        for i in range(20):
            ex = scenes.generate(difficulty, 32, i, split)
            h.update(ex["image"].tobytes())
            h.update(json.dumps([ex["caption"], ex["questions"], ex["answers"]]).encode())
    return h.hexdigest()[:16]


@pytest.mark.parametrize("difficulty, digest", [("easy", "1ae3b61104560e24"), ("medium", "02e57476b3d1a111"),
                                                ("hard", "1f5daaf1a72991c2")])
def test_the_difficulties_results_were_made_on_draw_the_same_scenes(difficulty, digest):
    """Every committed study ran on these: their scenes (images, captions, questions) stay byte for
    byte what they were (digests made on 2026-12-07 with the code that made the results)."""
    assert _digest(difficulty) == digest


@pytest.mark.parametrize("difficulty", ["easy-heldout", "medium-heldout"])
def test_held_out_difficulties_keep_each_splits_layouts_apart_with_the_same_mix_of_counts(difficulty):
    """A layout (each object's region, shape, colour, size) of a validation or test scene is never a
    training scene's: each scene's layout hashes to its own split, and none of 100 test layouts is
    among 1,500 training ones (easy has only 96 one-shape layouts: the plain difficulty repeats
    them across splits). The splits draw the same numbers of shapes."""
    def layouts(split, n):
        out = []
        for i in range(n):
            ex = scenes.generate(difficulty, 32, i, split)
            objs = [dict(zip(ex["objects"], values, strict=True)) for values in zip(*ex["objects"].values(),
                                                                                      strict=True)]
            assert scenes.layout_split(objs) == scenes.SPLIT_IDS[split]
            out.append(tuple(sorted((o["region"], o["shape"], o["color"], o["size"]) for o in objs)))
        return out

    train, test = layouts("train", 1500), layouts("test", 100)
    assert not set(test) & set(train)
    counts = lambda ls: np.bincount([len(x) for x in ls], minlength=5)[1:] / len(ls)  # noqa: E731
    assert np.abs(counts(train) - counts(test)).max() < 0.15
    plain = [tuple(sorted(zip(*(scenes.generate(difficulty.split("-")[0], 32, i, "test")["objects"][k]
                                for k in ("region", "shape", "color", "size")), strict=True))) for i in range(100)]
    assert set(plain) & set(train)  # (what held_out prevents)
