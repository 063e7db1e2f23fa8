"""Images at the edges: transparency as each reference handles it, arrays of other dtypes, and
images no model can take counted as bad examples. Expected pixels are transformers 5.x's
``convert_to_rgb`` (``image_transforms``), computed once and stored here."""

import io

import numpy as np
import pytest
from PIL import Image

from vitmm.data import images, preprocess

# RGBA pixels: opaque red, transparent red, half-transparent red, a 77/255-opaque green
RGBA = np.array([[[200, 30, 30, 255], [200, 30, 30, 0], [200, 30, 30, 128], [10, 250, 90, 77]]], np.uint8)
HF_ON_WHITE = [[[200, 30, 30], [255, 255, 255], [227, 142, 142], [181, 253, 205]]]


def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


def test_transparent_images_go_onto_white_as_transformers_processors_do():
    """RGBA, LA and a palette's transparent colour (files and arrays) equal ``convert_to_rgb``'s."""
    white = preprocess.parse("decode(alpha='white')")
    assert white({"image": _png(Image.fromarray(RGBA, "RGBA"))}, None)["image"].tolist() == HF_ON_WHITE
    assert white({"image": RGBA}, None)["image"].tolist() == HF_ON_WHITE
    la = np.array([[[100, 0], [100, 255], [100, 200]]], np.uint8)
    assert images.decode_image(_png(Image.fromarray(la, "LA")), alpha="white")[0, :, 0].tolist() == [255, 100, 133]
    palette = Image.new("P", (2, 1))
    palette.putpalette([0, 0, 0, 9, 99, 199] + [0] * 762)
    palette.putpixel((1, 0), 1)
    palette.info["transparency"] = 0
    assert images.decode_image(_png(palette), alpha="white").tolist() == [[[255, 255, 255], [9, 99, 199]]]


def test_alpha_is_dropped_by_default_as_llava_and_open_clip_do():
    drop = preprocess.parse("decode")
    assert drop({"image": RGBA}, None)["image"].tolist() == RGBA[..., :3].tolist()
    assert drop({"image": _png(Image.fromarray(RGBA, "RGBA"))}, None)["image"].tolist() == RGBA[..., :3].tolist()
    with pytest.raises(ValueError, match="alpha='black': choose 'drop'"):
        preprocess.parse("decode(alpha='black')")


def test_chat_and_the_server_keep_transparency_for_the_runs_decode():
    """Files read at the edges (``alpha="keep"``) stay RGBA, so an imported VLM's
    ``decode(alpha='white')`` sees the alpha; opaque files stay RGB."""
    kept = images.decode_image(_png(Image.fromarray(RGBA, "RGBA")), alpha="keep")
    assert kept.shape == (1, 4, 4)
    assert preprocess.parse("decode(alpha='white')")({"image": kept}, None)["image"].tolist() == HF_ON_WHITE
    assert images.decode_image(_png(Image.fromarray(RGBA[..., :3])), alpha="keep").shape == (1, 4, 3)


def test_an_image_too_narrow_for_smart_resize_is_a_counted_skip_not_a_crash():
    """A 1×300 banner in Qwen2-VL's pp, or resized by its shorter side, is skipped under
    ``image_aspect`` by ``skips.guard``."""
    from vitmm.data import skips

    guarded = skips.guard(preprocess.parse("decode|smart_resize(16, 4096, 4)"))
    assert guarded({"image": np.zeros((1, 300, 3), np.uint8)}, np.random.default_rng(0)).reason == "image_aspect"
    assert guarded({"image": np.zeros((8, 12, 3), np.uint8)}, np.random.default_rng(0))["image"].shape == (8, 12, 3)
    shorter = skips.guard(preprocess.parse("decode|resize(336, shorter=True)"))  # not a 336×100800 array
    assert shorter({"image": np.zeros((1, 300, 3), np.uint8)}, np.random.default_rng(0)).reason == "image_aspect"


def test_arrays_of_other_dtypes_map_as_image_files_and_transformers_do():
    """uint16 arrays as 16-bit PNGs (/257), floats in [0, 1] scaled and rounded, whole-number
    floats as 0..255; anything else refused in one line."""
    gray16 = np.full((2, 2), 4112, np.uint16)  # 16 · 257
    png = io.BytesIO()
    Image.fromarray(gray16).save(png, "PNG")
    assert images.array_to_rgb(gray16)[0, 0].tolist() == images.decode_image(png.getvalue())[0, 0].tolist() == [16] * 3
    assert images.array_to_rgb(np.full((2, 2, 3), 0.7))[0, 0].tolist() == [178] * 3  # round(0.7 · 255)
    assert images.array_to_rgb(np.full((2, 2, 3), 200.0))[0, 0].tolist() == [200] * 3
    assert images.array_to_rgb(np.full((2, 2, 3), 7, np.int64))[0, 0].tolist() == [7] * 3
    with pytest.raises(ValueError, match=r"^A float32 image with values in \[0, 254.5\]: give uint8"):
        images.array_to_rgb(np.array([[0.0, 254.5]], np.float32))
