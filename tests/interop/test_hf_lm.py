"""Hugging Face causal LMs (Llama with Llama 3 RoPE scaling, sharded; Qwen2 with q/k/v biases;
Qwen3 with per-head q/k norms; Mistral and Phi-3 with sliding windows, Phi-3's weights fused;
Gemma; Gemma 2 with output norms, soft caps and a window on alternate layers; Llama 3.2; Gemma 3's
text model with q/k norms and its sliding layers' own RoPE base, the global one linearly scaled) load
into vitmm's LM and reproduce transformers' logits on a ragged, left-padded batch (stored by
``tests/fixtures/interop/make_fixtures.py``): ≤ 1e-5 of the largest logit."""

import json
import pathlib
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

from vitmm.interop import hf_lm
from vitmm.models.lm import LM

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures/interop"
FAMILIES = ("hf_llama", "hf_qwen2", "hf_qwen3", "hf_mistral", "hf_phi3", "hf_gemma", "hf_gemma2", "hf_llama32",
            "hf_gemma3")


@pytest.mark.parametrize("name", FAMILIES)
def test_logits_match_transformers_on_a_left_padded_batch(name):
    kwargs, params = hf_lm.load_lm(FIXTURES / name)
    ref = np.load(FIXTURES / name / "io.npz")
    logits = np.asarray(LM(**kwargs).apply({"params": params}, jnp.asarray(ref["input_ids"]),
                                           pad_mask=jnp.asarray(ref["attention_mask"]) > 0,
                                           positions=jnp.asarray(ref["position_ids"])))
    real = ref["attention_mask"] > 0
    want = ref["logits"][real]
    err = np.abs(logits[real] - want).max() / np.abs(want).max()
    assert err <= 1e-5, f"{name}: {err:.2e}"


def test_gemma_1s_legacy_gelu_is_the_tanh_gelu_as_in_transformers(tmp_path):
    """google/gemma-2b(-it) and gemma-7b(-it) ship ``"hidden_act": "gelu"`` and no
    ``hidden_activation``; transformers' GemmaConfig runs that as ``gelu_pytorch_tanh``, and so does
    vitmm (the fixture's logits, made with the tanh GELU). Elsewhere exact GELU stays refused."""
    folder = tmp_path / "gemma"
    shutil.copytree(FIXTURES / "hf_gemma", folder)
    config = json.loads((folder / "config.json").read_text())
    config.pop("hidden_activation")
    (folder / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu"}))
    kwargs, params = hf_lm.load_lm(folder)
    assert kwargs["act"] == "gelu_tanh"
    ref = np.load(folder / "io.npz")
    logits = np.asarray(LM(**kwargs).apply({"params": params}, jnp.asarray(ref["input_ids"]),
                                           pad_mask=jnp.asarray(ref["attention_mask"]) > 0,
                                           positions=jnp.asarray(ref["position_ids"])))
    real = ref["attention_mask"] > 0
    assert np.abs(logits[real] - ref["logits"][real]).max() <= 1e-5 * np.abs(ref["logits"][real]).max()
    llama = json.loads((FIXTURES / "hf_llama" / "config.json").read_text())
    with pytest.raises(ValueError, match=r"activation 'gelu' is not supported"):
        hf_lm.lm_kwargs({**llama, "hidden_act": "gelu"}, "llama")


def test_each_family_sets_its_fields():
    llama, _ = hf_lm.load_lm(FIXTURES / "hf_llama")
    qwen, _ = hf_lm.load_lm(FIXTURES / "hf_qwen2")
    gemma, gemma_params = hf_lm.load_lm(FIXTURES / "hf_gemma")
    assert llama["num_kv_heads"] == 2 and llama["rope_scaling"]["rope_type"] == "llama3" and not llama["tie_embeddings"]
    assert qwen["qkv_bias"] and qwen["tie_embeddings"] and qwen["rope_theta"] == 1e6
    assert gemma["head_dim"] == 16 and gemma["norm_offset"] and gemma["embed_scale"] and gemma["act"] == "gelu_tanh"
    assert "head" not in gemma_params  # tied: the head is the embedding matrix
    qwen3, qwen3_params = hf_lm.load_lm(FIXTURES / "hf_qwen3")
    assert qwen3["qk_norm"] and not qwen3["qkv_bias"] and qwen3["tie_embeddings"]
    assert qwen3_params["block_00"]["attn"]["q_norm"]["scale"].shape == (8,)  # one scale per head channel
    mistral, _ = hf_lm.load_lm(FIXTURES / "hf_mistral")
    phi3, _ = hf_lm.load_lm(FIXTURES / "hf_phi3")  # its fused q/k/v and gate/up weights split
    assert mistral["sliding_window"] == 3 and phi3["sliding_window"] == 4 and phi3["num_kv_heads"] == 2
    gemma2, gemma2_params = hf_lm.load_lm(FIXTURES / "hf_gemma2")
    assert gemma2["window_layers"] == (0,) and gemma2["post_norms"] and gemma2["query_scale"] == 24
    assert (gemma2["attn_softcap"], gemma2["logit_softcap"]) == (0.5, 0.3) and gemma2["norm_offset"]
    assert set(gemma2_params["block_01"]) == {"attn_norm", "attn_post_norm", "mlp_norm", "mlp_post_norm", "attn", "mlp"}
    llama32, _ = hf_lm.load_lm(FIXTURES / "hf_llama32")
    assert llama32["tie_embeddings"] and llama32["rope_scaling"]["rope_type"] == "llama3"
    gemma3, _ = hf_lm.load_lm(FIXTURES / "hf_gemma3")
    assert gemma3["window_layers"] == (0, 1) and gemma3["qk_norm"] and gemma3["local_rope_theta"] == 100.0
    assert gemma3["rope_scaling"] == {"rope_type": "linear", "factor": 4.0} and gemma3["attn_softcap"] is None


def test_a_sliding_window_holds_in_kv_cache_decoding_as_in_the_full_forward():
    """Mistral's window of 3 over 7 tokens: one token at a time through the KV cache gives the
    full forward's logits."""
    from vitmm.models import lm as lm_lib

    kwargs, params = hf_lm.load_lm(FIXTURES / "hf_mistral")
    ids = jnp.asarray(np.load(FIXTURES / "hf_mistral/io.npz")["input_ids"][:1])
    model = LM(**kwargs)
    full = np.asarray(model.apply({"params": params}, ids))
    cache, steps = lm_lib.init_cache(kwargs, 1, 8), []
    for i in range(ids.shape[1]):
        logits, cache = model.apply({"params": params}, ids[:, i:i + 1], positions=jnp.full((1, 1), i), cache=cache)
        steps.append(np.asarray(logits[:, 0]))
    np.testing.assert_allclose(np.stack(steps, 1), full, atol=1e-5 * np.abs(full).max())
    unwindowed = np.asarray(LM(**{**kwargs, "sliding_window": None}).apply({"params": params}, ids))
    assert np.abs(unwindowed[0, 3:] - full[0, 3:]).max() > 1e-3  # the window changes what the later tokens see


def test_a_sliding_window_counts_tokens_not_the_empty_slots_after_a_right_padded_prompt():
    """A prompt of 4 tokens prefilled right-padded to 8 slots (as ``vitmm.chat`` rounds prompts up),
    then 2 tokens decoded at slots 8 and 9: the window of 3 skips the 4 empty slots between, so the
    cached logits are the full forward's of the 6 tokens (1e-5 of the largest)."""
    from vitmm.models import lm as lm_lib

    kwargs, params = hf_lm.load_lm(FIXTURES / "hf_mistral")
    ids = jnp.asarray(np.load(FIXTURES / "hf_mistral/io.npz")["input_ids"][:1])
    model = LM(**kwargs)
    full = np.asarray(model.apply({"params": params}, ids[:, :6]))
    padded = jnp.zeros((1, 8), jnp.int32).at[:, :4].set(ids[:, :4])
    first, cache = model.apply({"params": params}, padded, pad_mask=jnp.arange(8)[None] < 4,
                               cache=lm_lib.init_cache(kwargs, 1, 10), logits_at=jnp.array([[3]]))
    steps = [np.asarray(first[:, 0])]
    for i in range(4, 6):
        logits, cache = model.apply({"params": params}, ids[:, i:i + 1], positions=jnp.full((1, 1), i), cache=cache)
        steps.append(np.asarray(logits[:, 0]))
    np.testing.assert_allclose(np.stack(steps, 1), full[:, 3:], atol=1e-5 * np.abs(full).max())


def test_the_padded_row_equals_its_unpadded_forward():
    kwargs, params = hf_lm.load_lm(FIXTURES / "hf_llama")
    ref = np.load(FIXTURES / "hf_llama" / "io.npz")
    model = LM(**kwargs)
    padded = model.apply({"params": params}, jnp.asarray(ref["input_ids"]),
                         pad_mask=jnp.asarray(ref["attention_mask"]) > 0, positions=jnp.asarray(ref["position_ids"]))
    alone = model.apply({"params": params}, jnp.asarray(ref["input_ids"][1:, 2:]))
    np.testing.assert_allclose(np.asarray(padded)[1, 2:], np.asarray(alone)[0], rtol=1e-5, atol=1e-5)


def test_bad_checkpoints_are_named(tmp_path):
    shard_dir = tmp_path / "llama"
    shutil.copytree(FIXTURES / "hf_llama", shard_dir)
    (shard_dir / "model-00003-of-00005.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"names shards that are not in .*model-00003-of-00005"):
        hf_lm.load_lm(shard_dir)
    bert = tmp_path / "bert"
    shutil.copytree(FIXTURES / "hf_qwen2", bert)
    config = json.loads((bert / "config.json").read_text())
    (bert / "config.json").write_text(json.dumps({**config, "model_type": "bert"}))
    with pytest.raises(ValueError, match=r"model_type 'bert' is not a language model vitmm reads; supported"):
        hf_lm.load_lm(bert)
    rope = tmp_path / "yarn"
    shutil.copytree(FIXTURES / "hf_qwen2", rope)
    (rope / "config.json").write_text(json.dumps({**config, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}}))
    with pytest.raises(ValueError, match=r"RoPE scaling 'yarn' is not supported"):
        hf_lm.load_lm(rope)


@pytest.mark.parametrize("name", FAMILIES)
def test_export_round_trips_and_transformers_layout_loads_back(tmp_path, name):
    from vitmm.interop import io

    kwargs, params = hf_lm.load_lm(FIXTURES / name)
    tensors, config = hf_lm.export_lm(kwargs, params)
    io.write_safetensors(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(config))
    again_kwargs, again = hf_lm.load_lm(tmp_path)
    assert again_kwargs == kwargs
    import jax

    jax.tree.map(np.testing.assert_array_equal, again, params)
    if name == "hf_phi3":  # written as a Mistral: the same computation, q/k/v and gate/up unfused
        assert config["architectures"] == ["MistralForCausalLM"] and config["sliding_window"] == 4
        return
    saved = json.loads((FIXTURES / name / "config.json").read_text())  # transformers' own, typed as it checks them
    as_saved = lambda v: json.dumps(v, sort_keys=True)  # noqa: E731 (24 is not 24.0 there)
    assert {k: v for k, v in config.items() if k in saved and as_saved(v) != as_saved(saved[k])} == {}
    original = io.read_tensors(FIXTURES / name)
    assert set(tensors) == set(original) - ({"lm_head.weight"} if kwargs["tie_embeddings"] else set())
    for key, value in tensors.items():
        np.testing.assert_array_equal(value, original[key])  # the very tensors transformers saved


def test_each_export_runs_in_transformers_as_the_original(tmp_path):
    """Every family exported (``export_lm``) loads in transformers' ``AutoModelForCausalLM`` and gives
    the logits transformers gave on the original folder (≤ 1e-5 of the largest); a Llama, Qwen3 and
    Gemma 2 with q/k/v biases give vitmm's logits. Every weight written is read and none is left to
    transformers' own initialisation (it zeroes a missing o_proj bias with a warning: the logits alone
    would not show one). One process for all."""
    import os
    import subprocess

    from vitmm.interop import io

    python = os.environ.get("VITMM_LMMS_EVAL_PYTHON", "")
    if not pathlib.Path(python or "/nonexistent").is_file():
        pytest.skip("no environment with transformers (make eval-env; VITMM_LMMS_EVAL_PYTHON)")
    for name in FAMILIES:
        tensors, config = hf_lm.export_lm(*hf_lm.load_lm(FIXTURES / name))
        (tmp_path / name).mkdir()
        io.write_safetensors(tensors, tmp_path / name / "model.safetensors")
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    biased = _biased_exports(tmp_path / "biased")
    ran = subprocess.run([python, str(pathlib.Path(__file__).with_name("transformers_lm.py")), str(FIXTURES),
                          *(str(tmp_path / name) for name in FAMILIES), *map(str, biased)], capture_output=True,
                         text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert ran.returncode == 0, ran.stderr[-3000:]
    results = [json.loads(line) for line in ran.stdout.splitlines() if line.startswith("{")]
    assert [r["name"] for r in results] == [*FAMILIES, *(f.name for f in biased)]
    assert {r["name"]: r["error"] for r in results if r["error"] > 1e-5} == {}
    assert {r["name"]: r["missing"] + r["unexpected"] for r in results if r["missing"] + r["unexpected"]} == {}
    assert {r["class"] for r in results if r["name"] == "hf_phi3"} == {"MistralForCausalLM"}


def _with_qkv_biases(name: str, seed: int) -> tuple[dict, dict]:
    """The fixture ``name``'s LM given nonzero q/k/v biases (which a Llama, Qwen3 or Gemma 2 holds under
    transformers' ``attention_bias``, together with an o_proj bias)."""
    import jax

    kwargs, params = hf_lm.load_lm(FIXTURES / name)
    rng = np.random.default_rng(seed)
    params = jax.tree.map(np.asarray, params)
    for i in range(kwargs["depth"]):
        attn = params[f"block_{i:02d}"]["attn"]
        for role in "qkv":
            attn[role]["bias"] = rng.normal(0, 0.5, attn[role]["kernel"].shape[1]).astype(np.float32)
    return {**kwargs, "qkv_bias": True}, params


@pytest.mark.parametrize("name", ["hf_llama", "hf_qwen3", "hf_gemma2"])
def test_q_k_v_biases_export_with_the_zero_o_proj_bias_that_attention_bias_implies(tmp_path, name):
    """transformers' ``attention_bias=true`` gives o_proj a bias too: the export writes it as zeros
    (missing, transformers would initialise it at random and only warn) and the import takes it back
    when it is zeros, and refuses a nonzero one (vitmm's attention output has no bias)."""
    from vitmm.interop import io

    kwargs, params = _with_qkv_biases(name, 0)
    tensors, config = hf_lm.export_lm(kwargs, params, family=name[3:])
    assert config["attention_bias"] is True
    np.testing.assert_array_equal(tensors["model.layers.0.self_attn.o_proj.bias"], np.zeros(kwargs["width"]))
    io.write_safetensors(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(config))
    again_kwargs, again = hf_lm.load_lm(tmp_path)
    assert again_kwargs == kwargs
    import jax

    jax.tree.map(np.testing.assert_array_equal, again, params)
    with pytest.raises(ValueError, match=r"q/k/v biases .* 'mistral''s layout has none"):
        hf_lm.export_lm({**kwargs, "sliding_window": 4}, params, family="mistral")
    tensors["model.layers.1.self_attn.o_proj.bias"][3] = 0.25
    io.write_safetensors(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"^\S+: model.layers.1.self_attn.o_proj.bias is not all zeros .*no bias "
                                         r"on the attention output[^\n]*$"):
        hf_lm.load_lm(tmp_path)


@pytest.mark.parametrize("name", ["hf_mistral", "hf_phi3"])
def test_attention_bias_in_a_family_without_attention_biases_adds_none(name):
    """transformers' Mistral and Phi-3 build their attention without biases whatever attention_bias
    the config carries: vitmm reads no q/k/v biases for them (it would look for tensors not there)."""
    config = json.loads((FIXTURES / name / "config.json").read_text())
    assert hf_lm.lm_kwargs({**config, "attention_bias": True}, name)["qkv_bias"] is False
    assert hf_lm.lm_kwargs({**json.loads((FIXTURES / "hf_llama" / "config.json").read_text()),
                            "attention_bias": True}, "hf_llama")["qkv_bias"] is True


def test_a_gemma_without_a_window_is_written_with_every_layer_full():
    """A Gemma 2 layout whose LM has no sliding window (vitmm's ``sliding_window=None``) is written with
    every layer ``full_attention``, not every layer windowed by a window of None."""
    kwargs, params = hf_lm.load_lm(FIXTURES / "hf_gemma2")
    _, config = hf_lm.export_lm({**kwargs, "sliding_window": None, "window_layers": None}, params, family="gemma2")
    assert config["layer_types"] == ["full_attention"] * kwargs["depth"]
    _, config = hf_lm.export_lm(kwargs, params, family="gemma2")
    assert "sliding_attention" in config["layer_types"]


def test_an_lm_without_q_k_v_biases_is_not_written_as_a_qwen2():
    """transformers' Qwen2 always has q/k/v biases (missing, it would fill them itself): refused, naming Llama."""
    kwargs, params = hf_lm.load_lm(FIXTURES / "hf_llama")
    with pytest.raises(ValueError, match=r"family 'qwen2': .* always has q/k/v biases .* write it as a 'llama'"):
        hf_lm.export_lm(kwargs, params, family="qwen2")


def _biased_exports(root: pathlib.Path) -> list[pathlib.Path]:
    """A Llama, Qwen3 and Gemma 2 with q/k/v biases, exported into ``root/biased_NAME``, each with its
    own reference (``io.npz``: the fixture's ragged batch and vitmm's logits on it)."""
    from vitmm.interop import io

    folders = []
    for seed, name in enumerate(("hf_llama", "hf_qwen3", "hf_gemma2")):
        kwargs, params = _with_qkv_biases(name, seed)
        ref = dict(np.load(FIXTURES / name / "io.npz"))
        ref["logits"] = np.asarray(LM(**kwargs).apply({"params": params}, jnp.asarray(ref["input_ids"]),
                                                      pad_mask=jnp.asarray(ref["attention_mask"]) > 0,
                                                      positions=jnp.asarray(ref["position_ids"])))
        tensors, config = hf_lm.export_lm(kwargs, params, family=name[3:])
        folder = root / f"biased_{name}"
        folder.mkdir(parents=True)
        np.savez(folder / "io.npz", **ref)
        io.write_safetensors(tensors, folder / "model.safetensors")
        (folder / "config.json").write_text(json.dumps(config))
        folders.append(folder)
    return folders


def test_an_lm_with_output_norms_and_the_default_query_scale_exports_the_head_size():
    """Gemma 2's layout with ``query_scale=None`` (vitmm's default: scores scaled by head_dim^-1/2)
    is written with ``query_pre_attn_scalar`` = head_dim, which reads back to the same scores."""
    kwargs, params = hf_lm.load_lm(FIXTURES / "hf_gemma2")
    kwargs = {**kwargs, "query_scale": None}
    head_dim = kwargs["head_dim"] or kwargs["width"] // kwargs["num_heads"]
    _, config = hf_lm.export_lm(kwargs, params)
    assert config["query_pre_attn_scalar"] == head_dim
    again = hf_lm.lm_kwargs(config, "exported")
    assert again["query_scale"] == head_dim
    ids = jnp.asarray(np.load(FIXTURES / "hf_gemma2" / "io.npz")["input_ids"][:1])
    np.testing.assert_allclose(np.asarray(LM(**again).apply({"params": params}, ids)),
                               np.asarray(LM(**kwargs).apply({"params": params}, ids)), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("change, message", [
    ({"act": "gelu_tanh"}, r"act='gelu_tanh': 'llama''s layout runs silu"),
    ({"embed_scale": True}, r"embed_scale or norm_offset alone"),
    ({"logit_softcap": 30.0}, r"\['logit_softcap'\] are Gemma 2/3 settings; 'llama'"),
])
def test_an_lm_the_layout_cannot_hold_is_refused_not_exported_as_another(change, message):
    kwargs, params = hf_lm.load_lm(FIXTURES / "hf_llama")
    with pytest.raises(ValueError, match=message):
        hf_lm.export_lm({**kwargs, **change}, params)


def test_an_lm_with_merged_lora_exports_what_the_adapted_model_computes(tmp_path):
    import jax

    from vitmm.interop import io
    from vitmm.models import lora

    kwargs, params = hf_lm.load_lm(FIXTURES / "hf_qwen2")
    adapters = lora.init(params, (r"block_\d+/attn/(q|v)",), rank=2, key=jax.random.key(0))
    adapters = jax.tree.map(lambda x: x + 0.05, adapters)
    ids = jnp.asarray(np.load(FIXTURES / "hf_qwen2" / "io.npz")["input_ids"][:1])
    adapted = lora.apply(LM(**kwargs), params, adapters, 4.0, ids)
    tensors, config = hf_lm.export_lm(kwargs, lora.merge(params, adapters, 4.0))
    io.write_safetensors(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(config))
    again_kwargs, again = hf_lm.load_lm(tmp_path)
    np.testing.assert_allclose(np.asarray(LM(**again_kwargs).apply({"params": again}, ids)), np.asarray(adapted),
                               rtol=1e-5, atol=1e-5)


def test_bfloat16_safetensors_read_in_a_process_that_has_not_imported_jax(tmp_path):
    """Released VLMs ship bf16 weights; NumPy knows bfloat16 only once ml_dtypes is imported (JAX does
    it): the reader must not depend on what was imported before it."""
    import subprocess
    import sys

    import ml_dtypes
    from safetensors.numpy import save_file

    save_file({"w": np.arange(6, dtype=np.float32).reshape(2, 3).astype(ml_dtypes.bfloat16)},
              str(tmp_path / "model.safetensors"))
    code = ("import sys; from vitmm.interop import io; t = io.read_tensors(sys.argv[1]); "
            "assert 'jax' not in sys.modules; print(t['w'].astype('float32').tolist())")
    run = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "[[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]", run.stderr[-2000:]


def test_configs_that_change_which_layers_are_windowed_are_read_or_refused():
    """Gemma 3 configs on the Hub set ``sliding_window_pattern`` (transformers builds ``layer_types``
    from it, 6 by default); Qwen3's ``use_sliding_window`` windows layers vitmm does not, so it is
    refused as Qwen2's is; an unsupported RoPE scaling names the file and the way out."""
    config = json.loads((FIXTURES / "hf_gemma3" / "config.json").read_text())
    config = {k: v for k, v in config.items() if k not in ("layer_types", "_sliding_window_pattern")}
    assert hf_lm.lm_kwargs({**config, "num_hidden_layers": 7}, "g")["window_layers"] == (0, 1, 2, 3, 4, 6)
    two = {**config, "num_hidden_layers": 4, "sliding_window_pattern": 2}
    assert hf_lm.lm_kwargs(two, "g")["window_layers"] == (0, 2)
    qwen3 = json.loads((FIXTURES / "hf_qwen3" / "config.json").read_text())
    with pytest.raises(ValueError, match=r"^q3: qwen3's use_sliding_window=true .* set it to false"):
        hf_lm.lm_kwargs({**qwen3, "use_sliding_window": True, "sliding_window": 4}, "q3")
    with pytest.raises(ValueError, match=r"^q3: RoPE scaling 'yarn' is not supported.*config.json\.$"):
        hf_lm.lm_kwargs({**qwen3, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "q3")
