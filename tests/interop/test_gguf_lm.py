"""GGUF language models: a tiny SmolLM2-shaped file (Q4_1 / Q8_0 / F32, llama.cpp's Q/K row
order, tied head, byte-level BPE with control tokens) and tiny Qwen2, Qwen3, Gemma 2/3 and Phi-3 files
against transformers reading the same files (``tests/fixtures/interop/make_fixtures.py:gguf_llama``,
``gguf_families``). The Gemma and Phi-3 files test those tensor layouts only: they carry the tiny
byte-level BPE vocabulary, while llama.cpp writes real Gemma 2/3 and Phi-3 files with a
SentencePiece one (``tokenizer.ggml.model = llama``), which vitmm refuses."""

import json
import pathlib
import re

import jax.numpy as jnp
import numpy as np
import pytest

from vitmm.interop import gguf_lm
from vitmm.models.lm import LM

FIXTURE = pathlib.Path(__file__).resolve().parents[1] / "fixtures/interop/gguf_llama"


@pytest.fixture(scope="session")
def loaded():
    return gguf_lm.load(FIXTURE / "tiny.gguf")


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "gemma2", "gemma3", "phi3"])
def test_more_families_match_transformers_gguf_loading(arch):
    """Qwen2 (q/k/v biases, an untied head), Qwen3 (q/k norms, 128-wide heads on a 32-wide model),
    Gemma 2 (norms stored as 1 + w, output norms, soft caps, a window of 3 on layer 0), Gemma 3's text
    model (q/k norms, five windowed layers with their own RoPE base, a global sixth) and Phi-3 (fused
    q/k/v and gate/up) in llama.cpp's tensor layouts (Q8_0; no rotary permutation): transformers' logits
    on the same file, ≤ 1e-5 of the largest. (Their vocabulary is the byte-level BPE of the Qwen files,
    not the SentencePiece one llama.cpp writes for Gemma and Phi-3: only the weights are tested.)"""
    folder = FIXTURE.with_name(f"gguf_{arch}")
    kwargs, params, _, _ = gguf_lm.load(folder / "tiny.gguf")
    ref = np.load(folder / "io.npz")
    logits = np.asarray(LM(**kwargs).apply({"params": params}, jnp.asarray(ref["input_ids"])))
    assert np.abs(logits - ref["logits"]).max() <= 1e-5 * np.abs(ref["logits"]).max()
    assert kwargs["qkv_bias"] == (arch == "qwen2") and kwargs.get("qk_norm", False) == (arch in ("qwen3", "gemma3"))
    assert kwargs["head_dim"] == {"qwen3": 128, "gemma2": 256, "gemma3": 256}.get(arch)
    if arch == "gemma2":
        assert kwargs["window_layers"] == (0,) and kwargs["sliding_window"] == 3 and kwargs["norm_offset"]
    if arch == "gemma3":
        assert kwargs["window_layers"] == (0, 1, 2, 3, 4) and kwargs["qk_norm"] and kwargs["local_rope_theta"] == 1e4


@pytest.mark.parametrize("arch, depth, width, heads, head_dim, scale", [
    ("gemma2", 46, 4608, 32, 128, 144.0), ("gemma2", 42, 3584, 16, 256, 256.0),  # 27B: width / heads; 9B: head size
    ("gemma3", 62, 5376, 32, 128, 168.0), ("gemma3", 48, 3840, 16, 256, 256.0)])
def test_gemmas_27b_scale_queries_by_width_over_heads_as_llama_cpp(arch, depth, width, heads, head_dim, scale):
    metadata = {"general.architecture": arch, "tokenizer.ggml.tokens": ["a"], f"{arch}.embedding_length": width,
                f"{arch}.block_count": depth, f"{arch}.feed_forward_length": 4 * width,
                f"{arch}.attention.head_count": heads, f"{arch}.attention.key_length": head_dim}
    assert gguf_lm.lm_kwargs(metadata, "test")["query_scale"] == scale


def test_llama3_rope_rescaling_comes_from_rope_freqs_as_llama_cpp_writes_it():
    """``hf_llama32`` written as llama.cpp writes it (F32; Llama 3's rescaling as a ``rope_freqs``
    tensor, which transformers' GGUF loading drops): vitmm gives the original checkpoint's logits on
    its ragged batch (≤ 1e-5 of the largest), which it would miss without the factors."""
    kwargs, params, _, _ = gguf_lm.load(FIXTURE.with_name("gguf_llama32") / "tiny.gguf")
    ref = np.load(FIXTURE.with_name("hf_llama32") / "io.npz")
    real = ref["attention_mask"] > 0

    def error(settings):
        logits = np.asarray(LM(**settings).apply({"params": params}, jnp.asarray(ref["input_ids"]), pad_mask=real,
                                                 positions=jnp.asarray(ref["position_ids"])))
        return np.abs(logits[real] - ref["logits"][real]).max() / np.abs(ref["logits"][real]).max()

    assert kwargs["rope_scaling"]["rope_type"] == "factors" and error(kwargs) <= 1e-5
    assert error({**kwargs, "rope_scaling": None}) > 1e-3
    from vitmm.interop import hf_lm

    with pytest.raises(ValueError, match=r"per-frequency factors \(rope_freqs\), which transformers has no rope_type"):
        hf_lm.export_lm(kwargs, params)  # an export transformers could not load: refused


def _write_tiny_llama(path: pathlib.Path, **rope_scaling) -> None:
    """A one-layer ``llama`` GGUF of random F32 weights, its RoPE scaling set as llama.cpp's converter
    writes it (``rope_scaling``: the ``gguf`` writer's ``add_rope_scaling_*`` values, e.g. type and factor)."""
    import gguf

    width, heads, kv, mlp, vocab = 32, 4, 2, 64, 24
    rng = np.random.default_rng(0)
    w = lambda *shape: rng.normal(0, 0.3, shape).astype(np.float32)  # noqa: E731
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_embedding_length(width)
    writer.add_block_count(1)
    writer.add_feed_forward_length(mlp)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10_000.0)
    for key, value in rope_scaling.items():
        getattr(writer, f"add_rope_scaling_{key}")(value)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(vocab)])
    writer.add_token_types([1] * vocab)
    writer.add_token_merges([])
    head_dim = width // heads
    for name, shape in [("token_embd", (vocab, width)), ("blk.0.attn_q", (width, width)),
                        ("blk.0.attn_k", (kv * head_dim, width)), ("blk.0.attn_v", (kv * head_dim, width)),
                        ("blk.0.attn_output", (width, width)), ("blk.0.ffn_gate", (mlp, width)),
                        ("blk.0.ffn_up", (mlp, width)), ("blk.0.ffn_down", (width, mlp))]:
        writer.add_tensor(f"{name}.weight", w(*shape))
    for name in ("blk.0.attn_norm", "blk.0.ffn_norm", "output_norm"):
        writer.add_tensor(f"{name}.weight", 1 + w(width))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_llama_files_linear_rope_scaling_divides_the_positions_by_its_factor(tmp_path):
    """``llama.rope.scaling.type = linear`` (factor 4): the model at positions 4p runs as the unscaled
    one at p (the rotations' angles are the same); unscaled, it differs. Yarn is refused in one line
    that names the value and the way out."""
    import gguf

    _write_tiny_llama(tmp_path / "linear.gguf", type=gguf.RopeScalingType.LINEAR, factor=4.0)
    kwargs, params, _, _ = gguf_lm.load(tmp_path / "linear.gguf")
    assert kwargs["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}
    ids = jnp.arange(1, 9)[None] % kwargs["vocab_size"]
    positions = jnp.arange(8)[None]
    unscaled = {**kwargs, "rope_scaling": None}
    scaled_at_4p = LM(**kwargs).apply({"params": params}, ids, positions=4 * positions)
    np.testing.assert_allclose(np.asarray(scaled_at_4p), np.asarray(LM(**unscaled).apply({"params": params}, ids,
                                                                                          positions=positions)),
                               rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(LM(**unscaled).apply({"params": params}, ids, positions=4 * positions))
                  - np.asarray(scaled_at_4p)).max() > 1e-3
    _write_tiny_llama(tmp_path / "yarn.gguf", type=gguf.RopeScalingType.YARN, factor=4.0)
    with pytest.raises(ValueError, match=r"^\S*yarn.gguf: RoPE scaling 'yarn' \(llama.rope.scaling.type\) is not "
                                         r"supported; .*--remove-metadata llama.rope.scaling.type[^\n]*$"):
        gguf_lm.load(tmp_path / "yarn.gguf")


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


def test_each_pre_tokenizer_splits_as_transformers_gguf_loading():
    """A vocabulary whose merges cross the pre-tokenizers' boundaries (digit runs, a space before
    digits, punctuation before letters), read under each ``tokenizer.ggml.pre``: the ids transformers'
    GGUF loading gives (``make_fixtures.py:gguf_pretokenizers``), which differ between the splits."""
    ref = json.loads((FIXTURE.parent / "gguf_pretokenizers.json").read_text())
    assert ref["ids"]["llama-bpe"] != ref["ids"]["default"] != ref["ids"]["qwen2"]  # the splits matter here
    for pre, expected in ref["ids"].items():
        metadata = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": ref["tokens"],
                    "tokenizer.ggml.merges": ref["merges"], "tokenizer.ggml.token_type": ref["token_type"]}
        tok = gguf_lm.tokenizer(metadata)
        assert [tok.encode(t).ids for t in ref["strings"]] == expected, pre
    qwen = gguf_lm.tokenizer({**metadata, "tokenizer.ggml.pre": "qwen2"})
    assert qwen.encode("cafe\u0301").ids == qwen.encode("caf\u00e9").ids  # Qwen2's tokenizer normalizes to NFC
    with pytest.raises(ValueError, match=r"tokenizer.ggml.pre 'tekken' .* --from hf"):
        gguf_lm.tokenizer({**metadata, "tokenizer.ggml.pre": "tekken"})


def test_control_tokens_outside_the_byte_alphabet_stay_whole_and_a_prompt_starts_with_bos(tmp_path):
    """llama.cpp writes added tokens as they read: DeepSeek-R1-Distill-Qwen's control tokens
    ``<｜begin▁of▁sentence｜>``/``<｜end▁of▁sentence｜>`` (fullwidth bar, ``▁``) are one id each, as its
    ``tokenizer.json`` and llama.cpp match them (transformers' GGUF loading splits them into bytes),
    at their vocabulary ids (no id added); its template's ``{{ bos_token }}`` is then the BOS id."""
    from tokenizers import pre_tokenizers

    from vitmm.data import ops_text
    from vitmm.data.tokenizer import HFTokenizer
    from vitmm.lm_chat import reply_prompt

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    specials = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"]
    tokens = alphabet + specials
    metadata = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "deepseek-r1-qwen", "tokenizer.ggml.merges": [],
                "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": [1] * len(alphabet) + [3, 3, 4, 4]}
    tok = gguf_lm.tokenizer(metadata)
    bos, eos = tokens.index(specials[0]), tokens.index(specials[1])
    assert tok.get_vocab_size(with_added_tokens=True) == len(tokens)
    assert tok.encode(specials[0] + "hi" + specials[1]).ids == [bos, *tok.encode("hi").ids, eos]
    template = ("{{ bos_token }}{% for m in messages %}{{ '<｜User｜>' + m['content'] }}{% endfor %}"
                "{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}")  # DeepSeek-R1-Distill's, shortened
    path = tmp_path / "tokenizer.json"
    path.write_text(tok.to_str())
    hf = HFTokenizer(path, bos_id=bos, eos_id=eos, pad_id=eos, chat_template=template)
    out = reply_prompt(ops_text.conversation_tokens(64, hf), {"conversations": [{"from": "human", "value": "hi"}]})
    prompt = [int(i) for i in out["ids"][: int(out["prompt_len"])]]
    assert prompt == [bos, len(alphabet) + 2, *tok.encode("hi").ids, len(alphabet) + 3]


def test_unsupported_or_broken_files_are_named(tmp_path):
    bad = tmp_path / "cut.gguf"
    bad.write_bytes((FIXTURE / "tiny.gguf").read_bytes()[:5000])
    with pytest.raises(ValueError, match=r"cut.gguf is truncated or not a GGUF file"):
        gguf_lm.load(bad)
    with pytest.raises(FileNotFoundError, match="nothing is downloaded"):
        gguf_lm.load(tmp_path / "missing.gguf")
    metadata, _ = gguf_lm.read(FIXTURE / "tiny.gguf")
    with pytest.raises(ValueError, match=r"architecture 'mamba' is not supported; vitmm reads \('llama', 'qwen2'"):
        gguf_lm.lm_kwargs({**metadata, "general.architecture": "mamba"}, "x.gguf")
    with pytest.raises(ValueError, match=r"tokenizer.ggml.model 'llama' \(SentencePiece"):
        gguf_lm.tokenizer({**metadata, "tokenizer.ggml.model": "llama"}, "x.gguf")
    no_vocab = {k: v for k, v in metadata.items() if k != "tokenizer.ggml.tokens"}
    with pytest.raises(ValueError, match="carries no tokenizer"):
        gguf_lm.lm_kwargs(no_vocab, "x.gguf")


@pytest.mark.parametrize("keep, message", [
    (-3, r"is truncated: it has 76,669 bytes but the 20 tensors its header lists need 76,672 \(tensor "
         r"output_norm.weight runs past the end\)"),
    (40_000, r"is truncated: it has 40,000 bytes but the 20 tensors its header lists need 76,672 \(tensor "
             r"blk.0.ffn_gate.weight runs past the end\)"),
    (7_552, r"is truncated: it has 7,552 bytes .* \(tensor token_embd.weight runs past the end\)"),
    (100, r"is truncated or not a GGUF file: its 100 bytes end inside the header \(the metadata\)"),
    (10, r"is truncated or not a GGUF file: its 10 bytes end inside the header \(the version and counts\)"),
    (0, r"is empty \(0 bytes\): truncated, not a GGUF file"),
], ids=["end", "in-tensor-data", "before-tensor-data", "in-metadata", "in-counts", "empty"])
def test_a_truncated_file_is_named_with_its_size_before_anything_is_read(tmp_path, monkeypatch, keep, message):
    """A download or copy cut short: one line naming the file, its bytes against what the header
    needs, and the fix, raised before the gguf package maps any tensor."""
    cut = tmp_path / "cut.gguf"
    cut.write_bytes((FIXTURE / "tiny.gguf").read_bytes()[:keep])
    monkeypatch.setattr("gguf.GGUFReader", lambda *a, **k: pytest.fail("the file was read"))
    for fn in (gguf_lm.load, gguf_lm.read_metadata):
        with pytest.raises(ValueError, match=rf"^{re.escape(str(cut))} {message}; download or copy it again\.$"):
            fn(cut)


def test_a_file_that_is_not_gguf_is_named(tmp_path):
    data = (FIXTURE / "tiny.gguf").read_bytes()
    (tmp_path / "zip.gguf").write_bytes(b"PK\x03\x04" + data[4:])
    with pytest.raises(ValueError, match=r"zip.gguf is not a GGUF file: it starts with b'PK\\x03\\x04', not b'GGUF'"):
        gguf_lm.read_metadata(tmp_path / "zip.gguf")


@pytest.mark.parametrize("change, message", [
    ({"tokenizer.ggml.model": "llama"},
     r"tokenizer.ggml.model 'llama' \(SentencePiece, which llama.cpp writes for Gemma 2/3, Phi-3 and Llama-2-style "
     r"models .*\) is not supported; .*python -m vitmm.interop --from hf --src FOLDER"),
    ({"general.architecture": "mamba"}, r"architecture 'mamba' is not supported"),
    ({"llama.rope.scaling.type": "yarn"}, r"RoPE scaling 'yarn' \(llama.rope.scaling.type\) is not supported")])
def test_what_the_metadata_refuses_is_refused_before_any_tensor_is_dequantized(monkeypatch, change, message):
    """A real Gemma 2 9B file is ~37 GB in float32: its (metadata-only) refusal must not come after
    dequantizing it."""
    metadata = gguf_lm._metadata
    monkeypatch.setattr(gguf_lm, "_metadata", lambda reader: {**metadata(reader), **change})
    monkeypatch.setattr("gguf.quants.dequantize", lambda *a, **k: pytest.fail("a tensor was dequantized"))
    with pytest.raises(ValueError, match=message):
        gguf_lm.load(FIXTURE / "tiny.gguf")
