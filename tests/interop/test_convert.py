"""The table of loaders: one signature for every source, options checked against the source."""

import inspect
import pathlib

import pytest

from vitmm.interop import convert

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures/interop"


def test_every_source_loads_with_one_signature():
    for name, loader in convert.LOADERS.items():
        params = inspect.signature(loader).parameters
        assert list(params)[:3] == ["src", "tower", "image_size"], name
        assert params["tower"].kind is inspect.Parameter.KEYWORD_ONLY and params["tower"].default == "both", name


def test_each_source_gives_the_two_tower_form_and_refuses_what_it_lacks():
    model, params = convert.load("hf", FIXTURES / "hf_vit", tower="vision")
    assert model["text"] is None and set(params) == {"img"}
    model, params = convert.load("timm", FIXTURES / "timm_vit" / "model.safetensors", num_heads=2)
    assert model["text"] is None and model["image"]["num_heads"] == 2
    with pytest.raises(ValueError, match="has no text tower"):
        convert.load("timm", FIXTURES / "timm_vit" / "model.safetensors", tower="text", num_heads=2)
    with pytest.raises(ValueError, match=r"\['quick_gelu'\] do not apply to 'timm'.*num_heads"):
        convert.load("timm", FIXTURES / "timm_vit" / "model.safetensors", quick_gelu=True)
    with pytest.raises(ValueError, match="choose one of"):
        convert.load("keras", FIXTURES / "hf_vit")
