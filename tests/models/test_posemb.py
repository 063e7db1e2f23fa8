"""Position embeddings: sin-cos formula, resampling (each source's, against the source's own
outputs) and its invariances, RoPE relative property."""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.ndimage

from vitmm.models import posemb

TORCH_RESAMPLE = pathlib.Path(__file__).resolve().parents[1] / "fixtures/interop/torch_resample/io.npz"


def _written_formula(h, w, dim, temperature, denom):
    """The table written out element by element, as in the sincos_2d docstring."""
    q = dim // 4
    table = np.zeros((h * w, dim))
    for r in range(h):
        for c in range(w):
            for k in range(q):
                omega = temperature ** (-k / denom)
                table[r * w + c, k] = np.sin(c * omega)
                table[r * w + c, q + k] = np.cos(c * omega)
                table[r * w + c, 2 * q + k] = np.sin(r * omega)
                table[r * w + c, 3 * q + k] = np.cos(r * omega)
    return table


@pytest.mark.parametrize("convention, denom_of_q", [("big_vision", lambda q: q - 1), ("mae", lambda q: q)])
@pytest.mark.parametrize("h, w, dim", [(4, 4, 16), (3, 5, 24), (2, 7, 8)])
def test_sincos_equals_written_formula(convention, denom_of_q, h, w, dim):
    got = posemb.sincos_2d(h, w, dim, convention=convention)
    assert got.shape == (h * w, dim) and got.dtype == jnp.float32
    np.testing.assert_allclose(got, _written_formula(h, w, dim, 10_000.0, denom_of_q(dim // 4)), atol=1e-6)


def test_mocov3_table_is_the_mae_table_with_its_halves_swapped_not_big_visions():
    """MoCo v3's build_2d_sincos_position_embedding, written in numpy (meshgrid 'ij' over (w, h))."""
    h = w = 4
    dim, q = 32, 8
    grid_w, grid_h = np.meshgrid(np.arange(w, dtype=np.float64), np.arange(h, dtype=np.float64), indexing="ij")
    omega = 1.0 / 10_000.0 ** (np.arange(q) / q)
    out_w, out_h = np.outer(grid_w.reshape(-1), omega), np.outer(grid_h.reshape(-1), omega)
    mocov3 = np.concatenate([np.sin(out_w), np.cos(out_w), np.sin(out_h), np.cos(out_h)], axis=1)
    mae = np.asarray(posemb.sincos_2d(h, w, dim, convention="mae"))
    np.testing.assert_allclose(np.concatenate([mae[:, dim // 2:], mae[:, :dim // 2]], axis=1), mocov3, atol=1e-6)
    for convention in posemb.SINCOS_CONVENTIONS:
        assert np.abs(np.asarray(posemb.sincos_2d(h, w, dim, convention=convention)) - mocov3).max() > 0.1


def test_sincos_is_deterministic_and_encodes_rows_and_cols_separately():
    a, b = posemb.sincos_2d(3, 5, 32), posemb.sincos_2d(3, 5, 32)
    np.testing.assert_array_equal(a, b)
    grid = np.asarray(a).reshape(3, 5, 32)
    # First half depends on the column only, second half on the row only.
    np.testing.assert_allclose(grid[:, :, :16], np.broadcast_to(grid[:1, :, :16], (3, 5, 16)))
    np.testing.assert_allclose(grid[:, :, 16:], np.broadcast_to(grid[:, :1, 16:], (3, 5, 16)))
    # Position (0, 0) is [0..0, 1..1, 0..0, 1..1].
    np.testing.assert_array_equal(grid[0, 0], np.repeat([0.0, 1.0, 0.0, 1.0], 8))


def test_sincos_rejects_width_not_multiple_of_4():
    with pytest.raises(ValueError, match="dim=30"):
        posemb.sincos_2d(4, 4, 30)


@pytest.mark.parametrize("method", posemb.RESAMPLE_METHODS)
@pytest.mark.parametrize("new_grid", [(7, 7), (20, 12), (3, 9), (1, 1)])
def test_resampled_constant_field_stays_constant(new_grid, method):
    table = jnp.full((1, 10, 6, 8), 0.37)
    out = posemb.resample_grid(table, new_grid, method)
    assert out.shape == (1, *new_grid, 8)
    np.testing.assert_allclose(out, 0.37, atol=1e-6)


@pytest.mark.parametrize("method, antialias", [("torch_bicubic", False), ("bicubic_aa", True)])
def test_modes_reproduce_torch_interpolate(method, antialias):
    """Against ``F.interpolate(mode="bicubic", align_corners=False, antialias=...)``'s stored
    outputs: up, down, square and not. Tolerance: 1e-6 of the table's largest value (measured
    4.1e-7 without and 4.6e-7 with anti-aliasing: float32 summation order; torch_bicubic's weights
    are contracted as torch's FMA-compiled kernel computes them, without which it was 1.3e-6).
    Without anti-aliasing torch is a different function (a = -0.75), ~1e-2 away."""
    ref = np.load(TORCH_RESAMPLE)
    name = "torch_bicubic_aa" if antialias else "torch_bicubic"
    for i, (h, w, nh, nw) in enumerate(ref["cases"]):
        table = jnp.asarray(ref[f"in_{i}"])
        got, want = np.asarray(posemb.resample_grid(table, (nh, nw), method)), ref[f"{name}_{i}"]
        assert got.shape == want.shape
        scale = np.abs(want).max()
        assert np.abs(got - want).max() <= 1e-6 * scale, (i, (h, w, nh, nw))
        if (h, w) != (nh, nw) and not antialias:
            other = np.asarray(posemb.resample_grid(table, (nh, nw), "bicubic_aa"))
            assert np.abs(other - want).max() > 1e-3 * scale


@pytest.mark.parametrize("old, new", [((4, 4), (6, 5)), ((7, 5), (3, 2)), ((16, 16), (5, 7)), ((3, 8), (9, 1))])
def test_big_vision_mode_is_scipy_zoom_order_1(old, new):
    """big_vision's ``resample_posemb``: ``scipy.ndimage.zoom(grid, (new/old, new/old, 1), order=1)``."""
    table = np.asarray(jax.random.normal(jax.random.key(1), (1, *old, 5)))
    want = scipy.ndimage.zoom(table[0], (new[0] / old[0], new[1] / old[1], 1), order=1)
    got = np.asarray(posemb.resample_grid(jnp.asarray(table), new, "big_vision"))[0]
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)


def test_unknown_resample_method_is_named():
    with pytest.raises(ValueError, match="'nearest'.*torch_bicubic"):
        posemb.resample_grid(jnp.zeros((1, 4, 4, 2)), (2, 2), "nearest")


def test_resample_same_size_is_identity_and_smooth_field_is_preserved():
    table = jax.random.normal(jax.random.key(0), (1, 5, 7, 4))
    np.testing.assert_array_equal(posemb.resample_grid(table, (5, 7)), table)
    # A linear ramp along rows resampled 2x stays a ramp (bicubic reproduces linear functions
    # away from the edges).
    ramp = jnp.broadcast_to(jnp.arange(8.0)[None, :, None, None], (1, 8, 4, 1))
    up = np.asarray(posemb.resample_grid(ramp, (16, 4)))[0, :, 0, 0]
    np.testing.assert_allclose(np.diff(up[3:-3]), 0.5, atol=1e-5)


def test_resample_flat_keeps_prefix_and_checks_length():
    grid = jax.random.normal(jax.random.key(0), (1, 4 * 6, 8))
    cls = jnp.ones((1, 1, 8))
    flat = jnp.concatenate([cls, grid], axis=1)
    out = posemb.resample_flat_posemb(flat, (4, 6), (8, 3), num_prefix_tokens=1)
    assert out.shape == (1, 1 + 24, 8)
    np.testing.assert_array_equal(out[:, :1], cls)
    np.testing.assert_allclose(out[:, 1:].reshape(1, 8, 3, 8),
                               posemb.resample_grid(grid.reshape(1, 4, 6, 8), (8, 3)), atol=1e-6)
    with pytest.raises(ValueError, match="needs 26"):
        posemb.resample_flat_posemb(flat, (5, 5), (8, 3), num_prefix_tokens=1)


def test_rope_scores_depend_only_on_relative_position():
    h, w, hd = 4, 5, 16
    angles = posemb.rope_2d_angles(h, w, hd, theta=100.0)
    q = jax.random.normal(jax.random.key(0), (hd,))
    k = jax.random.normal(jax.random.key(1), (hd,))
    n = h * w
    rq = posemb.apply_rope(jnp.broadcast_to(q, (1, n, 1, hd)), angles)[0, :, 0]
    rk = posemb.apply_rope(jnp.broadcast_to(k, (1, n, 1, hd)), angles)[0, :, 0]
    scores = np.asarray(rq @ rk.T).reshape(h, w, h, w)
    # Same (drow, dcol) offset from two different anchors gives the same score.
    np.testing.assert_allclose(scores[0, 0, 1, 2], scores[2, 1, 3, 3], atol=1e-5)
    np.testing.assert_allclose(scores[1, 3, 0, 1], scores[3, 4, 2, 2], atol=1e-5)
    # ... and a different offset does not.
    assert abs(scores[0, 0, 1, 2] - scores[0, 0, 2, 1]) > 1e-3
    # Rotation keeps norms.
    np.testing.assert_allclose(np.linalg.norm(rq, axis=-1), np.linalg.norm(q), rtol=1e-5)


def test_rope_prefix_tokens_are_not_rotated():
    angles = posemb.rope_2d_angles(2, 2, 8, num_prefix_tokens=3)
    assert angles.shape == (3 + 4, 4)
    np.testing.assert_array_equal(angles[:3], 0)
    x = jax.random.normal(jax.random.key(0), (1, 7, 2, 8))
    np.testing.assert_allclose(posemb.apply_rope(x, angles)[:, :3], x[:, :3], atol=1e-7)
