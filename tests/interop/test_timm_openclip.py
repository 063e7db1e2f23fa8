"""timm ViTs and open_clip CLIP load into vitmm and compute what timm / open_clip compute.

Fixtures: tiny random models saved by timm 1.0 / open_clip 3.3 with their outputs
(``tests/fixtures/interop/make_fixtures.py --only timm,open_clip``; versions in
``manifest.json``). Tolerance: max abs difference ≤ 1e-4 in float32.
"""

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from parity import ATOL, FIXTURES, assert_close_relative, images, load_io, resized_hw

from vitmm.interop import openclip, timm_vit
from vitmm.models.two_towers import TwoTowers
from vitmm.models.vit import ViT

TIMM_CASES = ["timm_vit", "timm_vit_reg", "timm_vit_gap", "timm_vit_fc_norm", "timm_vit_map"]
EPS = 1e-6  # the fixtures are bare VisionTransformers: timm's LayerNorm default, also under pre_norm (timm_vit_gap)


def _timm_sequence(out, kwargs):
    """vitmm's outputs in timm's ``forward_features`` order: [CLS?, registers, patches]."""
    parts = [out["encoded"][:, :1]] if kwargs["class_token"] else []
    if kwargs["num_registers"]:
        parts.append(out["registers"])
    return jnp.concatenate([*parts, out["patch_tokens"]], axis=1)


@pytest.mark.parametrize("name", TIMM_CASES)
def test_timm_vit_matches_timm(name):
    ref, build = load_io(name), json.loads((FIXTURES / name / "build.json").read_text())
    kwargs, params = timm_vit.load_vit(FIXTURES / name / "model.safetensors", num_heads=build["num_heads"],
                                       norm_eps=EPS)
    assert kwargs["class_token"] == build.get("class_token", True)
    assert kwargs["num_registers"] == build.get("reg_tokens", 0)
    logits, out = ViT(**kwargs).apply({"params": params}, images(ref))
    np.testing.assert_allclose(np.asarray(_timm_sequence(out, kwargs)), ref["features"], atol=ATOL, rtol=0)
    np.testing.assert_allclose(np.asarray(out["pooled"]), ref["pooled"], atol=ATOL, rtol=0)
    np.testing.assert_allclose(np.asarray(logits if kwargs.get("num_classes") else out["pooled"]), ref["logits"],
                               atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", TIMM_CASES)
def test_timm_vit_at_a_non_square_resolution_matches_dynamic_img_size(name):
    """timm's ``dynamic_img_size`` (``resample_abs_pos_embed``: bicubic, anti-aliased) at 40x56 px,
    reproduced by resampling once at load and by vitmm's own ``dynamic_img_size``."""
    ref, build = load_io(name), json.loads((FIXTURES / name / "build.json").read_text())
    src = FIXTURES / name / "model.safetensors"
    kwargs, params = timm_vit.load_vit(src, num_heads=build["num_heads"], norm_eps=EPS, image_size=resized_hw(ref))
    assert kwargs["posemb_resample"] == "bicubic_aa"
    _, out = ViT(**kwargs).apply({"params": params}, images(ref, "pixel_values_resized"))
    assert_close_relative(_timm_sequence(out, kwargs), ref["features_resized"], name)
    _, at_train_size = timm_vit.load_vit(src, num_heads=build["num_heads"], norm_eps=EPS)
    _, out = ViT(**{**kwargs, "dynamic_img_size": True}).apply({"params": at_train_size},
                                                               images(ref, "pixel_values_resized"))
    assert_close_relative(_timm_sequence(out, kwargs), ref["features_resized"], name + " (dynamic)")


def test_timm_pooling_is_read_from_the_tensors():
    pools = {name: timm_vit.load_vit(FIXTURES / name / "model.safetensors", num_heads=4)[0]
             for name in ("timm_vit", "timm_vit_gap", "timm_vit_fc_norm", "timm_vit_map")}
    assert [(k["pool"], k["fc_norm"]) for k in pools.values()] == [("tok", False), ("gap", False), ("gap", True),
                                                                   ("map", False)]
    assert pools["timm_vit_gap"]["posemb_layout"] == "patches" and pools["timm_vit"]["posemb_layout"] == "with_cls"


def test_timm_refusals_name_the_reason():
    path = FIXTURES / "timm_vit" / "model.safetensors"
    with pytest.raises(ValueError, match="avgmax"):
        timm_vit.load_vit(path, num_heads=4, global_pool="avgmax")
    with pytest.raises(ValueError, match="reads CLS/register tokens"):
        timm_vit.load_vit(path, num_heads=4, global_pool="map")
    with pytest.raises(ValueError, match="not a timm VisionTransformer"):
        timm_vit.load_vit(FIXTURES / "open_clip" / "open_clip_model.safetensors")


def test_timm_wrong_head_count_changes_the_output():
    """The head count is not in the weights: a wrong one loads but computes something else."""
    ref = load_io("timm_vit")
    kwargs, params = timm_vit.load_vit(FIXTURES / "timm_vit" / "model.safetensors", num_heads=2)
    logits, _ = ViT(**kwargs).apply({"params": params}, images(ref))
    assert np.abs(np.asarray(logits) - ref["logits"]).max() > 1e-3


@pytest.fixture(scope="session")
def open_clip_out():
    ref = load_io("open_clip")
    kwargs, params = openclip.load_two_towers(FIXTURES / "open_clip" / "open_clip_model.safetensors")
    zimg, ztxt, out = TwoTowers(**kwargs).apply({"params": params}, images(ref),
                                                jnp.asarray(ref["input_ids"], jnp.int32))
    return ref, kwargs, zimg, ztxt, out


def test_open_clip_matches_open_clip(open_clip_out):
    ref, kwargs, zimg, ztxt, out = open_clip_out
    assert kwargs["image"]["act"] == "quick_gelu"  # read from open_clip_config.json beside the weights
    checks = {"image_features": zimg, "text_features": ztxt,
              "image_proj": zimg * out["img/norm"][:, None], "text_proj": ztxt * out["txt/norm"][:, None],
              "logits_per_image": out["t"] * zimg @ ztxt.T}
    for name, got in checks.items():
        np.testing.assert_allclose(np.asarray(got), ref[name], atol=ATOL, rtol=0, err_msg=name)


def test_open_clip_at_a_non_square_resolution_matches_resize_pos_embed():
    """open_clip's ``resize_pos_embed`` (bicubic, anti-aliased) into a 40x56 px model."""
    ref = load_io("open_clip")
    kwargs, params = openclip.load_two_towers(FIXTURES / "open_clip" / "open_clip_model.safetensors",
                                              image_size=resized_hw(ref))
    assert kwargs["image"]["posemb_resample"] == "bicubic_aa"
    zimg, _, out = TwoTowers(**kwargs).apply({"params": params}, images(ref, "pixel_values_resized"), None)
    assert_close_relative(zimg * out["img/norm"][:, None], ref["image_proj_resized"], "image_proj")


def test_open_clip_without_its_config_asks_for_quick_gelu(tmp_path):
    shutil.copy(FIXTURES / "open_clip" / "open_clip_model.safetensors", tmp_path)
    with pytest.raises(ValueError, match="quick_gelu"):
        openclip.load_two_towers(tmp_path / "open_clip_model.safetensors")
    kwargs, _ = openclip.load_two_towers(tmp_path / "open_clip_model.safetensors", quick_gelu=False, head_width=8,
                                         text_heads=4)
    assert kwargs["text"]["act"] == "gelu"


def test_convert_cli_takes_timm_and_open_clip(tmp_path, open_clip_out, capsys):
    from vitmm import checkpoint as ckpt_lib
    from vitmm.interop import __main__ as cli

    ref, _, zimg, _, _ = open_clip_out
    cli.main(["--from", "open_clip", "--src", str(FIXTURES / "open_clip" / "open_clip_model.safetensors"),
                  "--out", str(tmp_path / "oc")])
    config, params = ckpt_lib.load_config(tmp_path / "oc"), ckpt_lib.load_params(tmp_path / "oc")
    got, _, _ = TwoTowers(**config["model"]).apply({"params": params}, images(ref), None)
    np.testing.assert_allclose(np.asarray(got), np.asarray(zimg), atol=1e-6, rtol=0)

    cli.main(["--from", "timm", "--src", str(FIXTURES / "timm_vit_reg" / "model.safetensors"),
                  "--out", str(tmp_path / "tv"), "--num_heads", "4", "--image_size", "48"])
    config = ckpt_lib.load_config(tmp_path / "tv")
    assert config["input"]["image_size"] == 48 and config["model"]["image"]["num_registers"] == 4
    assert ckpt_lib.load_params(tmp_path / "tv")["img"]["pos_embedding"].shape == (1, 6, 6, 32)
    with pytest.raises(SystemExit, match="2"):
        cli.main(["--from", "timm", "--src", str(FIXTURES / "timm_vit" / "model.safetensors"),
                      "--out", str(tmp_path / "tt"), "--tower", "text", "--num_heads", "4"])
    assert "no text tower" in capsys.readouterr().err


def _tensors(name):
    from safetensors.numpy import load_file

    return load_file(FIXTURES / name / "model.safetensors")


def _timm_copy(tmp_path, name="timm_vit", **change):
    """A fixture's state dict in ``tmp_path`` with tensors replaced (None: removed)."""
    from safetensors.numpy import save_file

    tensors = _tensors(name)
    for key, value in change.items():
        if value is None:
            tensors.pop(key)
        else:
            tensors[key] = value
    save_file(tensors, tmp_path / "model.safetensors")
    return tmp_path / "model.safetensors"


def test_timm_without_pos_embed_is_posemb_none(tmp_path):
    """timm's ``pos_embed='none'`` adds no positions: the same function as the model with an all-zero
    table, which is what vitmm's ``posemb="none"`` computes (exactly)."""
    pos = _tensors("timm_vit")["pos_embed"]
    kwargs, params = timm_vit.load_vit(_timm_copy(tmp_path, pos_embed=None), num_heads=4, image_size=48)
    assert kwargs["posemb"] == "none" and "pos_embedding" not in params
    zeroed = tmp_path / "zeroed"
    zeroed.mkdir()
    kw_zero, p_zero = timm_vit.load_vit(_timm_copy(zeroed, pos_embed=np.zeros_like(pos)), num_heads=4)
    x = images(load_io("timm_vit"))
    np.testing.assert_array_equal(np.asarray(ViT(**kwargs).apply({"params": params}, x)[0]),
                                  np.asarray(ViT(**kw_zero).apply({"params": p_zero}, x)[0]))


def test_timm_act_and_norm_eps_come_from_config_json_or_the_options(tmp_path, capsys):
    """timm's CLIP towers: QuickGELU named by the architecture in ``config.json``, LayerNorm eps 1e-5
    where ``norm_pre`` is (timm builds those with ``nn.LayerNorm``); both can be given, in Python and
    on the command line."""
    from vitmm import checkpoint as ckpt_lib
    from vitmm.interop import __main__ as cli
    from vitmm.interop import convert

    width = _tensors("timm_vit")["cls_token"].shape[-1]
    src = _timm_copy(tmp_path, **{"norm_pre.weight": np.ones(width, np.float32),
                                  "norm_pre.bias": np.zeros(width, np.float32)})
    kwargs, _ = timm_vit.load_vit(src, num_heads=4)
    assert (kwargs["act"], kwargs["norm_eps"], kwargs["pre_norm"]) == ("gelu", 1e-5, True)
    (tmp_path / "config.json").write_text(json.dumps({"architecture": "vit_base_patch16_clip_quickgelu_224"}))
    assert timm_vit.load_vit(src, num_heads=4)[0]["act"] == "quick_gelu"
    plain = FIXTURES / "timm_vit" / "model.safetensors"
    assert timm_vit.load_vit(plain, num_heads=4)[0]["norm_eps"] == 1e-6
    model, _ = convert.load("timm", plain, num_heads=4, act="quick_gelu", norm_eps=1e-5)
    assert (model["image"]["act"], model["image"]["norm_eps"]) == ("quick_gelu", 1e-5)
    cli.main(["--from", "timm", "--src", str(plain), "--out", str(tmp_path / "out"), "--num_heads", "4",
              "--act", "quick_gelu", "--norm_eps", "1e-5"])
    written = ckpt_lib.load_config(tmp_path / "out")["model"]["image"]
    assert (written["act"], written["norm_eps"]) == ("quick_gelu", 1e-5)


@pytest.mark.parametrize("width, depth, mlp_dim, heads", [(1280, 32, 5120, 16), (1152, 27, 4304, 16),
                                                          (1408, 40, 6144, 16), (1664, 48, 8192, 16),
                                                          (768, 12, 3072, 12), (1024, 30, 4096, 16)])
def test_head_counts_of_standard_towers_are_not_width_over_64(width, depth, mlp_dim, heads):
    from vitmm.interop.common import standard_heads

    assert standard_heads(width, depth, mlp_dim, "x") == heads


@pytest.mark.parametrize("width, depth, mlp_dim, reason", [
    (1280, 20, 5120, r"other head counts than width / 64 = 20 \(ViT-H 16 heads\)"),
    (896, 12, 3584, "no standard tower of width 896")])
def test_an_unknown_tower_asks_for_its_head_count(width, depth, mlp_dim, reason):
    from vitmm.interop.common import standard_heads

    with pytest.raises(ValueError, match=rf"{reason}, with depth {depth} .*; pass num_heads"):
        standard_heads(width, depth, mlp_dim, "x", "num_heads")


def test_timm_head_count_from_config_json_or_asked_for(tmp_path):
    """The 32-wide fixture (4 heads) is no standard tower: refused rather than loaded with 32 // 64."""
    src = _timm_copy(tmp_path)
    with pytest.raises(ValueError, match=r"pass num_heads \(--num_heads\)"):
        timm_vit.load_vit(src)
    (tmp_path / "config.json").write_text(json.dumps({"architecture": "vit_tiny", "model_args": {"num_heads": 4}}))
    assert timm_vit.load_vit(src)[0]["num_heads"] == 4


def test_open_clip_head_counts_without_its_config(tmp_path, open_clip_out, capsys):
    """A bare open_clip state dict: the head counts are asked for, and given through load and the CLI
    they give open_clip's outputs."""
    from vitmm import checkpoint as ckpt_lib
    from vitmm.interop import __main__ as cli

    ref, _, zimg, ztxt, _ = open_clip_out
    shutil.copy(FIXTURES / "open_clip" / "open_clip_model.safetensors", tmp_path)
    src = tmp_path / "open_clip_model.safetensors"
    with pytest.raises(ValueError, match=r"pass head_width \(--head_width\)"):
        openclip.load(src, quick_gelu=True)
    kwargs, params = openclip.load(src, quick_gelu=True, head_width=8, text_heads=4)
    assert (kwargs["image"]["num_heads"], kwargs["text"]["num_heads"]) == (4, 4)
    got_img, got_txt, _ = TwoTowers(**kwargs).apply({"params": params}, images(ref),
                                                    jnp.asarray(ref["input_ids"], jnp.int32))
    np.testing.assert_allclose(np.asarray(got_img), np.asarray(zimg), atol=1e-6, rtol=0)
    np.testing.assert_allclose(np.asarray(got_txt), np.asarray(ztxt), atol=1e-6, rtol=0)
    cli.main(["--from", "open_clip", "--src", str(src), "--out", str(tmp_path / "oc"), "--quick_gelu", "true",
              "--head_width", "8", "--text_heads", "4"])
    assert ckpt_lib.load_config(tmp_path / "oc")["model"]["image"]["num_heads"] == 4


def _table(rows, seed=0):
    return np.random.default_rng(seed).normal(size=(1, rows, 32)).astype(np.float32)


def test_timm_non_square_grid_from_config_json_or_image_size(tmp_path):
    """A CLS model trained at 64x48 px (an 8x6 grid of 8 px patches): 1 + 48 = 49 rows, which a square
    reading takes for a 7x7 grid without CLS. Without timm's config.json the load is refused; with it,
    or with the trained image_size, the CLS row and the 8x6 grid are read."""
    pos = _table(1 + 8 * 6)
    src = _timm_copy(tmp_path, pos_embed=pos)
    with pytest.raises(ValueError, match=r"49 rows: a 7x7 grid without the 1 CLS/register rows .* or those rows "
                                         r"before a grid of 48 patches; .*--image_size HxW"):
        timm_vit.load_vit(src, num_heads=4)
    _, by_size = timm_vit.load_vit(src, num_heads=4, image_size=(64, 48))
    (tmp_path / "config.json").write_text(json.dumps({"pretrained_cfg": {"input_size": [3, 64, 48]}}))
    kwargs, params = timm_vit.load_vit(src, num_heads=4)
    assert kwargs["posemb_layout"] == "with_cls"
    np.testing.assert_array_equal(np.asarray(params["cls_pos_embedding"]), pos[:, :1])
    np.testing.assert_array_equal(np.asarray(params["pos_embedding"]), pos[:, 1:].reshape(1, 8, 6, 32))
    np.testing.assert_array_equal(np.asarray(by_size["pos_embedding"]), np.asarray(params["pos_embedding"]))
    (tmp_path / "config.json").write_text(json.dumps({"model_args": {"img_size": 40}}))
    with pytest.raises(ValueError, match="neither the 5x5 grid of config.json's image size"):
        timm_vit.load_vit(src, num_heads=4)


def test_timm_square_count_of_a_non_square_grid_follows_config_json(tmp_path):
    """No CLS, 16x9 patches = 144 rows: a 12x12 grid to the eye, 16x9 by timm's config.json."""
    pos = _table(16 * 9)
    src = _timm_copy(tmp_path, "timm_vit_gap", pos_embed=pos)
    assert timm_vit.load_vit(src, num_heads=4)[1]["pos_embedding"].shape == (1, 12, 12, 32)  # nothing says otherwise
    (tmp_path / "config.json").write_text(json.dumps({"model_args": {"img_size": [128, 72]}}))
    _, params = timm_vit.load_vit(src, num_heads=4)
    np.testing.assert_array_equal(np.asarray(params["pos_embedding"]), pos.reshape(1, 16, 9, 32))


def _open_clip_copy(tmp_path, tower, **fields):
    """The open_clip fixture in ``tmp_path`` with ``model_cfg[tower]`` fields changed."""
    shutil.copy(FIXTURES / "open_clip" / "open_clip_model.safetensors", tmp_path)
    config = json.loads((FIXTURES / "open_clip" / "open_clip_config.json").read_text())
    config["model_cfg"][tower].update(fields)
    (tmp_path / "open_clip_config.json").write_text(json.dumps(config))
    return tmp_path / "open_clip_model.safetensors"


@pytest.mark.parametrize("pool, eos_id, vitmm_pool, position", [
    ("eos", 1, "eot", 3), ("first", None, "first", 0), ("last", None, "last", -1), ("argmax", None, "eot", 1)])
def test_open_clip_text_pool_type_is_read(tmp_path, pool, eos_id, vitmm_pool, position):
    """``text_cfg.pool_type`` as open_clip's ``text_global_pool``: ``eos`` (MetaCLIP 2 worldwide,
    ``eos_id`` 1 as ViT-L-14-worldwide) pools at the first ``eos_id``, not at ``argmax(ids)``."""
    from vitmm.models.text import TextTransformer

    src = _open_clip_copy(tmp_path, "text_cfg", pool_type=pool, **({"eos_id": eos_id} if eos_id else {}))
    kwargs, params = openclip.load(src, tower="text")
    assert (kwargs["text"]["pool"], kwargs["text"]["eos_id"]) == (vitmm_pool, eos_id)
    ids = jnp.asarray([[5, 200, 17, 1] + [0] * 12])  # EOS id 1 at position 3, the largest id at 1
    pooled, out = TextTransformer(**kwargs["text"]).apply({"params": params["txt"]}, ids)
    np.testing.assert_array_equal(np.asarray(pooled), np.asarray(out["encoded"][:, position]))


@pytest.mark.parametrize("tower, field, value", [
    ("text_cfg", "no_causal_mask", True), ("text_cfg", "embed_cls", True), ("text_cfg", "proj_bias", True),
    ("text_cfg", "act_kwargs", {"approximate": "tanh"}), ("text_cfg", "pool_type", "mean"),
    ("vision_cfg", "pool_type", "avg"), ("vision_cfg", "attentional_pool", True),
    ("vision_cfg", "norm_kwargs", {"eps": 1e-6}), ("vision_cfg", "no_ln_pre", True)])
def test_open_clip_settings_vitmm_lacks_are_refused_by_name(tmp_path, tower, field, value):
    src = _open_clip_copy(tmp_path, tower, **{field: value})
    with pytest.raises(ValueError, match=rf"sets {tower}\.{field}="):
        openclip.load(src)


def test_open_clip_final_ln_after_pool_is_exact_for_token_pools(tmp_path, open_clip_out):
    """A LayerNorm acts on each token: normalizing the pooled token is pooling the normalized ones,
    so the setting is accepted and the model is the one without it."""
    ref, _, _, ztxt, _ = open_clip_out
    kwargs, params = openclip.load(_open_clip_copy(tmp_path, "text_cfg", final_ln_after_pool=True))
    _, got, _ = TwoTowers(**kwargs).apply({"params": params}, None, jnp.asarray(ref["input_ids"], jnp.int32))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ztxt))
