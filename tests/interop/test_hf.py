"""Hugging Face checkpoints (CLIP, ViT, Dinov2 with and without registers) load into vitmm and
compute what transformers computes.

Fixtures: tiny random models saved by transformers with its outputs
(``tests/fixtures/interop/make_fixtures.py``; versions in ``manifest.json``). Tolerance: max
abs difference ≤ 1e-4 in float32.
"""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from parity import ATOL, FIXTURES, RESIZED_RTOL, assert_close_relative, check_siglip, images, load_io, resized_hw

from vitmm.interop import hf, io
from vitmm.models.text import TextTransformer
from vitmm.models.two_towers import TwoTowers
from vitmm.models.vit import ViT


def test_clip_model_matches_transformers():
    ref = load_io("hf_clip")
    kwargs, params = hf.load_clip(FIXTURES / "hf_clip")
    model = TwoTowers(**kwargs)
    zimg, ztxt, out = model.apply({"params": params}, images(ref), jnp.asarray(ref["input_ids"], jnp.int32))
    depth = kwargs["image"]["depth"]
    checks = {
        "vision_last_hidden_state": out[f"img/block_{depth - 1:02d}"],
        "vision_penultimate": out[f"img/block_{depth - 2:02d}"],
        "vision_pooler_output": out["img/pooled"],
        "image_embeds": zimg,
        "text_last_hidden_state": out["txt/encoded"],
        "text_pooler_output": out["txt/pooled"],
        "text_embeds": ztxt,
        "logits_per_image": out["t"] * zimg @ ztxt.T,
    }
    for name, got in checks.items():
        np.testing.assert_allclose(np.asarray(got), ref[name], atol=ATOL, rtol=0, err_msg=name)


def test_standalone_vision_model_without_prefix_loads_the_same_tower():
    ref = load_io("hf_clip_vision")
    assert not any(k.startswith("vision_model.") for k in io.read_tensors(FIXTURES / "hf_clip_vision"))
    kwargs, params = hf.load_clip_vision(FIXTURES / "hf_clip_vision")
    _, from_full = hf.load_clip_vision(FIXTURES / "hf_clip")  # the vision half of a CLIPModel
    for a, b in zip(_leaves(params), _leaves(from_full), strict=True):
        np.testing.assert_array_equal(a, b)
    pooled, out = ViT(**kwargs).apply({"params": params}, images(ref))
    np.testing.assert_allclose(np.asarray(out[f"block_{kwargs['depth'] - 1:02d}"]), ref["vision_last_hidden_state"],
                               atol=ATOL, rtol=0)
    np.testing.assert_allclose(np.asarray(pooled), ref["vision_pooler_output"], atol=ATOL, rtol=0)


def _leaves(tree):
    import jax

    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_text_tower_alone_matches():
    ref = load_io("hf_clip")
    kwargs, params = hf.load_clip_text(FIXTURES / "hf_clip")
    assert kwargs["eos_id"] == 258
    pooled, out = TextTransformer(**kwargs).apply({"params": params}, jnp.asarray(ref["input_ids"], jnp.int32))
    np.testing.assert_allclose(np.asarray(out["encoded"]), ref["text_last_hidden_state"], atol=ATOL, rtol=0)
    np.testing.assert_allclose(np.asarray(pooled), ref["text_pooler_output"], atol=ATOL, rtol=0)


def test_vision_export_round_trips_exactly(tmp_path):
    kwargs, params = hf.load_clip_vision(FIXTURES / "hf_clip")
    tensors, config = hf.export_clip_vision(kwargs, params)
    original = {k: v for k, v in io.read_tensors(FIXTURES / "hf_clip").items() if k.startswith("vision_model.")}
    assert sorted(tensors) == sorted(original)
    for k, v in original.items():
        np.testing.assert_array_equal(tensors[k], v, err_msg=k)
    io.write_safetensors(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(config))
    kwargs2, params2 = hf.load_clip_vision(tmp_path)
    assert kwargs2 == kwargs
    for a, b in zip(_leaves(params), _leaves(params2), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("siglip", [False, True], ids=["clip", "siglip"])
def test_a_tower_trained_here_exports_as_the_network_it_is(tmp_path, siglip):
    """A config names only what it changes: vitmm's defaults (GELU, LayerNorm eps 1e-6, a patch
    bias) are written out as such, not transformers' (quick_GELU and 1e-5 for CLIP); CLIP's
    bias-free patch conv gets the bias in its patch positions, SigLIP a zero bias where the tower
    has none. Read back, the tower gives the same tokens; what the layout cannot hold is refused."""
    import jax

    kwargs = dict(width=32, depth=2, mlp_dim=64, num_heads=2, patch_size=8, pool="none")
    kwargs |= dict(class_token=False, embed_bias=False) if siglip else \
        dict(posemb_layout="with_cls", pre_norm=True)
    x = jax.random.normal(jax.random.key(1), (1, 32, 32, 3))
    params = ViT(**kwargs).init(jax.random.key(0), x)["params"]
    params = jax.tree.map(lambda a: a + 0.3 * jax.random.normal(jax.random.key(2), a.shape), params)
    export = hf.export_siglip_vision if siglip else hf.export_clip_vision
    tensors, config = export(kwargs, params)
    assert (config["hidden_act"], config["layer_norm_eps"]) == ("gelu", 1e-6)
    io.write_safetensors(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(config))
    back_kwargs, back = (hf.load_siglip_vision if siglip else hf.load_clip_vision)(tmp_path)
    want = ViT(**kwargs).apply({"params": params}, x)[1]["block_01"]
    got = ViT(**{**back_kwargs, "pool": "none"}).apply({"params": back}, x)[1]["block_01"]
    assert_close_relative(got, want, "the last block's tokens", 1e-6)
    with pytest.raises(ValueError, match=r"cannot hold this tower: qk_norm=True \(needs False\)"):
        export({**kwargs, "qk_norm": True}, params)


def test_loading_at_a_new_resolution_resamples_positions():
    kwargs, params = hf.load_clip_vision(FIXTURES / "hf_clip", image_size=48)
    assert params["pos_embedding"].shape == (1, 6, 6, kwargs["width"])
    pooled, _ = ViT(**kwargs).apply({"params": params}, jnp.zeros((1, 48, 48, 3)))
    assert pooled.shape == (1, kwargs["width"])
    with pytest.raises(ValueError, match="not a multiple of the patch size 8x8"):
        hf.load_clip_vision(FIXTURES / "hf_clip", image_size=50)


def test_mismatches_are_listed(tmp_path):
    tensors = io.read_tensors(FIXTURES / "hf_clip")
    del tensors["vision_model.encoder.layers.1.mlp.fc2.bias"]
    tensors["vision_model.extra.weight"] = np.zeros(3, np.float32)
    tensors["vision_model.encoder.layers.0.layer_norm1.weight"] = np.zeros(5, np.float32)
    io.write_safetensors(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((FIXTURES / "hf_clip/config.json").read_text())
    with pytest.raises(ValueError) as err:
        hf.load_clip(tmp_path)
    message = str(err.value)
    assert "missing in checkpoint: vision_model.encoder.layers.1.mlp.fc2.bias" in message
    assert "unused from checkpoint: vision_model.extra.weight" in message
    # Shapes are checked once nothing is missing.
    del tensors["vision_model.extra.weight"]
    tensors["vision_model.encoder.layers.1.mlp.fc2.bias"] = np.zeros(32, np.float32)
    io.write_safetensors(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"shape mismatch: img/encoder/block_00/norm1/scale"):
        hf.load_clip(tmp_path)


def test_config_that_disagrees_with_the_weights_is_an_error(tmp_path):
    config = json.loads((FIXTURES / "hf_clip/config.json").read_text())
    config["vision_config"]["num_hidden_layers"] = 5
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes((FIXTURES / "hf_clip/model.safetensors").read_bytes())
    with pytest.raises(ValueError, match=r"num_hidden_layers.*\(5, 3\)"):
        hf.load_clip(tmp_path)


def test_missing_files_name_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing is downloaded"):
        hf.load_clip(tmp_path / "openai/clip-vit-base-patch32")
    with pytest.raises(FileNotFoundError, match="expected one of"):
        hf.load_clip(tmp_path)


def test_convert_cli_writes_a_checkpoint_that_vitmm_initialises_from(tmp_path, capsys):
    import jax

    from vitmm import checkpoint as ckpt_lib
    from vitmm.interop import __main__ as cli
    from vitmm.models import vlm

    out = tmp_path / "converted"
    cli.main(["--from", "hf", "--src", str(FIXTURES / "hf_clip"), "--out", str(out)])
    kwargs, params = hf.load_clip(FIXTURES / "hf_clip")
    loaded = ckpt_lib.load_params(out)
    for a, b in zip(_leaves(params), _leaves(loaded), strict=True):
        np.testing.assert_array_equal(a, b)
    config = ckpt_lib.load_config(out)
    assert config["model"]["image"] == json.loads(json.dumps(kwargs["image"]))
    assert config["input"]["image_size"] == 32
    # A VLM takes the converted tower as its vision tower.
    lm_kw = dict(vocab_size=259, width=32, depth=1, num_heads=2)
    model = vlm.VLM(kwargs["image"], {"name": "pool", "budget": 4}, lm_kw)
    init = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 32, 32, 3)), jnp.zeros((1, 4), jnp.int32))
    init = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), init["params"])
    merged = ckpt_lib.init_tower_from_clip(init, out)
    np.testing.assert_array_equal(merged["tower"]["pos_embedding"], params["img"]["pos_embedding"])
    with pytest.raises(SystemExit, match="2"):
        cli.main(["--from", "hf", "--src", str(FIXTURES / "hf_clip"), "--out", str(out)])
    assert "is not empty; choose a new folder" in capsys.readouterr().err
    vision_out = tmp_path / "vision336"
    cli.main(["--from", "hf", "--src", str(FIXTURES / "hf_clip_vision"), "--out", str(vision_out),
                  "--tower", "vision", "--image_size", "48"])
    assert ckpt_lib.load_params(vision_out)["img"]["pos_embedding"].shape == (1, 6, 6, 32)
    assert ckpt_lib.load_config(vision_out)["input"]["image_size"] == 48


@pytest.mark.parametrize("name,registers,layerscale", [
    ("hf_vit", 0, False), ("hf_vit_legacy_keys", 0, False), ("hf_dinov2", 0, True), ("hf_dinov2_registers", 4, True),
])
def test_vit_and_dinov2_backbones_match_transformers(name, registers, layerscale):
    ref = load_io(name)
    kwargs, params = hf.load_vit(FIXTURES / name)
    assert kwargs["num_registers"] == registers and (kwargs["layerscale"] is not None) == layerscale
    pooled, out = ViT(**kwargs).apply({"params": params}, images(ref))
    # transformers' sequence is [CLS, registers, patches]; vitmm returns registers separately.
    seq = jnp.concatenate([out["encoded"][:, :1], out["registers"], out["patch_tokens"]], axis=1) if registers \
        else out["encoded"]
    np.testing.assert_allclose(np.asarray(seq), ref["last_hidden_state"], atol=ATOL, rtol=0)
    if name.startswith("hf_dinov2"):  # Dinov2's pooler is the normed CLS token; ViTModel's is a tanh layer
        np.testing.assert_allclose(np.asarray(pooled), ref["pooler_output"], atol=ATOL, rtol=0)


def test_load_vit_refuses_other_model_types():
    with pytest.raises(ValueError, match="model_type 'clip' is not one of"):
        hf.load_vit(FIXTURES / "hf_clip")


def test_convert_cli_takes_a_dinov2_backbone(tmp_path):
    from vitmm import checkpoint as ckpt_lib
    from vitmm.interop import __main__ as cli

    cli.main(["--from", "hf", "--src", str(FIXTURES / "hf_dinov2_registers"), "--out", str(tmp_path / "d")])
    config = ckpt_lib.load_config(tmp_path / "d")
    assert config["model"]["image"]["num_registers"] == 4 and config["input"]["image_size"] == 28
    assert ckpt_lib.load_params(tmp_path / "d")["img"]["registers"].shape == (1, 4, 32)


def test_siglip_model_matches_transformers():
    ref = load_io("hf_siglip")
    kwargs, params = hf.load_siglip(FIXTURES / "hf_siglip")
    assert kwargs["image_proj"] is False and kwargs["text_proj_bias"] is True
    assert "img_proj" not in params and "bias" in params["txt_proj"]
    zimg, ztxt = check_siglip(kwargs, params, ref)
    # The text pooler of transformers is the head's output before normalisation.
    np.testing.assert_allclose(np.asarray(ztxt), ref["text_pooler_output"] /
                               np.linalg.norm(ref["text_pooler_output"], axis=-1, keepdims=True), atol=ATOL)
    vkw, vparams = hf.load_siglip_vision(FIXTURES / "hf_siglip")
    pooled, _ = ViT(**vkw).apply({"params": vparams}, images(ref))
    np.testing.assert_allclose(np.asarray(pooled), ref["vision_pooler_output"], atol=ATOL, rtol=0)


def test_convert_cli_takes_siglip_and_the_model_rebuilds_from_its_config(tmp_path):
    from vitmm import checkpoint as ckpt_lib
    from vitmm.interop import __main__ as cli

    cli.main(["--from", "hf", "--src", str(FIXTURES / "hf_siglip"), "--out", str(tmp_path / "s")])
    config, params = ckpt_lib.load_config(tmp_path / "s"), ckpt_lib.load_params(tmp_path / "s")
    ref = load_io("hf_siglip")
    zimg, ztxt, out = TwoTowers(**config["model"]).apply({"params": params}, images(ref),
                                                         jnp.asarray(ref["input_ids"], jnp.int32))
    np.testing.assert_allclose(np.asarray(out["t"] * zimg @ ztxt.T + out["b"]), ref["logits_per_image"],
                               atol=ATOL, rtol=0)


# ---- a new, non-square resolution: positions resampled the way transformers does it -----------
def test_clip_vision_at_a_non_square_resolution_matches_interpolate_pos_encoding():
    """transformers' ``interpolate_pos_encoding=True`` at 40x56 px (a 4x4 table to 5x7)."""
    ref = load_io("hf_clip")
    kwargs, params = hf.load_clip_vision(FIXTURES / "hf_clip", image_size=resized_hw(ref))
    assert kwargs["posemb_resample"] == "torch_bicubic"
    assert params["pos_embedding"].shape[1:3] == (5, 7)
    pooled, out = ViT(**kwargs).apply({"params": params}, images(ref, "pixel_values_resized"))
    assert_close_relative(out[f"block_{kwargs['depth'] - 1:02d}"], ref["vision_last_hidden_state_resized"],
                          "last_hidden_state")
    assert_close_relative(pooled, ref["vision_pooler_output_resized"], "pooler_output")
    # The same table built on the fly (dynamic_img_size) gives the same numbers.
    _, at_train_size = hf.load_clip_vision(FIXTURES / "hf_clip")
    pooled2, _ = ViT(**{**kwargs, "dynamic_img_size": True}).apply({"params": at_train_size},
                                                                   images(ref, "pixel_values_resized"))
    np.testing.assert_allclose(np.asarray(pooled2), np.asarray(pooled), atol=1e-6, rtol=0)
    # vitmm's default (anti-aliased bicubic, a = -0.5) is a different function: far outside the tolerance.
    jax_kwargs = {**kwargs, "posemb_resample": "bicubic_aa", "dynamic_img_size": True}
    pooled3, _ = ViT(**jax_kwargs).apply({"params": at_train_size}, images(ref, "pixel_values_resized"))
    want = ref["vision_pooler_output_resized"]
    assert np.abs(np.asarray(pooled3) - want).max() > 10 * RESIZED_RTOL * np.abs(want).max()


def test_siglip_vision_at_a_non_square_resolution_matches_interpolate_pos_encoding():
    ref = load_io("hf_siglip")
    kwargs, params = hf.load_siglip_vision(FIXTURES / "hf_siglip", image_size=resized_hw(ref))
    pooled, out = ViT(**kwargs).apply({"params": params}, images(ref, "pixel_values_resized"))
    assert_close_relative(out["encoded"], ref["vision_last_hidden_state_resized"], "last_hidden_state")
    assert_close_relative(pooled, ref["vision_pooler_output_resized"], "pooler_output")


@pytest.mark.parametrize("name, method", [("hf_vit", "torch_bicubic"), ("hf_dinov2", "torch_bicubic"),
                                          ("hf_dinov2_registers", "bicubic_aa")])
def test_vit_backbones_at_a_non_square_resolution_match_transformers(name, method):
    """ViT and DINOv2 interpolate without anti-aliasing, DINOv2 with registers with it."""
    ref = load_io(name)
    kwargs, params = hf.load_vit(FIXTURES / name, image_size=resized_hw(ref))
    assert kwargs["posemb_resample"] == method
    _, out = ViT(**kwargs).apply({"params": params}, images(ref, "pixel_values_resized"))
    seq = out["encoded"]
    if kwargs["num_registers"]:  # transformers' order: CLS, registers, patches
        seq = jnp.concatenate([seq[:, :1], out["registers"], seq[:, 1:]], axis=1)
    assert_close_relative(seq, ref["last_hidden_state_resized"], name)


def test_convert_cli_takes_a_non_square_size(tmp_path):
    from vitmm import checkpoint
    from vitmm.interop import __main__ as cli
    from vitmm.interop import convert

    out = convert.convert("hf", str(FIXTURES / "hf_clip"), str(tmp_path / "c"), tower="vision", image_size=(40, 56))
    config = checkpoint.load_config(out)
    assert config["input"]["image_size"] == [40, 56]
    assert config["model"]["image"]["posemb_resample"] == "torch_bicubic"
    assert cli.image_size_arg("40x56") == (40, 56) and cli.image_size_arg("336") == 336
    with pytest.raises(SystemExit):
        cli.main(["--from", "hf", "--src", str(FIXTURES / "hf_clip"), "--out", str(tmp_path / "d"),
                      "--image_size", "40x"])


@pytest.mark.parametrize("n", [2, 3, 4])  # the fixture's tower has 3 blocks: -4 is the encoder's input
def test_vlm_vision_layer_minus_n_is_hf_hidden_states_minus_n(n):
    """``VLM(vision_layer=-n)`` hands the connector exactly transformers' ``hidden_states[-n]``
    (CLS and patches), for a converted HF CLIP tower."""
    from vitmm.models.vlm import VLM

    ref = load_io("hf_clip")
    kwargs, params = hf.load_clip_vision(FIXTURES / "hf_clip")
    hidden = ref["vision_hidden_states"]
    assert hidden.shape[0] == kwargs["depth"] + 1
    model = VLM(kwargs, {"name": "identity"}, dict(vocab_size=259, width=32, depth=1, num_heads=4),
                vision_layer=-n, use_cls=True)
    patches, cls, grid = model.apply({"params": {"tower": params}}, images(ref), method=VLM.features)
    assert grid == (4, 4)
    np.testing.assert_allclose(np.asarray(cls), hidden[-n][:, 0], atol=ATOL, rtol=0)
    np.testing.assert_allclose(np.asarray(patches), hidden[-n][:, 1:], atol=ATOL, rtol=0)
    if n == 2:
        np.testing.assert_allclose(np.asarray(patches), ref["vision_penultimate"][:, 1:], atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="-2 … -4"):
        VLM(kwargs, {"name": "identity"}, dict(vocab_size=259, width=32, depth=1, num_heads=4),
            vision_layer=-5).apply({"params": {"tower": params}}, images(ref), method=VLM.features)
