"""experiments/gpu/lm_shape.py: a converted LM's settings, tokenizer and parameter shapes without its weights."""

import pathlib

import numpy as np

from experiments.gpu import lm_shape
from vitmm import checkpoint as ckpt_lib
from vitmm import tree
from vitmm.interop import convert

ROOT = pathlib.Path(__file__).resolve().parents[3]


def test_the_shape_keeps_everything_but_the_weights(tmp_path):
    src = convert.convert_language_model("gguf", ROOT / "tests/fixtures/interop/gguf_llama/tiny.gguf", tmp_path / "lm")
    out = lm_shape.main(["--src", str(src), "--out", str(tmp_path / "shape")])
    real, shape = tree.flatten(ckpt_lib.load_params(src)), tree.flatten(ckpt_lib.load_params(out))
    assert {k: (v.shape, v.dtype) for k, v in real.items()} == {k: (v.shape, v.dtype) for k, v in shape.items()}
    assert all(np.all(v == (1 if "norm" in k else 0)) for k, v in shape.items())
    saved, original = ckpt_lib.load_config(out), ckpt_lib.load_config(src)
    assert saved["model"] == original["model"] and saved["chat_template"] == original["chat_template"]
    assert "zero weights" in saved["source"]["shape_only"]
    assert (out / "tokenizer.json").read_text() == (src / "tokenizer.json").read_text()
