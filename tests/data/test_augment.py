"""Augmentations as their references do them: ``random_resized_crop`` falls back as torchvision's
``RandomResizedCrop.get_params`` does; ``flip_lr`` keeps left/right in the text true."""

import numpy as np
import pytest

from vitmm.data import preprocess


@pytest.mark.parametrize("hw, crop", [((10, 200), (10, 13)), ((200, 10), (13, 10)), ((400, 600), (400, 533))])
def test_when_no_crop_fits_it_takes_torchvisions_central_crop_at_the_clamped_ratio(hw, crop):
    """With ``scale=(0.9, 1)`` no 3:4..4:3 crop fits these images: every seed takes the central
    crop (torchvision's sizes for these images), resized here to its own size to see its pixels."""
    image = (np.arange(hw[0] * hw[1]).reshape(hw) % 251).astype(np.uint8)[..., None].repeat(3, -1)
    op = preprocess.parse(f"random_resized_crop({crop}, scale=(0.9, 1.0))")
    top, left = (hw[0] - crop[0]) // 2, (hw[1] - crop[1]) // 2
    for seed in range(5):
        out = op({"image": image}, np.random.default_rng(seed))["image"]
        np.testing.assert_array_equal(out, image[top:top + crop[0], left:left + crop[1]])


def test_random_resized_crop_resamples_with_its_method():
    image = np.random.default_rng(0).integers(0, 256, (32, 32, 3), np.uint8)
    bilinear, bicubic = (preprocess.parse(f"random_resized_crop(16, method='{m}')")({"image": image},
                                                                                   np.random.default_rng(1))["image"]
                         for m in ("bilinear", "bicubic"))
    assert bilinear.shape == bicubic.shape == (16, 16, 3) and not np.array_equal(bilinear, bicubic)


def test_flip_lr_swaps_left_and_right_in_conversations_and_any_case():
    """LLaVA-style turns are text too; ``Left``/``RIGHT`` swap keeping their case; ``skip`` sees them."""
    turns = [{"from": "human", "value": "<image>\nWhere is the dog?"},
             {"from": "gpt", "value": "On the Left, not RIGHT."}]
    image = np.arange(6, dtype=np.uint8).reshape(1, 2, 3)
    flipped = preprocess.parse("flip_lr(prob=1.0)")({"image": image, "conversations": turns}, np.random.default_rng(0))
    assert flipped["conversations"][1]["value"] == "On the Right, not LEFT." and flipped["image"][0, 0, 0] == 3
    assert turns[1]["value"] == "On the Left, not RIGHT."  # the source's turns are not changed
    kept = preprocess.parse("flip_lr(prob=1.0, mode='skip')")({"image": image, "conversations": turns},
                                                                np.random.default_rng(0))
    assert kept["image"][0, 0, 0] == 0


def test_flip_lr_swaps_leftmost_and_rightward_as_it_swaps_left():
    """RefCOCO-style "the leftmost man" is as wrong after a flip as "the man on the left"; words
    that merely start with the letters (``rightly``, ``leftover``, ``bright``) stay."""
    image = np.arange(6, dtype=np.uint8).reshape(1, 2, 3)
    caption = "The LEFTMOST man looks rightwards, Rightmost leftover is rightly bright."
    out = preprocess.parse("flip_lr(prob=1.0)")({"image": image, "caption": caption}, np.random.default_rng(0))
    assert out["caption"] == "The RIGHTMOST man looks leftwards, Leftmost leftover is rightly bright."
    kept = preprocess.parse("flip_lr(prob=1.0, mode='skip')")({"image": image, "caption": "the leftmost cup"},
                                                                np.random.default_rng(0))
    assert kept["image"][0, 0, 0] == 0  # "leftmost" is seen: the example stays unflipped


def test_flip_lr_swaps_nested_captions_before_they_are_chosen():
    """COCO's captions are nested features (``captions/text``): flipped before ``choose``, the
    caption picked must be a swapped one, and ``skip`` must see them."""
    image = np.arange(6, dtype=np.uint8).reshape(1, 2, 3)
    ex = {"image": image, "captions": {"id": [7, 8], "text": [b"a dog on the left", b"a cat at left"]}}
    spec = "decode|flip_lr(prob=1.0)|choose(keys=('captions/text',), out_keys=('caption',))"
    for seed in range(4):
        out = preprocess.parse(spec)(ex, np.random.default_rng(seed))
        assert out["caption"] in ("a dog on the right", "a cat at right") and out["image"][0, 0, 0] == 3
        assert out["captions"]["id"] == [7, 8]
    kept = preprocess.parse("decode|flip_lr(prob=1.0, mode='skip')")(ex, np.random.default_rng(0))
    assert kept["image"][0, 0, 0] == 0 and kept["captions"]["text"] == ["a dog on the left", "a cat at left"]
