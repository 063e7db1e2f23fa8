"""experiments/bench/packing.py's mix and its padding reference."""

import json

import numpy as np
import pytest

from experiments.bench import packing


def test_the_mix_has_its_share_of_images_and_long_answers(tmp_path):
    records = json.loads(packing.write_mix(tmp_path, 1000).read_text())
    shares = np.bincount([len(r.get("image", [])) for r in records], minlength=5) / len(records)
    want = np.array([p for _, p in packing.IMAGES_PER_EXAMPLE])
    assert np.all(np.abs(shares - want) < 4 * np.sqrt(want * (1 - want) / len(records)))  # 4 standard errors
    tags = [sum(t["value"].count("<image>") for t in r["conversations"]) for r in records]
    assert tags == [len(r.get("image", [])) for r in records]
    answers = [len(t["value"]) for r in records for t in r["conversations"] if t["from"] == "gpt"]
    assert np.median(answers) == pytest.approx(90, rel=0.2) and max(answers) > 5 * np.median(answers)


def test_padding_to_each_batch_longest():
    assert packing.longest_in_batch_share([4, 4, 4, 4], 2) == 0
    assert packing.longest_in_batch_share([1, 3], 2) == pytest.approx(1 - 4 / 6)
