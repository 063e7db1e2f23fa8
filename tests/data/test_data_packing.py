"""The NaFlex patch budget and packed input batches."""

import json
import math
import pathlib
from fractions import Fraction

import numpy as np
import pytest

from vitmm.data.packing import naflex_size

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "native"


def test_naflex_size_is_siglip2s_processor():
    data = json.loads((FIXTURES / "naflex_sizes.json").read_text())
    assert len(data["cases"]) == 400
    for case in data["cases"]:
        got = naflex_size(case["height"], case["width"], case["patch"], case["max_num_patches"])
        assert list(got) == case["target"], case


def test_naflex_size_is_the_largest_grid_within_the_budget():
    rng = np.random.default_rng(1)
    for _ in range(300):
        h, w = (int(v) for v in rng.integers(1, 3000, size=2))
        patch, budget = int(rng.choice([14, 16])), int(rng.integers(1, 2000))
        th, tw = naflex_size(h, w, patch, budget)
        gh, gw = th // patch, tw // patch
        assert th % patch == 0 and tw % patch == 0 and gh * gw <= budget
        # one scale s gives both sides: ceil(s·h/p) = gh and ceil(s·w/p) = gw (1 also for any s below)
        low = max(Fraction((gh - 1) * patch, h) if gh > 1 else 0, Fraction((gw - 1) * patch, w) if gw > 1 else 0)
        top = min(Fraction(gh * patch, h), Fraction(gw * patch, w))
        assert low < top, (h, w, patch, budget, gh, gw)
        # just above that scale a side gains a patch, and the budget no longer holds (or the cap binds)
        above = top * (1 + Fraction(1, 10**9))
        bigger = [max(1, math.ceil(above * side / patch)) for side in (h, w)]
        assert bigger[0] * bigger[1] > budget or top >= 100, (h, w, patch, budget)


def test_naflex_size_examples_and_errors():
    assert naflex_size(480, 640, 16, 256) == (224, 288)  # 14 x 18 = 252 patches
    assert naflex_size(224, 224, 16, 196) == (224, 224)
    assert naflex_size(100, 3000, 16, 64) == (32, 512)  # wide: 2 x 32
    with pytest.raises(ValueError, match="max_num_patches 0"):
        naflex_size(10, 10, 16, 0)


def test_packed_images_over_seq_len_fail_with_the_example_and_the_fix():
    """``seq_len == max_num_patches`` leaves no room for the class token: said once at setup when the
    budget is given, else by the first image that fills its budget (not inside grain's packer)."""
    from vitmm.data import packing, preprocess

    class Squares:
        def __len__(self):
            return 2

        def __getitem__(self, index):
            return {"_id": f"square{index}", "image": np.full((64, 64, 3), 100, np.uint8)}

    pp = preprocess.parse("naflex(64, 8)|value_range(-1, 1)")
    args = dict(patch_size=8, seq_len=64, max_images=4, rows=1, num_bins=2, num_epochs=1)
    with pytest.raises(ValueError, match=r"seq_len=64 .*max_num_patches=64 patches \+ 1 class/register token\(s\); "
                                         r"set seq_len >= 65"):
        packing.packed_iterator(Squares(), pp, max_num_patches=64, **args)
    with pytest.raises(ValueError, match=r"square\d has 65 tokens \(8x8 patches \+ 1 class/register token\(s\)\) > "
                                         r"input.packing.seq_len=64; set seq_len >= max_num_patches \+ 1"):
        next(packing.packed_iterator(Squares(), pp, **args))
    assert next(packing.packed_iterator(Squares(), pp, **dict(args, seq_len=65)))["grids"][0, 0].tolist() == [8, 8]


def test_packed_iterator_rows_hold_each_examples_own_tokens_and_resume_exactly():
    from vitmm.data import packing, preprocess
    from vitmm.models import packing as model_packing

    source = packing.SceneSource("medium", 40, min_side=16, max_side=96, max_aspect=4.0)
    pp = preprocess.parse("naflex(12, 8)|value_range(-1, 1)|tokenize('caption', 16)")
    it = packing.packed_iterator(source, pp, patch_size=8, seq_len=32, max_images=3, rows=4, num_bins=4,
                                 meta_keys=("caption_tokens",), seed=3)
    batch = next(it)
    assert batch["patches"].shape == (4, 32, 192) and batch["grids"].shape == (4, 3, 2)
    seen = 0
    for r in range(4):
        for k in np.flatnonzero(batch["image_ids"][r] >= 0):
            ex = pp(dict(source[int(batch["image_ids"][r, k])]), None)
            tokens = model_packing.image_tokens(ex["image"], 8)
            span = batch["segment_ids"][r] == k + 1
            assert tokens["grid"].prod() <= 12  # the NaFlex budget
            np.testing.assert_array_equal(batch["grids"][r, k], tokens["grid"])
            np.testing.assert_allclose(batch["patches"][r][span], tokens["patches"])
            np.testing.assert_array_equal(batch["positions"][r][span], tokens["positions"])
            np.testing.assert_array_equal(batch["caption_tokens"][r, k], ex["caption_tokens"])
            seen += 1
    assert seen >= 8  # 4 rows of 32 tokens, images of at most 13
    assert model_packing.Packed(**{k: batch[k] for k in ("patches", "segment_ids", "kinds", "positions", "grids",
                                                          "image_ids")}).padding_fraction() < 0.5
    state = it.get_state()
    following = next(it)
    it.set_state(state)
    for key, value in next(it).items():
        np.testing.assert_array_equal(value, following[key])


def test_anyres_op_cuts_the_best_resolution_into_tiles_after_a_squashed_base_view():
    """A 30x70 image with 16-px tiles: the best candidate is 16x48 (1x3 tiles, the most of its
    pixels), the image resized to 16x38 with its aspect kept and centred on black; the tiles are
    that canvas in raster order after the base view (the image squashed to 16x16), then black
    views up to the most any candidate needs (1 + 4); the layout is ``anyres.layout``, left-padded."""
    from PIL import Image

    from vitmm.data import preprocess
    from vitmm.models import anyres

    pins = [(16, 32), (32, 16), (32, 32), (16, 48)]
    image = np.random.default_rng(0).integers(1, 256, (30, 70, 3), dtype=np.uint8)
    out = preprocess.parse(f"anyres({pins}, 16, (2, 2))")({"image": image}, None)
    plan = anyres.plan((30, 70), pins, 16)
    assert plan["best"] == (16, 48) and plan["fitted"] == (16, 38) and plan["offset"] == (0, 5)
    views = out["image"]
    assert views.shape == (5, 16, 16, 3) and views.dtype == np.uint8 and not views[4:].any()
    pil = lambda size: np.asarray(Image.fromarray(image).resize(size[::-1], Image.Resampling.BILINEAR))  # noqa: E731
    np.testing.assert_array_equal(views[0], pil((16, 16)))
    canvas = np.concatenate(list(views[1:4]), axis=1)  # 16 x 48
    np.testing.assert_array_equal(canvas[:, 5:43], pil((16, 38)))
    assert not canvas[:, :5].any() and not canvas[:, 43:].any()
    index = anyres.layout((30, 70), pins, 16, (2, 2))
    length = anyres.max_tokens(pins, 16, (2, 2))
    # the base view's 2x2, then the tiles' 2x6 grid cut to the 2x4 the image covers (int(70 * 2 / 30) = 4
    # columns, one cut at each side) with a newline per row; at most 2x2 + 4 rows of 4 + 1
    assert length == 4 + 4 * 5 and len(index) == 4 + 2 * 5
    np.testing.assert_array_equal(out["anyres_layout"][-len(index):], index)
    np.testing.assert_array_equal(out["visual_mask"], np.arange(length) >= length - len(index))
    with pytest.raises(ValueError, match="not a whole number of 16px tiles"):
        preprocess.parse("anyres([(16, 40)], 16, (2, 2))")({"image": image}, None)


def test_letterbox_and_naflex_ops():
    from vitmm.data import preprocess

    image = np.full((30, 90, 3), 200, np.uint8)
    boxed = preprocess.parse("letterbox(48)")({"image": image}, None)
    assert boxed["image"].shape == (48, 48, 3) and list(boxed["image_valid"]) == [16, 48]
    assert boxed["image"][:16].min() == 200 and boxed["image"][16:].max() == 0
    flex = preprocess.parse("naflex(64, 8)")({"image": image}, None)["image"]
    assert flex.shape[:2] == naflex_size(30, 90, 8, 64) == (32, 96)  # a 4 x 12 grid; the next scale gives 5 x 13 = 65
