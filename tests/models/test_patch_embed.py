"""Patch embedding: token counts, conv == unfold+linear, raster order, bad sizes."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vitmm.models import patch_embed as pe_lib
from vitmm.models.patch_embed import ConvStem, PatchEmbed, grid_size, unfold_patches


@pytest.mark.parametrize(
    "image_hw, patch, expected",
    [((224, 224), 16, (14, 14)), ((384, 384), 16, (24, 24)), ((224, 224), 14, (16, 16)),
     ((64, 96), (16, 8), (4, 12)), ((30, 20), (10, 5), (3, 4)), ((32, 32), 32, (1, 1))],
)
def test_grid_is_image_over_patch(image_hw, patch, expected):
    assert grid_size(image_hw, patch) == expected
    ph, pw = pe_lib.to_pair(patch)
    assert expected[0] * expected[1] == (image_hw[0] // ph) * (image_hw[1] // pw)


def test_384_over_16_gives_576_patches():
    assert np.prod(grid_size((384, 384), 16)) == 576


def test_raster_patch_order_single_channel():
    image = jnp.arange(32 * 32, dtype=jnp.float32).reshape(1, 32, 32, 1)
    patches = unfold_patches(image, 4)
    assert patches.shape == (1, 8, 8, 16)
    np.testing.assert_array_equal(
        patches[0, 0, 0], [0, 1, 2, 3, 32, 33, 34, 35, 64, 65, 66, 67, 96, 97, 98, 99]
    )
    # Second patch in raster order is the one to the right, then the next row of patches.
    np.testing.assert_array_equal(patches[0, 0, 1, :4], [4, 5, 6, 7])
    np.testing.assert_array_equal(patches[0, 1, 0, :4], [128, 129, 130, 131])


def test_raster_patch_order_first_channel_of_rgb():
    plane = np.arange(32 * 32, dtype=np.float32).reshape(32, 32)
    image = jnp.asarray(np.stack([plane, -plane, plane + 0.5], axis=-1)[None])
    first = unfold_patches(image, 4)[0, 0, 0]
    np.testing.assert_array_equal(first[0::3], [0, 1, 2, 3, 32, 33, 34, 35, 64, 65, 66, 67, 96, 97, 98, 99])
    np.testing.assert_array_equal(first[1::3], -first[0::3])


@pytest.mark.parametrize(
    "image_hw, channels, patch, stride, padding",
    [
        ((32, 32), 3, 8, None, 0),
        ((24, 40), 5, (4, 8), None, 0),  # non-square image and patch, 5 channels
        ((32, 32), 1, 8, 4, 2),  # overlapping patches with padding
        ((22, 28), 2, (6, 4), (3, 2), (1, 1)),  # overlapping, non-square everything
    ],
)
def test_conv_equals_unfold_linear(image_hw, channels, patch, stride, padding):
    images = jax.random.normal(jax.random.key(0), (2, *image_hw, channels))
    conv = PatchEmbed(24, patch, stride, padding, impl="conv")
    unfold = PatchEmbed(24, patch, stride, padding, impl="unfold")
    params = conv.init(jax.random.key(1), images)
    params = jax.tree.map(lambda p: p + jax.random.normal(jax.random.key(2), p.shape), params)  # nonzero bias
    a = conv.apply(params, images)
    b = unfold.apply(params, images)
    assert a.shape == (2, *grid_size(image_hw, patch, stride, padding), 24)
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
    # The unfold path is exactly "flatten patch, multiply by the flattened kernel".
    flat = unfold_patches(images, patch, stride, padding)
    manual = flat @ params["params"]["kernel"].reshape(-1, 24) + params["params"]["bias"]
    np.testing.assert_allclose(a, manual, atol=1e-5, rtol=1e-5)


def test_init_is_trunc_normal_002_with_zero_bias():
    params = PatchEmbed(256, 16).init(jax.random.key(0), jnp.zeros((1, 32, 32, 3)))["params"]
    kernel = np.asarray(params["kernel"])
    assert kernel.shape == (16, 16, 3, 256)
    assert np.all(params["bias"] == 0)
    # N(0, .02²) truncated at ±2σ: std = .02·sqrt(1 - 4φ(2)/(Φ(2) - Φ(-2))) ≈ .017593 (not timm's
    # effectively untruncated .02). 196,608 draws: the std's standard error is ~3e-5.
    truncated_std = 0.02 * np.sqrt(1 - 4 * np.exp(-2) / np.sqrt(2 * np.pi) / math.erf(2 / np.sqrt(2)))
    assert abs(kernel.std() - truncated_std) < 2e-4, kernel.std()
    assert abs(kernel.mean()) < 2e-4
    assert 0.039 < np.abs(kernel).max() <= 0.04 + 1e-6  # draws reach the ±2σ bound, never past it


@pytest.mark.parametrize("impl", ["conv", "unfold"])
def test_size_not_multiple_of_patch_raises_with_both_sizes(impl):
    images = jnp.zeros((1, 225, 224, 3))
    with pytest.raises(ValueError, match=r"height 225 .* patch height 16.*size_policy='pad'"):
        PatchEmbed(8, 16, impl=impl).init(jax.random.key(0), images)


def test_pad_policy_pads_bottom_right_and_keeps_every_pixel():
    images = jnp.ones((1, 20, 30, 3))
    out = PatchEmbed(8, 16, size_policy="pad").init_with_output(jax.random.key(0), images)[0]
    assert out.shape == (1, 2, 2, 8)
    padded = pe_lib.pad_to_fit(images, (16, 16), (16, 16), (0, 0))
    assert padded.shape == (1, 32, 32, 3)
    np.testing.assert_array_equal(padded[:, :20, :30], images)
    assert float(padded.sum()) == float(images.sum())


def test_bad_rank_and_channels_raise():
    model = PatchEmbed(8, 4)
    params = model.init(jax.random.key(0), jnp.zeros((1, 8, 8, 3)))
    with pytest.raises(ValueError, match=r"\[B, H, W, C\].*rank 3"):
        model.apply(params, jnp.zeros((8, 8, 3)))
    with pytest.raises(ValueError, match="4 channels.*built for 3"):
        model.apply(params, jnp.zeros((1, 8, 8, 4)))


def test_overlapping_stride_that_does_not_fit_raises():
    assert grid_size((32, 32), 8, stride=3) == (9, 9)  # (32 - 8) / 3 + 1
    with pytest.raises(ValueError, match="stride 5.*height 33"):
        grid_size((32, 32), 8, stride=5)


def test_conv_stem_matches_patch_grid():
    images = jnp.zeros((2, 64, 32, 3))
    out, params = ConvStem(48, 16).init_with_output(jax.random.key(0), images)
    assert out.shape == (2, 4, 2, 48)
    assert len([k for k in params["params"] if k.startswith("conv_")]) == 4
    with pytest.raises(ValueError, match="power-of-two"):
        ConvStem(48, 14).init(jax.random.key(0), jnp.zeros((1, 56, 56, 3)))


def test_conv_stem_refuses_an_unknown_size_policy():
    with pytest.raises(ValueError, match="Unknown size_policy='pad_to_fit'"):
        ConvStem(48, 16, size_policy="pad_to_fit").init(jax.random.key(0), jnp.zeros((1, 32, 32, 3)))


def test_trunc_normal_draws_the_same_numbers_as_flax_for_conv_kernels():
    import flax.linen as nn

    from vitmm.models import common

    flax_init = nn.initializers.truncated_normal(stddev=0.02)
    for shape in [(8, 16), (3, 3, 3, 6), (2, 5, 7)]:
        want = flax_init(jax.random.key(3), shape)
        got = common.trunc_normal(0.02)(jax.random.key(3), shape)
        assert got.shape == shape
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_pi_resized_kernel_gives_each_upsampled_patch_its_original_token():
    # FlexiViT's identity: <resize(x), ŵ> = <x, w> for every patch x when the patch grows.
    kernel = jax.random.normal(jax.random.key(0), (8, 8, 3, 16))
    patches = jax.random.normal(jax.random.key(1), (5, 8, 8, 3))
    for new in (16, (12, 24)):
        nh, nw = pe_lib.to_pair(new)
        big = jax.image.resize(patches, (5, nh, nw, 3), "bilinear")  # each patch on its own (batch axis kept)
        new_kernel = pe_lib.resize_kernel(kernel, new)
        assert new_kernel.shape == (nh, nw, 3, 16)
        np.testing.assert_allclose(jnp.einsum("bhwc,hwcd->bd", big, new_kernel),
                                   jnp.einsum("bhwc,hwcd->bd", patches, kernel), rtol=1e-4, atol=1e-4)


def test_pi_resize_to_a_smaller_patch_is_the_least_squares_fit():
    kernel = jax.random.normal(jax.random.key(0), (8, 8, 1, 4))
    small = pe_lib.resize_kernel(kernel, 4)
    basis = jnp.eye(64).reshape(64, 8, 8)
    resize = lambda e: jax.image.resize(e, (4, 4), "bilinear", antialias=False)  # noqa: E731 - big_vision's
    rt = np.asarray(jax.vmap(resize)(basis)).reshape(64, 16)
    residual = rt @ np.asarray(small).reshape(16, 4) - np.asarray(kernel).reshape(64, 4)
    np.testing.assert_allclose(rt.T @ residual, 0.0, atol=1e-4)  # normal equations: residual ⟂ range(Rᵀ)
    assert np.linalg.norm(residual) > 1e-2  # a real fit, not an identity
