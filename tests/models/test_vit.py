"""The ViT: shapes, token layout, invariances, variants and parameter counts, bad input."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vitmm import tree
from vitmm.models import posemb, transformer, vit, vit_tools

TINY = dict(width=32, depth=2, mlp_dim=64, num_heads=4, patch_size=8)


def _init(model, image_hw=(32, 32), batch=2, channels=3, seed=0):
    images = jax.random.normal(jax.random.key(seed + 100), (batch, *image_hw, channels))
    return model.init(jax.random.key(seed), images), images


@pytest.mark.parametrize("num_registers", [0, 3])
def test_token_layout_and_output_shapes(num_registers):
    model = vit.ViT(**TINY, num_registers=num_registers)
    variables, images = _init(model, (32, 48))
    pooled, out = model.apply(variables, images)
    n, r = 4 * 6, num_registers
    assert out["stem"].shape == (2, 4, 6, 32)
    assert out["with_posemb"].shape == (2, 1 + r + n, 32)
    assert out["block_00"].shape == out["block_01"].shape == (2, 1 + r + n, 32)
    assert out["encoded"].shape == (2, 1 + n, 32)  # registers dropped
    assert out["patch_tokens"].shape == (2, n, 32)
    assert pooled.shape == out["pooled"].shape == (2, 32)
    np.testing.assert_array_equal(pooled, out["encoded"][:, 0])
    if r:
        assert out["registers"].shape == (2, r, 32)
    else:
        assert "registers" not in out


def test_b16_at_224_gives_197_tokens_and_384_gives_577():
    model = vit.ViT(variant="B/16")
    for size, tokens in ((224, 197), (384, 577)):
        shapes = jax.eval_shape(lambda m=model, s=size: m.init_with_output(
            jax.random.key(0), jnp.zeros((1, s, s, 3)))[0][1])
        assert shapes["encoded"].shape == (1, tokens, 768)
        assert shapes["patch_tokens"].shape == (1, tokens - 1, 768)


def test_non_square_patches_and_images():
    model = vit.ViT(**{**TINY, "patch_size": (8, 4)})
    variables, images = _init(model, (16, 40))
    _, out = model.apply(variables, images)
    assert out["stem"].shape == (2, 2, 10, 32)
    assert variables["params"]["pos_embedding"].shape == (1, 2, 10, 32)
    assert model.grid((16, 40)) == (2, 10)


def test_any_channel_count():
    model = vit.ViT(**TINY)
    variables, images = _init(model, channels=7)
    assert variables["params"]["embedding"]["kernel"].shape == (8, 8, 7, 32)
    assert model.apply(variables, images)[0].shape == (2, 32)


def test_cls_and_registers_broadcast_without_leakage_between_examples():
    model = vit.ViT(**TINY, num_registers=2, posemb="sincos2d")
    variables, images = _init(model)
    _, out = model.apply(variables, images)
    seq = out["with_posemb"]
    np.testing.assert_array_equal(seq[0, :3], seq[1, :3])  # same CLS and registers for everyone
    np.testing.assert_allclose(seq[0, 0], variables["params"]["cls"][0, 0])
    np.testing.assert_allclose(seq[0, 1:3], variables["params"]["registers"][0])  # no position added
    # Changing example 1 leaves example 0's outputs exactly as they were.
    images2 = images.at[1].set(jax.random.normal(jax.random.key(7), images.shape[1:]))
    pooled2, out2 = model.apply(variables, images2)
    np.testing.assert_allclose(out2["encoded"][0], out["encoded"][0], atol=1e-6)
    assert not np.allclose(out2["encoded"][1], out["encoded"][1])


def test_posemb_layouts_are_equivalent_when_cls_position_is_folded_into_cls():
    cls_layout = vit.ViT(**TINY, posemb_layout="with_cls")
    variables, images = _init(cls_layout)
    params = variables["params"]
    assert params["pos_embedding"].shape == (1, 4, 4, 32) and params["cls_pos_embedding"].shape == (1, 1, 32)
    folded = {k: v for k, v in params.items() if k != "cls_pos_embedding"}
    folded["cls"] = params["cls"] + params["cls_pos_embedding"]
    a = cls_layout.apply(variables, images)[0]
    b = vit.ViT(**TINY).apply({"params": folded}, images)[0]
    np.testing.assert_allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("posemb_type", ["learn", "sincos2d", "rope2d", "none"])
@pytest.mark.parametrize("pool", ["tok", "gap", "map", "none"])
def test_every_posemb_and_pool_runs(posemb_type, pool):
    model = vit.ViT(**TINY, posemb=posemb_type, pool=pool, num_registers=1)
    variables, images = _init(model)
    pooled, out = model.apply(variables, images)
    assert pooled.shape == ((2, 32) if pool != "none" else (2, 17, 32))
    assert np.all(np.isfinite(pooled))
    has_table = "pos_embedding" in variables["params"]
    assert has_table == (posemb_type == "learn")


def test_map_head_runs_the_encoders_attention_implementation():
    from vitmm.models.attention import Attention

    seen = []

    def spy(next_fun, args, kwargs, context):
        if isinstance(context.module, Attention) and context.method_name == "__call__":
            seen.append(("/".join(context.module.scope.path), context.module.implementation))
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(spy):
        _init(vit.ViT(**TINY, pool="map", class_token=False, attn_impl="xla"))
    assert ("map_head/attn", "xla") in seen and all(impl == "xla" for _, impl in seen), seen


def test_gap_pools_patch_tokens_only():
    model = vit.ViT(**TINY, pool="gap", num_registers=2)
    variables, images = _init(model)
    pooled, out = model.apply(variables, images)
    np.testing.assert_allclose(pooled, out["patch_tokens"].mean(axis=1), atol=1e-6)


def test_sincos_posemb_is_added_to_patches():
    model = vit.ViT(**TINY, posemb="sincos2d", class_token=False, pool="gap")
    variables, images = _init(model)
    _, out = model.apply(variables, images)
    expected = out["stem"].reshape(2, 16, 32) + posemb.sincos_2d(4, 4, 32)
    np.testing.assert_allclose(out["with_posemb"], expected, atol=1e-6)


def _shuffle_whole_patches(images, patch):
    """Reverses the order of whole patches on the grid; each patch's pixels stay intact."""
    b, h, w, c = images.shape
    grid = images.reshape(b, h // patch, patch, w // patch, patch, c)
    return grid[:, ::-1, :, ::-1].reshape(b, h, w, c)


@pytest.mark.parametrize("posemb_type, invariant", [("none", True), ("rope2d", False), ("learn", False)])
def test_positions_break_patch_permutation_invariance(posemb_type, invariant):
    """Without positions a GAP ViT is blind to where patches are; RoPE and tables are not."""
    model = vit.ViT(**TINY, posemb=posemb_type, pool="gap", class_token=False)
    variables, images = _init(model)
    a = model.apply(variables, images)[0]
    b = model.apply(variables, _shuffle_whole_patches(images, 8))[0]
    assert np.allclose(a, b, atol=1e-5) == invariant


def test_learned_table_resampling_for_new_resolution():
    model = vit.ViT(**TINY)
    variables, _ = _init(model, (32, 32))
    images = jax.random.normal(jax.random.key(3), (1, 48, 64, 3))
    with pytest.raises(ValueError, match=r"4x4 grid .* 6x8 patches.*resize_posemb"):
        model.apply(variables, images)
    resized = {"params": vit_tools.resize_posemb(variables["params"], (6, 8))}
    a = model.apply(resized, images)[0]
    b = vit.ViT(**TINY, dynamic_img_size=True).apply(variables, images)[0]
    np.testing.assert_allclose(a, b, atol=1e-5)
    # Same grid: resampling is the identity.
    same = vit_tools.resize_posemb(variables["params"], (4, 4))
    np.testing.assert_array_equal(same["pos_embedding"], variables["params"]["pos_embedding"])


def test_grid_mismatch_advice_names_the_models_resampling_method():
    """Following the error's advice gives the table the model's own dynamic_img_size path makes."""
    model = vit.ViT(**TINY, posemb_resample="big_vision")
    variables, _ = _init(model, (32, 32))
    images = jax.random.normal(jax.random.key(3), (1, 48, 64, 3))
    with pytest.raises(ValueError, match=r"resize_posemb\(params, new_grid, method='big_vision'\)"):
        model.apply(variables, images)
    resized = {"params": vit_tools.resize_posemb(variables["params"], (6, 8), method="big_vision")}
    dynamic = vit.ViT(**TINY, posemb_resample="big_vision", dynamic_img_size=True)
    np.testing.assert_array_equal(model.apply(resized, images)[0], dynamic.apply(variables, images)[0])


@pytest.mark.parametrize("remat_policy", ["none", "nothing_saveable"])
def test_scan_and_loop_encoders_agree(remat_policy):
    kw = dict(**TINY, layerscale=0.1, qk_norm=True, num_registers=1)
    loop = vit.ViT(**kw)
    scan = vit.ViT(**kw, scan=True, remat_policy=remat_policy)
    variables, images = _init(loop)
    scan_params = dict(variables["params"])
    scan_params["encoder"] = transformer.stack_blocks(scan_params["encoder"])
    assert jax.tree.structure(scan_params) == jax.tree.structure(
        jax.eval_shape(scan.init, jax.random.key(0), images)["params"])
    a, out_a = jax.jit(loop.apply)(variables, images)  # one program each: eager dispatch costs seconds
    b, out_b = jax.jit(scan.apply)({"params": scan_params}, images)
    np.testing.assert_allclose(a, b, atol=1e-5)
    np.testing.assert_allclose(out_a["block_01"], out_b["block_01"], atol=1e-5)
    back = transformer.unstack_blocks(scan_params["encoder"])
    jax.tree.map(np.testing.assert_array_equal, back, variables["params"]["encoder"])
    # Gradients agree too (remat changes what is stored, never the numbers).
    # A random linear readout (a sum of squares of LayerNorm-ed features is constant).
    readout = jax.random.normal(jax.random.key(5), a.shape)
    loss = lambda m, p: jnp.sum(m.apply({"params": p}, images)[0] * readout)
    ga = jax.jit(jax.grad(lambda p: loss(loop, p)))(variables["params"])
    gb = jax.jit(jax.grad(lambda p: loss(scan, p)))(scan_params)
    gb["encoder"] = transformer.unstack_blocks(gb["encoder"])
    # Gradients reach ~100 here; float32 sums in a different order agree to ~1e-5 relative.
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-4), ga, gb)


def test_bfloat16_compute_stays_close_to_float32_and_keeps_float32_params():
    kw = dict(width=64, depth=2, mlp_dim=128, num_heads=4, patch_size=8)
    f32 = vit.ViT(**kw)
    bf16 = vit.ViT(**kw, dtype_mm="bfloat16")
    variables, images = _init(f32)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(
        bf16.init(jax.random.key(0), images)))
    a = f32.apply(variables, images)[1]["encoded"]
    b = bf16.apply(variables, images)[1]["encoded"]
    assert b.dtype == jnp.float32  # residual stream and norms stay float32
    # bf16 has an 8-bit mantissa (relative step 2^-8 ≈ 0.004); after LayerNorm the features
    # have unit scale, so 0.05 absolute is a handful of bf16 steps over two blocks.
    err = float(jnp.max(jnp.abs(a - b)))
    assert 0 < err < 0.05, err
    rel = float(jnp.linalg.norm(a - b) / jnp.linalg.norm(a))
    assert rel < 0.01, rel


@pytest.mark.parametrize("pool", ["tok", "gap", "map"])
def test_bfloat16_compute_gives_a_float32_pooled_vector_for_every_pool(pool):
    model = vit.ViT(**TINY, pool=pool, dtype_mm="bfloat16")
    variables, images = _init(model)
    pooled, out = model.apply(variables, images)
    assert pooled.dtype == out["encoded"].dtype == jnp.float32


@pytest.mark.parametrize("posemb_type", ["learn", "sincos2d", "rope2d", "none"])
@pytest.mark.parametrize("stem", ["patch", "conv"])
def test_bfloat16_compute_keeps_a_float32_residual_stream_whatever_the_posemb(posemb_type, stem):
    """dtype_residual=None means float32 between blocks, also where no float32 table is added
    (rope2d, none); the stem itself still computes in bfloat16."""
    model = vit.ViT(**TINY, posemb=posemb_type, stem=stem, dtype_mm="bfloat16")
    variables, images = _init(model)
    _, out = model.apply(variables, images)
    assert out["stem"].dtype == out["with_posemb"].dtype == out["block_00"].dtype == jnp.float32
    f32 = vit.ViT(**TINY, posemb=posemb_type, stem=stem).apply(variables, images)[1]["stem"]
    bf16_stem = f32.astype(jnp.bfloat16).astype(jnp.float32)  # how far a bf16 stem may round
    assert not np.array_equal(out["stem"], f32)
    assert float(jnp.max(jnp.abs(out["stem"] - f32))) <= 4 * float(jnp.max(jnp.abs(bf16_stem - f32))) + 1e-6


@pytest.mark.parametrize("scan,layerscale", [(False, None), (True, 0.1)])
def test_bfloat16_residual_stream_stays_bfloat16_and_close(scan, layerscale):
    """dtype_residual keeps every block's output in bf16 (also through a scanned encoder and
    layerscale's float32 gamma); the final norm returns float32, close to the float32 model."""
    kw = dict(width=64, depth=2, mlp_dim=128, num_heads=4, patch_size=8, layerscale=layerscale)
    f32 = vit.ViT(**kw)
    variables, images = _init(f32)
    model = vit.ViT(**kw, dtype_mm="bfloat16", dtype_residual="bfloat16", scan=scan)
    params = variables["params"]
    if scan:
        params = {**params, "encoder": transformer.stack_blocks(params["encoder"])}
    _, out = model.apply({"params": params}, images)
    assert out["block_00"].dtype == out["block_01"].dtype == jnp.bfloat16
    a, b = f32.apply(variables, images)[1]["encoded"], out["encoded"]
    assert b.dtype == jnp.float32
    rel = float(jnp.linalg.norm(a - b) / jnp.linalg.norm(a))
    assert 0 < rel < 0.02, rel  # bf16 residual adds on top of bf16 matmuls: a few bf16 steps
    # (jitted: dtypes and finiteness are the same either way; eager dispatch of the backward costs seconds)
    grads = jax.jit(jax.grad(lambda p: model.apply({"params": p}, images)[1]["encoded"].astype(jnp.float32).sum()))(
        params)
    assert all(g.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))


def test_dropout_and_drop_path_only_in_training():
    model = vit.ViT(**TINY, dropout=0.1, drop_path_rate=0.5)
    variables, images = _init(model)
    eval_a = model.apply(variables, images)[0]
    eval_b = model.apply(variables, images, train=False)[0]
    np.testing.assert_array_equal(eval_a, eval_b)
    t1 = model.apply(variables, images, train=True, rngs={"dropout": jax.random.key(1)})[0]
    t2 = model.apply(variables, images, train=True, rngs={"dropout": jax.random.key(2)})[0]
    assert not np.allclose(t1, eval_a) and not np.allclose(t1, t2)


def test_drop_path_keeps_expectation():
    x = jnp.ones((20000, 4))
    y = transformer.drop_path(x, 0.25, jax.random.key(0))
    kept = np.asarray(y[:, 0] > 0)
    assert abs(kept.mean() - 0.75) < 0.02
    np.testing.assert_allclose(y[kept], 1 / 0.75, rtol=1e-6)
    assert abs(float(y.mean()) - 1.0) < 0.03


@pytest.mark.parametrize("traced", [False, True])
def test_drop_path_at_rate_one_drops_everything_with_zero_gradients(traced):
    """At rate 1 nothing survives: the output is 0 and so is the gradient (timm), not 0·∞ = NaN."""
    x = jnp.ones((4, 3))
    f = lambda x, rate: transformer.drop_path(x, rate, jax.random.key(0)).sum()  # noqa: E731
    rate = jnp.float32(1.0) if traced else 1.0  # the scanned encoder passes a traced rate
    value, grad = jax.value_and_grad(f)(x, rate)
    assert float(value) == 0.0
    np.testing.assert_array_equal(grad, 0.0)


@pytest.mark.parametrize("scan", [False, True])
def test_vit_with_drop_path_rate_one_has_finite_gradients(scan):
    model = vit.ViT(**TINY, drop_path_rate=1.0, scan=scan)
    variables, images = _init(model)
    grads = jax.grad(lambda p: model.apply({"params": p}, images, train=True,
                                           rngs={"dropout": jax.random.key(1)})[0].sum())(variables["params"])
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))


def test_layerscale_qknorm_stem_norm_pre_norm_create_their_params():
    model = vit.ViT(**TINY, layerscale=1e-5, qk_norm=True, stem_norm=True, pre_norm=True)
    params = _init(model)[0]["params"]
    block = params["encoder"]["block_00"]
    np.testing.assert_allclose(block["ls1"], 1e-5)
    assert {"q_norm", "k_norm"} <= set(block["attn"])
    assert {"stem_norm", "pre_norm"} <= set(params)


def test_conv_stem_and_overlapping_patches():
    conv = vit.ViT(**{**TINY, "patch_size": 8}, stem="conv")
    variables, images = _init(conv)
    assert conv.apply(variables, images)[1]["stem"].shape == (2, 4, 4, 32)
    overlap = vit.ViT(**TINY, stride=4, padding=2)
    variables, images = _init(overlap)
    assert overlap.apply(variables, images)[1]["stem"].shape == (2, 8, 8, 32)  # (32+4-8)/4+1


def test_conv_stem_honours_embed_bias_and_keeps_its_default_parameters():
    default = _init(vit.ViT(**TINY, stem="conv"))[0]["params"]["embedding"]
    assert set(default["proj"]) == {"kernel", "bias"}
    no_bias = _init(vit.ViT(**TINY, stem="conv", embed_bias=False))[0]["params"]["embedding"]
    assert set(no_bias["proj"]) == {"kernel"}
    jax.tree.map(np.testing.assert_array_equal, {k: v for k, v in default.items() if k != "proj"},
                 {k: v for k, v in no_bias.items() if k != "proj"})


def test_conv_stem_names_a_wrong_channel_count_like_the_patch_stem():
    model = vit.ViT(**TINY, stem="conv")
    variables, _ = _init(model)
    with pytest.raises(ValueError, match=r"1 channels .* built for 3"):
        model.apply(variables, jnp.zeros((1, 32, 32, 1)))


def test_classifier_head_is_zero_initialised():
    model = vit.ViT(**TINY, num_classes=10)
    variables, images = _init(model)
    logits, out = model.apply(variables, images)
    assert logits.shape == (2, 10)
    np.testing.assert_array_equal(logits, 0)


# --------------------------------------------------------------------------------------------
# Variants and parameter counts.
# --------------------------------------------------------------------------------------------
# Published counts (timm, num_classes=0, learned positions covering CLS).
TIMM_COUNTS = {"Ti/16": 5_524_416, "S/16": 21_665_664, "B/16": 85_798_656, "L/16": 303_301_632}


@pytest.mark.parametrize("variant, expected", sorted(TIMM_COUNTS.items()))
def test_published_parameter_counts(variant, expected):
    assert vit_tools.count_params(vit.ViT(variant=variant, posemb_layout="with_cls")) == expected
    # big_vision layout: the same minus the CLS position.
    d = vit.decode_variant(variant).width
    assert vit_tools.count_params(vit.ViT(variant=variant)) == expected - d


def _formula(arch, grid_tokens, channels=3):
    d, m = arch.width, arch.mlp_dim
    ph, pw = arch.patch_size
    embed = ph * pw * channels * d + d
    block = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * m + m) + (m * d + d)
    return embed + d + (grid_tokens + 1) * d + arch.depth * block + 2 * d


@pytest.mark.parametrize("name", sorted(vit.VARIANTS))
def test_every_variant_builds_and_counts_its_parameters(name):
    variant = f"{name}/14"
    model = vit.ViT(variant=variant, posemb_layout="with_cls")
    arch = vit.decode_variant(variant)
    # Traced once: count_params is this eval_shape's tree.count (test_count_params_helper_matches_tree),
    # and a giant's trace takes seconds.
    shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 224, 224, 3)))["params"]
    assert tree.count(shapes) == _formula(arch, 16 * 16)
    assert shapes["encoder"][f"block_{arch.depth - 1:02d}"]["mlp"]["fc1"]["kernel"].shape == (
        arch.width, arch.mlp_dim)


def test_variant_decoding_and_overrides():
    assert vit.decode_variant("B/16") == vit.Arch(768, 12, 3072, 12, (16, 16))
    assert vit.decode_variant("S/16x8").patch_size == (16, 8)
    assert vit.ViT(variant="B/16", depth=2).arch().depth == 2
    for bad in ("X/16", "B16", "B/"):
        with pytest.raises(ValueError, match="Unknown ViT variant"):
            vit.decode_variant(bad)
    with pytest.raises(ValueError, match="explicit width"):
        vit.ViT(depth=2).arch()


def test_forward_flops_matches_the_standard_count():
    # ViT-B/16 at 224: 2·196·768·768 + 12·(24·197·768² + 4·197²·768) = 35.13 GFLOP (the
    # 17.6 GMAC usually quoted).
    flops = vit_tools.forward_flops(vit.decode_variant("B/16"), (224, 224))
    assert flops == 2 * 196 * 768 * 768 + 12 * (24 * 197 * 768**2 + 4 * 197**2 * 768)
    assert abs(flops / 1e9 - 35.13) < 0.005


# --------------------------------------------------------------------------------------------
# Bad input.
# --------------------------------------------------------------------------------------------
def test_bad_image_sizes_rank_and_channels_raise():
    model = vit.ViT(**TINY)
    variables, _ = _init(model)
    with pytest.raises(ValueError, match=r"width 30 is not a multiple of the patch width 8"):
        model.apply(variables, jnp.zeros((1, 32, 30, 3)))
    with pytest.raises(ValueError, match=r"rank 3"):
        model.apply(variables, jnp.zeros((32, 32, 3)))
    with pytest.raises(ValueError, match=r"1 channels .* built for 3"):
        model.apply(variables, jnp.zeros((1, 32, 32, 1)))
    padded = vit.ViT(**TINY, size_policy="pad", dynamic_img_size=True)
    assert padded.apply(variables, jnp.zeros((1, 30, 30, 3)))[0].shape == (1, 32)
    assert padded.grid((36, 20)) == (5, 3)  # the grid the padded stem makes (what a VLM counts its tokens from)
    assert padded.apply(variables, jnp.zeros((1, 36, 20, 3)))[1]["stem"].shape[1:3] == (5, 3)
    with pytest.raises(ValueError, match=r"height 36 is not a multiple of the patch height 8"):
        model.grid((36, 20))


@pytest.mark.parametrize(
    "kwargs, message",
    [(dict(pool="tok", class_token=False), "class_token=True"),
     (dict(pool="avg"), "Unknown pool='avg'"),
     (dict(posemb="sincos"), "Unknown posemb='sincos'"),
     (dict(posemb_layout="with_cls", class_token=False, pool="gap"), "needs class_token"),
     (dict(posemb_layout="with_cls", posemb="sincos2d"), r"posemb_layout='with_cls' .* posemb='sincos2d'"),
     (dict(posemb_layout="with_cls", posemb="rope2d"), r"posemb_layout='with_cls' .* posemb='rope2d'"),
     (dict(posemb_layout="with_cls", posemb="none"), r"posemb_layout='with_cls' .* posemb='none'"),
     (dict(num_heads=5), "not divisible"),
     (dict(remat_policy="everything"), "Unknown remat_policy"),
     (dict(stem="conv", stride=4), r"stem='conv' .* takes no stride=4"),
     (dict(embed_impl="bogus"), "Unknown embed_impl='bogus'"),
     (dict(size_policy="pad_to_fit"), "Unknown size_policy='pad_to_fit'"),
     (dict(stem="conv", size_policy="pad_to_fit"), "Unknown size_policy='pad_to_fit'"),
     (dict(stem_channels=(8, 16, 32)), r"stem_channels=\(8, 16, 32\) are the conv stem's")],
)
def test_bad_options_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        _init(vit.ViT(**{**TINY, **kwargs}))


def test_count_params_helper_matches_tree():
    model = vit.ViT(**TINY)
    variables, _ = _init(model)
    assert vit_tools.count_params(model, (32, 32)) == tree.count(variables["params"])
    assert isinstance(model, nn.Module)


def test_openai_clip_vision_tower_layout_counts_like_open_clip():
    """OpenAI/open_clip ViT-B/16 visual tower: no patch bias, positions over CLS, LayerNorm before
    the encoder, a 768→512 projection without bias: 86,192,640 parameters."""
    model = vit.ViT(variant="B/16", embed_bias=False, posemb_layout="with_cls", pre_norm=True, norm_eps=1e-5)
    params = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 224, 224, 3)))["params"]  # count_params'
    assert tree.count(params) == 86_192_640 - 768 * 512
    assert set(params["embedding"]) == {"kernel"}
