"""Preprocessing ops and the op-string parser."""

import numpy as np
import pytest

from vitmm.data import preprocess

RNG = np.random.default_rng(0)


def _run(spec, example, seed=0):
    return preprocess.parse(spec)(example, np.random.default_rng(seed))


def test_decode_converts_text_and_grayscale_and_rgba():
    gray = np.arange(16, dtype=np.uint8).reshape(4, 4)
    out = _run("decode", {"image": gray, "caption": b"hi", "questions": [b"a?", b"b?"]})
    assert out["image"].shape == (4, 4, 3) and (out["image"][..., 2] == gray).all()
    assert out["caption"] == "hi" and out["questions"] == ["a?", "b?"]
    rgba = np.zeros((4, 4, 4), np.uint8)
    rgba[..., 3] = 255
    rgba[..., 0] = 9
    out = _run("decode", {"image": rgba})
    assert out["image"].shape == (4, 4, 3) and (out["image"][..., 0] == 9).all()
    assert _run("decode", {"image": gray[..., None]})["image"].shape == (4, 4, 3)
    with pytest.raises(ValueError, match="shape"):
        _run("decode", {"image": np.zeros((4, 4, 2), np.uint8)})


def test_resize_crop_value_range():
    image = np.random.default_rng(1).integers(0, 256, (40, 60, 3), dtype=np.uint8)
    out = _run("resize(20)|value_range(-1, 1)", {"image": image})
    assert out["image"].shape == (20, 20, 3) and out["image"].dtype == np.float32
    assert out["image"].min() >= -1 and out["image"].max() <= 1
    out = _run("center_crop((30, 40))", {"image": image})
    np.testing.assert_array_equal(out["image"], image[5:35, 10:50])
    a = _run("random_resized_crop(16)", {"image": image}, seed=3)["image"]
    b = _run("random_resized_crop(16)", {"image": image}, seed=3)["image"]
    assert a.shape == (16, 16, 3)
    np.testing.assert_array_equal(a, b)  # same rng stream, same crop
    np.testing.assert_allclose(_run("value_range(0, 1)", {"image": np.full((1, 1, 3), 255, np.uint8)})
                               ["image"], 1.0)


def test_flip_swaps_left_and_right_in_text():
    image = np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3)
    ex = {"image": image, "caption": "a star on the left", "questions": ["is it left of the box?"],
          "answers": ["yes"]}
    out = _run("flip_lr(prob=1.0)", ex)
    np.testing.assert_array_equal(out["image"], image[:, ::-1])
    assert out["caption"] == "a star on the right"
    assert out["questions"] == ["is it right of the box?"] and out["answers"] == ["yes"]
    kept = _run("flip_lr(prob=1.0, mode='skip')", ex)
    np.testing.assert_array_equal(kept["image"], image)  # mentions left: not flipped
    plain = _run("flip_lr(prob=1.0, mode='skip')", {**ex, "caption": "a star", "questions": []})
    np.testing.assert_array_equal(plain["image"], image[:, ::-1])
    never = _run("flip_lr(prob=0.0)", ex)
    assert never["caption"] == ex["caption"]


def test_tokenize_choose_keep_drop():
    ex = {"caption": "a red circle", "questions": ["q1", "q2", "q3"], "answers": ["a1", "a2", "a3"],
          "question_kinds": [0, 1, 2], "image": np.zeros((2, 2, 3), np.uint8)}
    out = _run("choose|tokenize('caption', 8)|tokenize('question', 4, out_key='q')", ex)
    i = ["q1", "q2", "q3"].index(out["question"])
    assert out["answer"] == f"a{i + 1}" and out["question_kind"] == i
    assert out["caption_tokens"].shape == (8,) and bool(out["caption_tokens_truncated"])
    assert out["q"].dtype == np.int32 and not out["q_truncated"]
    kept = _run("keep('image', 'caption')", ex)
    assert sorted(kept) == ["caption", "image"]
    assert "image" not in _run("drop('image')", ex)
    with pytest.raises(KeyError, match="has no"):
        _run("keep('nope')", ex)


def test_parser_errors_name_the_problem():
    with pytest.raises(ValueError, match="Unknown preprocessing op 'resise'.*available"):
        preprocess.parse("decode|resise(3)")
    with pytest.raises(ValueError, match="Cannot parse"):
        preprocess.parse("resize(3")
    with pytest.raises(ValueError, match="mode="):
        preprocess.parse("flip_lr(mode='mirror')")


def test_nested_caption_lists_like_coco():
    ex = {"image": np.zeros((4, 4, 3), np.uint8),
          "captions": {"id": [7, 8], "text": [b"a dog on grass", b"a brown dog"]}}
    out = _run("decode|choose(keys=('captions/text',), out_keys=('caption',))|keep('image', 'caption')", ex)
    assert out["caption"] in ("a dog on grass", "a brown dog")
    with pytest.raises(KeyError, match="captions/txt"):
        _run("decode|choose(keys=('captions/txt',), out_keys=('caption',))", ex)


def test_qa_tokens_mark_the_answer_and_keep_it_whole():
    ex = {"question": "how many stars are there?", "answer": "2"}
    out = _run("qa_tokens(40)", ex)
    ids, mask, n = out["ids"], out["answer_mask"], int(out["prompt_len"])
    text = bytes(int(i) - 1 for i in ids[1:n]).decode()
    assert ids[0] == 257 and text == "how many stars are there? "
    assert list(ids[n:n + 2]) == [ord("2") + 1, 258] and mask.sum() == 2 and mask[n] == 1 and mask[n - 1] == 0
    short = _run("qa_tokens(12)", ex)  # the question is cut, the answer and EOS stay
    assert bool(short["qa_truncated"]) and list(short["ids"][-2:]) == [ord("2") + 1, 258]
    with pytest.raises(ValueError, match="does not fit"):
        _run("qa_tokens(3)", {"question": "q", "answer": "long answer"})
    assert _run("qa_tokens(40, max_answer=2)", ex)["answer_mask"].sum() == 2  # '2' and EOS: allowed
    with pytest.raises(ValueError, match=r"'22' is 3 tokens with EOS, more than max_answer=2 .*model.loss_positions"):
        _run("qa_tokens(40, max_answer=2)", {"question": "q", "answer": "22"})


def test_resize_of_the_shorter_side_keeps_the_aspect_as_transformers_clip_processors_round_it():
    from PIL import Image

    from vitmm.data import images

    # int(16 * 25 / 20) = 20 (not 20.0 rounded up); wide and tall images alike
    assert images.shorter_side_size((25, 20), 16) == (20, 16) and images.shorter_side_size((20, 25), 16) == (16, 20)
    assert images.shorter_side_size((16, 33), 16) == (16, 33)
    image = np.random.default_rng(0).integers(0, 256, (25, 20, 3), dtype=np.uint8)
    fn = preprocess.parse("resize(16, method='bicubic', shorter=True)|center_crop(16)")
    out = fn({"image": image}, np.random.default_rng(0))["image"]
    want = np.asarray(Image.fromarray(image).resize((16, 20), Image.Resampling.BICUBIC))[2:18]
    np.testing.assert_array_equal(out, want)
    with pytest.raises(ValueError, match="method='nearest'"):
        preprocess.parse("resize(16, method='nearest')")
    with pytest.raises(ValueError, match="give the shorter side as one number"):
        preprocess.parse("resize((16, 20), shorter=True)")


@pytest.mark.parametrize("op, want", [
    ("value_range(-1, 1)", lambda x: x / 255 * 2 - 1),
    ("value_range(0, 1)", lambda x: x / 255),
    ("normalize((0.48, 0.45, 0.40), (0.27, 0.26, 0.28))",
     lambda x: (x / 255 - np.array([0.48, 0.45, 0.40])) / np.array([0.27, 0.26, 0.28])),
])
def test_the_device_affine_of_uint8_images_is_the_host_op(op, want):
    """``input.device_normalize``: ``split_image_affine``'s ``image * scale + offset`` on every uint8
    value equals the host op and the formula written out here (float64), 1e-6."""
    spec = f"{op}|keep('image')"
    host, (scale, offset) = preprocess.split_image_affine(spec)
    assert host == "keep('image')"
    image = np.repeat(np.arange(256, dtype=np.uint8)[None, :, None], 3, axis=2)  # [1, 256, 3]
    on_host = preprocess.parse(spec)({"image": image}, np.random.default_rng(0))["image"]
    on_device = image.astype(np.float32) * scale + offset
    np.testing.assert_allclose(on_device, want(image.astype(np.float64)), atol=1e-6)
    np.testing.assert_allclose(on_device, on_host, atol=1e-6)


def test_a_draft_decode_shrinks_a_jpeg_by_the_largest_power_of_two_keeping_both_sides_at_least_draft():
    """A 256×192 JPEG: ``draft=64`` decodes at 1/2 (128×96; 1/4 would make its height 48), ``draft=48``
    at 1/4 (64×48); without ``draft`` and for a PNG, full size (libjpeg's DCT scaling by 1/2, 1/4, 1/8)."""
    import io

    from PIL import Image

    from vitmm.data import images

    pixels = np.random.default_rng(0).integers(0, 256, (192, 256, 3), dtype=np.uint8)

    def encoded(fmt):
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, fmt)
        return buf.getvalue()

    jpeg, png = encoded("JPEG"), encoded("PNG")
    assert images.decode_image(jpeg).shape == (192, 256, 3)
    assert images.decode_image(jpeg, draft=64).shape == (96, 128, 3)
    assert images.decode_image(jpeg, draft=48).shape == (48, 64, 3)
    np.testing.assert_array_equal(images.decode_image(png, draft=48), pixels)


def test_normalize_stays_on_the_host_when_images_are_regrouped_after_it():
    """``temporal_patch`` (two frames a 6-channel image) or ``idefics3_tiles`` after ``normalize``: a
    per-channel map on the device would meet other images than it was made for, so none is split off
    (``input.device_normalize`` then says so)."""
    for spec in ("decode|normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))|temporal_patch(2)|keep('image')",
                 "decode|normalize()|keep('image')"):
        host, affine = preprocess.split_image_affine(spec)
        assert (affine is None) == ("temporal_patch" in spec) and (host == spec) == ("temporal_patch" in spec)


def test_only_the_images_own_normalisation_moves_to_the_device_whichever_way_its_key_is_given():
    """``value_range(0, 1, 'depth')`` (key as the third argument) normalises ``depth``, not the image:
    it stays on the host, as ``key='depth'`` does, instead of the device applying it to the image."""
    for spec in ("decode|value_range(0, 1, 'depth')", "decode|normalize((0.5, 0.5, 0.5), (0.2, 0.2, 0.2), 'depth')",
                 "decode|value_range(0, 1, key='depth')"):
        assert preprocess.split_image_affine(spec) == (spec, None), spec
    host, (scale, offset) = preprocess.split_image_affine("decode|value_range(0, 1, 'image')")
    assert host == "decode" and np.allclose(scale, 1 / 255) and np.allclose(offset, 0)


def test_a_draft_decode_is_refused_before_an_op_that_sizes_the_image_from_its_own_size():
    """``decode(draft=N)`` decodes a large JPEG at 1/2-1/8 scale; ``smart_resize`` then sized the image
    from that reduced size (a 768×1024 photo came out 392×504 instead of 756×1036, a quarter of the
    visual tokens), and ``anyres`` chose its resolution from it (a 1344² photo: 1176 visual tokens
    instead of 2928): refused in one line, while a fixed-size ``resize`` after a draft decode is fine."""
    anyres = "anyres([(336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008)], 336, (24, 24))"
    for spec in ("decode(draft=224)|smart_resize(3136, 2000000, 28)", "decode('image', 1, 224)|smart_resize(4, 99, 2)",
                 f"decode(draft=224)|{anyres}"):
        with pytest.raises(ValueError, match=r"^decode\(draft=224\) decodes a JPEG at a reduced size.*"
                                             r"(smart_resize|anyres).*drop draft"):
            preprocess.parse(spec)
    preprocess.parse("decode(draft=224)|resize(224)")
    preprocess.parse("decode|smart_resize(3136, 2000000, 28)")


def test_keep_refuses_to_drop_an_examples_further_images_or_their_places():
    """``keep('image', ..., 'image_pos')`` without ``optional=('more_images', 'image_positions')`` on
    an example with several images would train it on its first image alone (its other ``<image>``
    places silently empty): one error with the fix. Dropping every image (a text model's pp) is fine."""
    ex = {"image": np.zeros((2, 2, 3), np.uint8), "more_images": [np.zeros((2, 2, 3), np.uint8)],
          "ids": np.arange(4), "image_pos": np.int32(1), "image_positions": np.array([1, 2], np.int32)}
    with pytest.raises(ValueError, match=r"keep\('image', 'ids', 'image_pos'\) drops more_images, image_positions "
                                         r".*2 images.*optional=\('more_images', 'image_positions'\)"):
        _run("keep('image', 'ids', 'image_pos')", ex)
    kept = _run("keep('image', 'ids', 'image_pos', optional=('more_images', 'image_positions'))", ex)
    assert sorted(kept) == ["ids", "image", "image_pos", "image_positions", "more_images"]
    assert sorted(_run("keep('ids')", ex)) == ["ids"]
    single = {k: v for k, v in ex.items() if k not in ("more_images", "image_positions")}
    assert sorted(_run("keep('image', 'ids', 'image_pos')", single)) == ["ids", "image", "image_pos"]
