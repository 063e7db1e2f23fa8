"""GGUF language models: a tiny SmolLM2-shaped file (Q4_1 / Q8_0 / F32, llama.cpp's Q/K row
order, tied head, byte-level BPE with control tokens) against transformers reading the same
file (``tests/fixtures/interop/make_fixtures.py:gguf_llama``)."""

import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

from vitmm.interop import gguf_lm
from vitmm.models.lm import LM

FIXTURE = pathlib.Path(__file__).resolve().parents[1] / "fixtures/interop/gguf_llama"


@pytest.fixture(scope="session")
def loaded():
    return gguf_lm.load(FIXTURE / "tiny.gguf")


def test_logits_match_transformers_gguf_loading(loaded):
    kwargs, params, _, _ = loaded
    ref = np.load(FIXTURE / "io.npz")
    logits = np.asarray(LM(**kwargs).apply({"params": params}, jnp.asarray(ref["input_ids"])))
    err = np.abs(logits - ref["logits"]).max() / np.abs(ref["logits"]).max()
    assert err <= 1e-5, err
    assert kwargs["num_kv_heads"] == 2 and kwargs["tie_embeddings"] and kwargs["rope_theta"] == 1e5


def test_without_undoing_llama_cpps_row_order_attention_is_wrong(loaded, monkeypatch):
    monkeypatch.setattr(gguf_lm, "unpermute", lambda w, heads: w)
    kwargs, params, _, _ = gguf_lm.load(FIXTURE / "tiny.gguf")
    ref = np.load(FIXTURE / "io.npz")
    logits = np.asarray(LM(**kwargs).apply({"params": params}, jnp.asarray(ref["input_ids"])))
    assert np.abs(logits - ref["logits"]).max() / np.abs(ref["logits"]).max() > 1e-3


def test_the_tokenizer_equals_transformers_and_keeps_control_tokens_whole(loaded):
    _, _, tokenizer, template = loaded
    ref = np.load(FIXTURE / "io.npz")
    for i, text in enumerate(ref["strings"]):
        assert tokenizer.encode(str(text)).ids == ref[f"encoded_{i}"].tolist(), text
    chat = tokenizer.encode("<|im_start|>user\nhi<|im_end|>").ids
    assert chat[0] == 1 and chat[-1] == 2  # <|im_start|> and <|im_end|>, one id each
    assert tokenizer.decode(tokenizer.encode("émigré café").ids) == "émigré café"
    assert template.startswith("{% for message in messages %}")


def test_unsupported_or_broken_files_are_named(tmp_path):
    bad = tmp_path / "cut.gguf"
    bad.write_bytes((FIXTURE / "tiny.gguf").read_bytes()[:5000])
    with pytest.raises(ValueError, match=r"cut.gguf could not be read as GGUF"):
        gguf_lm.load(bad)
    with pytest.raises(FileNotFoundError, match="nothing is downloaded"):
        gguf_lm.load(tmp_path / "missing.gguf")
    metadata, _ = gguf_lm.read(FIXTURE / "tiny.gguf")
    with pytest.raises(ValueError, match=r"architecture 'gemma3' is not supported; vitmm reads \('llama',\)"):
        gguf_lm.lm_kwargs({**metadata, "general.architecture": "gemma3"}, "x.gguf")
    with pytest.raises(ValueError, match=r"tokenizer.ggml.model 'llama' is not supported"):
        gguf_lm.tokenizer({**metadata, "tokenizer.ggml.model": "llama"}, "x.gguf")
    no_vocab = {k: v for k, v in metadata.items() if k != "tokenizer.ggml.tokens"}
    with pytest.raises(ValueError, match="carries no tokenizer"):
        gguf_lm.lm_kwargs(no_vocab, "x.gguf")
