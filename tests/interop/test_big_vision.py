"""big_vision ``.npz`` checkpoints load into vitmm and compute what the original computes.

Fixtures (``tests/fixtures/interop/make_fixtures.py --only big_vision``): timm ViTs written in
big_vision's and vision_transformer's Flax layouts, each read back by timm's own ``.npz`` loader to
the same outputs before it is saved, with timm's outputs; and the hf_siglip fixture's SigLIP under
big_vision's two-tower names (the inverse of transformers' ``convert_siglip_to_hf``) with
transformers' outputs, its image tower also checked through timm's loader. Tolerance: max abs
difference ≤ 1e-4 in float32.
"""


import jax.numpy as jnp
import numpy as np
import pytest
from parity import ATOL, FIXTURES, check_siglip, images, load_io

from vitmm.interop import big_vision
from vitmm.models.two_towers import TwoTowers
from vitmm.models.vit import ViT

VIT_CASES = {  # name: (class token, pool, position layout)
    "bv_vit": (True, "tok", "patches"),
    "bv_vit_gap_scan": (False, "gap", "patches"),
    "bv_vit_augreg": (True, "tok", "with_cls"),
}


@pytest.mark.parametrize("name", VIT_CASES)
def test_vit_matches_the_original(name):
    ref = load_io(name)
    kwargs, params = big_vision.load_vit(FIXTURES / name / "model.npz")
    class_token, pool, layout = VIT_CASES[name]
    assert (kwargs["class_token"], kwargs["pool"], kwargs["posemb_layout"]) == (class_token, pool, layout)
    assert (kwargs["num_heads"], kwargs["depth"], kwargs["mlp_dim"], kwargs["num_classes"]) == (4, 2, 64, 10)
    logits, out = ViT(**kwargs).apply({"params": params}, images(ref))
    np.testing.assert_allclose(np.asarray(out["encoded"]), ref["features"], atol=ATOL, rtol=0)
    np.testing.assert_allclose(np.asarray(out["pooled"]), ref["pooled"], atol=ATOL, rtol=0)
    np.testing.assert_allclose(np.asarray(logits), ref["logits"], atol=ATOL, rtol=0)


def test_siglip_two_towers_match_transformers():
    ref = load_io("bv_siglip")
    kwargs, params = big_vision.load_two_towers(FIXTURES / "bv_siglip" / "model.npz")
    assert kwargs["image"]["pool"] == "map" and not kwargs["image"]["class_token"]
    assert kwargs["text"]["pool"] == "last" and kwargs["text"]["num_heads"] == 4
    check_siglip(kwargs, params, ref)
    # The image tower alone, from the same file.
    vkw, vparams = big_vision.load_vit(FIXTURES / "bv_siglip" / "model.npz")
    pooled, _ = ViT(**vkw).apply({"params": vparams}, images(ref))
    np.testing.assert_allclose(np.asarray(pooled), ref["vision_pooler_output"], atol=ATOL, rtol=0)


def _rewrite(tmp_path, name, change):
    with np.load(FIXTURES / name / "model.npz") as data:
        tensors = {k: data[k] for k in data.files}
    change(tensors)
    path = tmp_path / "model.npz"
    np.savez(path, **tensors)
    return path


def test_missing_and_unexpected_tensors_are_listed(tmp_path):
    def change(t):
        del t["params/Transformer/encoderblock_1/MlpBlock_0/Dense_1/bias"]
        t["params/Transformer/extra/kernel"] = np.zeros((2, 2), np.float32)

    with pytest.raises(ValueError) as e:
        big_vision.load_vit(_rewrite(tmp_path, "bv_vit", change))
    assert "missing in checkpoint: Transformer/encoderblock_1/MlpBlock_0/Dense_1/bias" in str(e.value)
    assert "unused from checkpoint: Transformer/extra/kernel" in str(e.value)


def test_mis_shaped_tensors_are_listed(tmp_path):
    def change(t):
        t["params/head/bias"] = np.zeros(11, np.float32)

    with pytest.raises(ValueError, match="head"):
        big_vision.load_vit(_rewrite(tmp_path, "bv_vit", change))


def test_a_representation_layer_is_refused(tmp_path):
    def change(t):
        t["opt/target/pre_logits/kernel"] = np.zeros((32, 32), np.float32)
        t["opt/target/pre_logits/bias"] = np.zeros(32, np.float32)

    with pytest.raises(ValueError, match="pre_logits"):
        big_vision.load_vit(_rewrite(tmp_path, "bv_vit_augreg", change))


def test_a_file_without_a_position_table_uses_fixed_sincos_positions(tmp_path):
    from vitmm import checkpoint as ckpt_lib
    from vitmm.interop import __main__ as cli

    path = _rewrite(tmp_path, "bv_vit", lambda t: t.pop("params/pos_embedding"))
    kwargs, params = big_vision.load_vit(path)
    assert kwargs["posemb"] == "sincos2d" and "pos_embedding" not in params
    logits, _ = ViT(**kwargs).apply({"params": params}, jnp.zeros((1, 48, 48, 3)))  # any size
    assert logits.shape == (1, 10)
    cli.main(["--from", "big_vision", "--src", str(path), "--out", str(tmp_path / "c"), "--image_size", "48"])
    assert ckpt_lib.load_config(tmp_path / "c")["input"]["image_size"] == 48


def test_wrong_files_are_named(tmp_path):
    with pytest.raises(ValueError, match="use load_vit"):
        big_vision.load_two_towers(FIXTURES / "bv_vit" / "model.npz")
    with pytest.raises(ValueError, match="not an .npz"):
        big_vision.load_vit(FIXTURES / "hf_siglip" / "model.safetensors")


def test_loading_at_a_new_resolution_resamples_positions():
    kwargs, params = big_vision.load_vit(FIXTURES / "bv_vit" / "model.npz", image_size=48)
    assert params["pos_embedding"].shape == (1, 6, 6, 32)
    logits, _ = ViT(**kwargs).apply({"params": params}, jnp.zeros((1, 48, 48, 3)))
    assert logits.shape == (1, 10)


def test_convert_cli_takes_big_vision_files(tmp_path, capsys):
    from vitmm import checkpoint as ckpt_lib
    from vitmm.interop import __main__ as cli

    ref = load_io("bv_siglip")
    cli.main(["--from", "big_vision", "--src", str(FIXTURES / "bv_siglip" / "model.npz"), "--out",
                  str(tmp_path / "s")])
    config, params = ckpt_lib.load_config(tmp_path / "s"), ckpt_lib.load_params(tmp_path / "s")
    zimg, ztxt, out = TwoTowers(**config["model"]).apply({"params": params}, images(ref),
                                                         jnp.asarray(ref["input_ids"], jnp.int32))
    np.testing.assert_allclose(np.asarray(out["t"] * zimg @ ztxt.T + out["b"]), ref["logits_per_image"],
                               atol=ATOL, rtol=0)
    cli.main(["--from", "big_vision", "--src", str(FIXTURES / "bv_vit_gap_scan" / "model.npz"), "--out",
                  str(tmp_path / "v")])
    config = ckpt_lib.load_config(tmp_path / "v")
    assert config["model"]["text"] is None and config["input"]["image_size"] == 32
    with pytest.raises(SystemExit, match="2"):
        cli.main(["--from", "big_vision", "--src", str(FIXTURES / "bv_vit" / "model.npz"), "--out",
                      str(tmp_path / "t"), "--tower", "text"])
    assert "no text tower" in capsys.readouterr().err
