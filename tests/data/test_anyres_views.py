"""AnyRes views on flat sequences (``input.sequences``): cut from the uint8 image and padded black,
whether the host or the device normalises."""

import numpy as np
import pytest

from vitmm.data import preprocess
from vitmm.train.sequence_layout import SequenceLayout

MEAN, STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
ANYRES = {"pinpoints": [(16, 32), (32, 16), (32, 32)], "tile": 16, "tile_grid": (2, 2), "method": "bicubic"}


def _views(layout: SequenceLayout, spec: str, image: np.ndarray) -> np.ndarray:
    ex = {"ids": np.array([1, 10, 2], np.int32), "answer_mask": np.array([0, 1, 1], np.float32),
          "image": image, "image_pos": np.int32(1)}
    return layout.sequence(preprocess.parse(spec)(ex, None))["images"]


def test_anyres_views_are_the_same_with_device_normalize_on_and_off():
    """A 10×30 image (its 32×16 tiles letterboxed): the views normalised on the host equal the
    uint8 views with the device's affine, 1e-6, and the padding is black (``-mean/std``)."""
    layout = SequenceLayout(per_image=4, length=64, max_images=5, anyres=ANYRES)
    image = np.random.default_rng(0).integers(0, 256, (10, 30, 3), np.uint8)
    spec = f"normalize({MEAN}, {STD})"
    host_spec, host_layout = layout.split_affine(spec)  # device_normalize=False: the host applies it
    on_host = _views(host_layout, host_spec, image)
    device_spec, (scale, offset) = preprocess.split_image_affine(spec)  # device_normalize=True
    device_spec, device_layout = layout.split_affine(device_spec)
    raw = _views(device_layout, device_spec, image)
    assert raw.dtype == np.uint8 and on_host.dtype == np.float32
    np.testing.assert_allclose(on_host, raw * scale + offset, atol=1e-6)
    np.testing.assert_allclose(on_host[1, 0, 0], -np.asarray(MEAN) / np.asarray(STD), atol=1e-6)
    made = preprocess.anyres_views(image, ANYRES["pinpoints"], 16, "bicubic")  # the run's method, not bilinear
    np.testing.assert_array_equal(raw, made)


def test_anyres_views_of_a_float_image_are_refused_in_one_line():
    layout = SequenceLayout(per_image=4, length=64, max_images=5, anyres=ANYRES)
    with pytest.raises(ValueError, match="float32 image: input.sequences cuts them from uint8"):
        _views(layout, "keep('image', 'ids', 'answer_mask', 'image_pos')", np.zeros((10, 30, 3), np.float32))
