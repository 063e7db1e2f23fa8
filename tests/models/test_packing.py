"""Packed sequences (NaViT): each image of a packed row gets exactly its own unpacked forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vitmm.models import packing
from vitmm.models import posemb as pe
from vitmm.models.vit import ViT

SIZES = [(8, 12), (16, 16), (12, 4), (4, 8), (20, 8)]  # pixels; patch 4: grids 2x3, 4x4, 3x1, 1x2, 5x2


def _images(seed=0, channels=3):
    rng = np.random.default_rng(seed)
    return [rng.normal(size=(h, w, channels)).astype(np.float32) for h, w in SIZES]


@pytest.mark.parametrize("method", pe.RESAMPLE_METHODS)
def test_axis_weights_at_are_the_resampling_matrices_rows(method):
    news = (1, 2, 3, 5, 7, 8, 13, 14, 16, 29)  # shrinking, growing and equal sizes for each below
    for size in (1, 3, 7, 14):
        if method == "bicubic_aa":
            refs = [np.asarray(jax.image.resize(jnp.eye(size), (size, n), "bicubic", antialias=True)).T for n in news]
        else:
            refs = [pe.resample_weights(size, n, method) for n in news]
        got = pe.axis_weights_at(size, np.repeat(news, news), np.concatenate([np.arange(n) for n in news]), method)
        for n, ref, rows in zip(news, refs, np.split(np.asarray(got), np.cumsum(news)[:-1]), strict=True):
            # torch_bicubic's matrix contracts its multiply-adds as torch's compiled kernel does
            # (float64 emulation); the traced rows compute the formula in float32: ≤ 1.1e-6 apart
            np.testing.assert_allclose(rows, ref, atol=2e-6 if method == "torch_bicubic" else 1e-6,
                                       err_msg=f"{method} {size}->{n}")
            if n == size:
                np.testing.assert_array_equal(rows, np.eye(size))


@pytest.mark.parametrize("method", pe.RESAMPLE_METHODS)
def test_resample_grid_at_reads_the_resampled_table(method):
    table = jax.random.normal(jax.random.key(0), (4, 5, 8))
    for grid in [(3, 7), (6, 2), (4, 5), (1, 1)]:
        ref = np.asarray(pe.resample_grid(table[None], grid, method)[0]).reshape(-1, 8)
        rows, cols = np.divmod(np.arange(grid[0] * grid[1]), grid[1])
        positions = jnp.stack([rows, cols], -1)
        got = pe.resample_grid_at(table, jnp.broadcast_to(jnp.array(grid), positions.shape), positions, method)
        np.testing.assert_allclose(got, ref, atol=2e-6, err_msg=f"{method} {grid}")


def test_sincos_and_rope_at_positions_are_bit_equal_to_the_grid_tables():
    for h, w in [(3, 5), (7, 2)]:
        rows, cols = np.divmod(np.arange(h * w), w)
        positions = jnp.stack([rows, cols], -1)
        for convention in pe.SINCOS_CONVENTIONS:
            np.testing.assert_array_equal(pe.sincos_2d_at(positions, 16, 9, convention=convention),
                                          pe.sincos_2d(h, w, 16, convention=convention))
        np.testing.assert_array_equal(pe.rope_2d_angles_at(positions, 8, 9, 10.0), pe.rope_2d_angles(h, w, 8, 10.0))


def test_pack_lays_out_images_and_unpack_restores_their_order():
    images = _images()
    batch = packing.pack(images, 4, seq_len=20, max_images=3)
    # first fit of lengths 7, 17, 4, 3, 11 into rows of 20: [0, 2, 3], [1], [4]
    np.testing.assert_array_equal(batch.image_ids, [[0, 2, 3], [1, -1, -1], [4, -1, -1]])
    np.testing.assert_array_equal(batch.segment_ids[0], [1] * 7 + [2] * 4 + [3] * 3 + [0] * 6)
    np.testing.assert_array_equal(batch.kinds[0, :8], [packing.CLS] + [packing.PATCH] * 6 + [packing.CLS])
    np.testing.assert_array_equal(batch.positions[0, 1:7], [[0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [1, 2]])
    np.testing.assert_array_equal(batch.grids[0], [[2, 3], [3, 1], [1, 2]])
    # patch (1, 2) of image 0: rows 4..8, cols 8..12, flattened (row, col, channel)
    np.testing.assert_array_equal(batch.patches[0, 6], images[0][4:8, 8:12].reshape(-1))
    assert batch.padding_fraction() == pytest.approx((6 + 3 + 9) / 60)
    assert [v.item() for v in packing.unpack(np.arange(9).reshape(3, 3), batch)] == [0, 3, 1, 2, 6]
    regs = packing.pack(images[:1], 4, seq_len=10, max_images=1, class_token=False, num_registers=2)
    np.testing.assert_array_equal(regs.kinds[0, :3], [packing.FIRST_REGISTER, packing.FIRST_REGISTER + 1, 0])


def test_pack_errors_name_the_fix():
    with pytest.raises(ValueError, match="Item 1 needs 17 tokens.*seq_len=16"):
        packing.first_fit([7, 17], 16, 4)
    with pytest.raises(ValueError, match="not a multiple of the patch"):
        packing.pack([np.zeros((6, 8, 3))], 4, 16, 2)
    with pytest.raises(ValueError, match=r"\[H, W, C\] images with one channel count"):
        packing.pack([np.zeros((8, 8, 3)), np.zeros((8, 8, 1))], 4, 16, 2)
    no_cls = ViT(width=16, depth=1, mlp_dim=32, num_heads=2, patch_size=4, posemb="sincos2d", class_token=False,
                 pool="gap")
    params = no_cls.init(jax.random.key(0), jnp.zeros((1, 8, 8, 3)))
    with pytest.raises(ValueError, match=r"token kinds \[1\] but this model has class_token=False"):
        no_cls.apply(params, packing.pack(_images()[:1], 4, 8, 1))  # packed with a CLS slot
    with pytest.raises(ValueError, match="posemb_grid"):
        ViT(width=16, depth=1, mlp_dim=32, num_heads=2, patch_size=4).init(
            jax.random.key(0), packing.pack(_images()[:1], 4, 8, 1))


CASES = [dict(posemb=p, pool=q) for p in ("learn", "sincos2d", "rope2d", "none") for q in ("tok", "gap", "map")]
CASES += [dict(posemb="learn", posemb_layout="with_cls", num_registers=2, pool="tok", posemb_resample="torch_bicubic"),
          dict(posemb="rope2d", num_registers=1, class_token=False, pool="map", fc_norm=True, num_classes=5),
          dict(posemb="learn", pool="gap", pre_norm=True, scan=True, posemb_resample="big_vision")]


@pytest.mark.parametrize("posemb", ["sincos2d", "rope2d", "none"])
def test_packed_bfloat16_compute_keeps_a_float32_residual_stream(posemb):
    model = ViT(width=32, depth=1, mlp_dim=64, num_heads=2, patch_size=4, posemb=posemb, dtype_mm="bfloat16")
    batch = packing.pack(_images(1)[:3], 4, seq_len=24, max_images=3)
    params = model.init(jax.random.key(0), batch)["params"]
    _, out = model.apply({"params": params}, batch)
    assert out["stem"].dtype == out["block_00"].dtype == jnp.float32


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{v}" for v in c.values()))
def test_packed_forward_equals_each_images_own_forward(case):
    model = ViT(width=32, depth=2 if case.get("scan") else 1, mlp_dim=64, num_heads=2, patch_size=4,
                dynamic_img_size=True, posemb_grid=(3, 3), **case)
    images = _images(1)[:3]  # grids 2x3, 4x4 (the table's 3x3 resampled both ways) and 3x1: two rows
    batch = packing.pack(images, 4, seq_len=24, max_images=3, class_token=model.class_token,
                         num_registers=model.num_registers)
    params = model.init(jax.random.key(0), batch)["params"]
    pooled, out = jax.jit(model.apply)({"params": params}, batch)
    assert pooled.shape[:2] == (batch.segment_ids.shape[0], 3)
    per_image = packing.unpack(pooled, batch)
    last = f"block_{model.arch().depth - 1:02d}"
    apply = jax.jit(model.apply)  # one program an image size: eager dispatch costs seconds
    for i, image in enumerate(images):
        ref, ref_out = apply({"params": params}, image[None])
        np.testing.assert_allclose(per_image[i], ref[0], atol=3e-5, rtol=1e-5, err_msg=f"image {i}")
        (r, k), = np.argwhere(np.asarray(batch.image_ids) == i)
        span = np.asarray(batch.segment_ids[r]) == k + 1
        np.testing.assert_allclose(out[last][r][span], ref_out[last][0], atol=3e-5, rtol=1e-5)


def test_packed_params_are_the_unpacked_models_and_padding_changes_nothing():
    model = ViT(width=32, depth=1, mlp_dim=64, num_heads=2, patch_size=4, posemb_grid=(3, 3), pool="gap")
    images = _images(2)
    unpacked_init = model.init(jax.random.key(0), jnp.zeros((1, 12, 12, 3)))["params"]
    packed_init = model.init(jax.random.key(0), packing.pack(images, 4, 24, 3))["params"]
    assert jax.tree.map(jnp.shape, unpacked_init) == jax.tree.map(jnp.shape, packed_init)
    np.testing.assert_array_equal(unpacked_init["pos_embedding"], packed_init["pos_embedding"])
    apply = jax.jit(model.apply)  # one program a row length: eager dispatch costs seconds
    short, _ = apply({"params": unpacked_init}, packing.pack(images, 4, 24, 3))
    long, _ = apply({"params": unpacked_init}, packing.pack(images, 4, 40, 3, rows=[[0, 2, 3], [1], [4]]))
    np.testing.assert_allclose(packing.unpack(long, packing.pack(images, 4, 40, 3, rows=[[0, 2, 3], [1], [4]])),
                               packing.unpack(short, packing.pack(images, 4, 24, 3)), atol=3e-5)


@pytest.mark.parametrize("method", ["bicubic_aa", "torch_bicubic", "big_vision"])
def test_a_row_without_an_image_leaves_the_gradients_finite(method):
    """A packed row of padding only (text-only examples in a VLM's batch): its tokens' grid is
    (0, 0), and the resampled position table's gradient stays finite (a NaN there ruins a run)."""
    model = ViT(width=32, depth=1, mlp_dim=64, num_heads=2, patch_size=4, posemb_grid=(3, 3), pool="gap",
                posemb_resample=method)
    batch = packing.pack(_images(1), 4, 24, 2, rows=[[0], []])
    params = model.init(jax.random.key(0), batch)["params"]
    grads = jax.grad(lambda p: jnp.sum(model.apply({"params": p}, batch)[1]["encoded"][0] ** 2))(params)
    assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(grads))
    assert float(jnp.abs(grads["pos_embedding"]).max()) > 0


@pytest.mark.parametrize("posemb", ["learn", "sincos2d", "rope2d"])
def test_flip_patch_dropout_is_the_forward_of_the_kept_patches(posemb):
    """Dropping patches (FLIP) equals packing only the kept patches at their grid positions."""
    model = ViT(width=32, depth=2, mlp_dim=64, num_heads=2, patch_size=4, posemb=posemb, pool="map",
                patch_keep=0.4)
    images = np.stack(_images(3)[1:2] * 2)  # two 16x16 images: 16 patches, 6 kept each
    params = model.init(jax.random.key(0), images)["params"]
    apply = jax.jit(model.apply, static_argnames="train")  # one program each: eager dispatch costs seconds
    pooled, out = apply({"params": params}, images, train=True, rngs={"dropout": jax.random.key(5)})
    _, full = apply({"params": params}, images)
    assert out["with_posemb"].shape == (2, 1 + 6, 32)
    for b in range(2):
        # which patches were kept: the rows of the full forward's input that the dropped one has
        match = np.isclose(np.asarray(out["with_posemb"][b, 1:, None]), np.asarray(full["with_posemb"][b, None, 1:]))
        kept = np.argwhere(match.all(-1))[:, 1]
        assert len(kept) == 6 and np.all(np.diff(kept) > 0)  # distinct, in raster order
        batch = packing.pack(images[b:b + 1], 4, seq_len=18, max_images=1)  # 1 + 16 tokens, one padding
        keep = np.r_[0, 1 + kept, 17]  # CLS, the kept patches, the padding slot
        sub = packing.Packed(**{k: np.asarray(v)[:, keep] if k not in ("grids", "image_ids") else np.asarray(v)
                                for k, v in vars(batch).items()})
        ref, _ = apply({"params": params}, sub)
        np.testing.assert_allclose(pooled[b], ref[0, 0], atol=3e-5, rtol=1e-5)
    other, _ = apply({"params": params}, images, train=True, rngs={"dropout": jax.random.key(6)})
    assert not np.allclose(other, pooled)  # another draw keeps other patches
    with pytest.raises(ValueError, match="patch_keep"):
        ViT(width=32, depth=1, mlp_dim=64, num_heads=2, patch_size=4, patch_keep=0.0).init(jax.random.key(0), images)
