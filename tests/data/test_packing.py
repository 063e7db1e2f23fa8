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
