"""Hugging Face causal language models → vitmm ``LM``: Llama (SmolLM, SmolLM2, TinyLlama, Llama 3
with its RoPE rescaling), Qwen2/Qwen2.5 (q/k/v biases), Qwen3 (per-head q/k RMSNorms), Mistral
(sliding-window attention), Phi-3 (fused q/k/v and gate/up weights, a sliding window), Gemma (√width
embedding scale, RMSNorm with 1 + w, GELU-tanh gate, its own head_dim), Gemma 2 (Gemma's, plus
each sub-layer's output normalised, soft-capped scores and logits, a window on every other layer) and
Gemma 3's text model (Gemma 2's layout with q/k norms, windows on its ``layer_types``' sliding layers
with their own RoPE base, the global layers' RoPE linearly scaled, no soft caps).

    kwargs, params = hf_lm.load_lm("~/models/SmolLM2-135M-Instruct")   # LM(**kwargs)
    logits = LM(**kwargs).apply({"params": params}, ids)

Reads a local ``config.json`` and ``model.safetensors`` (or the shards a
``model.safetensors.index.json`` lists). Correspondence: ``model.embed_tokens`` →
``token_embedding``; each ``model.layers.i``'s norms as ``NORMS`` maps them,
``self_attn.{q,k,v,o}_proj`` → ``attn.{q,k,v,o}``, ``mlp.{gate,up,down}_proj`` →
``mlp.{gate,up,down}`` (PyTorch ``[out, in]`` → ``[in, out]``); ``model.norm`` → ``final_norm``;
``lm_head`` → ``head`` unless the embeddings are tied. No permutation is needed: vitmm's RoPE
pairs channels as Hugging Face's ``rotate_half`` does.
"""

from __future__ import annotations

import pathlib

import jax.numpy as jnp
import numpy as np

from vitmm.interop import io
from vitmm.interop.common import StateDict, finish

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "gemma", "gemma2", "gemma3_text")
GEMMAS = ("gemma", "gemma2", "gemma3_text")
# the families whose config's attention_bias gives q, k, v and o_proj each a bias (Qwen2: q/k/v always)
ATTENTION_BIAS = ("llama", "qwen3", *GEMMAS)


def _rope(config: dict, src=None) -> tuple[float, dict | None]:
    """``(theta, scaling)`` from either transformers 5's ``rope_parameters`` or the older
    ``rope_theta`` + ``rope_scaling``."""
    params = dict(config.get("rope_parameters") or {})
    legacy = dict(config.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", config.get("rope_theta", 10_000.0)))
    scaling = {**legacy, **{k: v for k, v in params.items() if k != "rope_theta"}}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind == "linear":
        return theta, {"rope_type": "linear", "factor": float(scaling["factor"])}
    if kind != "llama3":
        raise ValueError(f"{src}: RoPE scaling {kind!r} is not supported; vitmm reads 'default', 'linear' and "
                         "'llama3'. To run it at its original context length, drop the scaling (rope_scaling, or "
                         "rope_parameters' rope_type and factor) from its config.json.")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    return theta, {"rope_type": "llama3", **{k: scaling[k] for k in keys}}


# transformers' config classes' defaults (5.25; the same in 4.x) for the fields vitmm reads: transformers 4
# writes a VLM's text_config with only the fields that differ from them (llava-1.5-7b-hf's names no
# hidden_size). Fields computed from others (head_dim, Llama's and Phi-3's KV heads) are left to them;
# tests/interop checks this table against transformers' classes.
_COMMON = dict(hidden_act="silu", rms_norm_eps=1e-6, tie_word_embeddings=False, num_hidden_layers=32,
               num_attention_heads=32)
LM_DEFAULTS = {
    "llama": dict(_COMMON, vocab_size=32000, hidden_size=4096, intermediate_size=11008),
    "qwen2": dict(_COMMON, vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_key_value_heads=32),
    "qwen3": dict(_COMMON, vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_key_value_heads=32,
                  head_dim=128),
    "mistral": dict(_COMMON, vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_key_value_heads=8,
                    sliding_window=4096),
    "phi3": dict(_COMMON, vocab_size=32064, hidden_size=3072, intermediate_size=8192, rms_norm_eps=1e-5),
    "gemma": dict(vocab_size=256000, hidden_size=3072, intermediate_size=24576, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=16, head_dim=256, hidden_act="gelu_pytorch_tanh",
                  rms_norm_eps=1e-6, tie_word_embeddings=True),
    "gemma2": dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                   num_attention_heads=8, num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh",
                   rms_norm_eps=1e-6, tie_word_embeddings=True, sliding_window=4096, query_pre_attn_scalar=256,
                   attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
    "gemma3_text": dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                        num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                        hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6, tie_word_embeddings=True,
                        sliding_window=4096, query_pre_attn_scalar=256, rope_theta=1_000_000.0),
}


def lm_kwargs(config: dict, src) -> dict:
    """vitmm ``LM`` fields from a transformers ``config.json`` (a VLM's ``text_config`` too: fields it
    leaves out take transformers' defaults, ``LM_DEFAULTS``)."""
    family = config.get("model_type")
    if family not in FAMILIES:
        raise ValueError(f"{src}: model_type {family!r} is not a language model vitmm reads; supported: {FAMILIES}.")
    config = {**LM_DEFAULTS[family], **config}
    if config.get("mlp_bias"):
        raise ValueError(f"{src}: MLP biases (mlp_bias=true) are not supported.")
    if float(config.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError(f"{src}: partial_rotary_factor={config['partial_rotary_factor']} (RoPE on part of each head) "
                         "is not supported.")
    if family in ("qwen2", "qwen3") and config.get("use_sliding_window"):
        raise ValueError(f"{src}: {family}'s use_sliding_window=true (windows on the layers from max_window_layers on) "
                         "is not supported; set it to false in config.json to run every layer unwindowed.")
    width, heads = config["hidden_size"], config["num_attention_heads"]
    per_type = (config.get("rope_parameters") or {}).get("full_attention")  # Gemma 3: per layer type
    theta, scaling = _rope({**config, "rope_parameters": per_type} if per_type else config, src)
    head_dim = config.get("head_dim") or width // heads
    act = config.get("hidden_activation") or config.get("hidden_act", "silu")
    if family == "gemma" and act == "gelu" and not config.get("hidden_activation"):
        # Google's Gemma 1 configs say "gelu" and mean the tanh GELU: transformers' GemmaConfig turns
        # hidden_act="gelu" into "gelu_pytorch_tanh" ("a legacy value of the official releases",
        # models/gemma/configuration_gemma.py, __post_init__)
        act = "gelu_pytorch_tanh"
    acts = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
    if act not in acts:
        raise ValueError(f"{src}: activation {act!r} is not supported; vitmm has {sorted(acts)}.")
    gemma = family in GEMMAS
    return dict(vocab_size=config["vocab_size"], width=width, depth=config["num_hidden_layers"], num_heads=heads,
                num_kv_heads=config.get("num_key_value_heads") or heads,
                head_dim=None if head_dim * heads == width else head_dim, mlp_dim=config["intermediate_size"],
                # Mistral's and Phi-3's attention has no biases, whatever attention_bias a config carries
                qkv_bias=family == "qwen2" or (family in ATTENTION_BIAS and bool(config.get("attention_bias"))),
                rope_theta=theta,
                rope_scaling=scaling, norm_eps=float(config.get("rms_norm_eps", 1e-6)), norm_offset=gemma,
                embed_scale=gemma, act=acts[act], tie_embeddings=bool(config.get("tie_word_embeddings", gemma)),
                **({"qk_norm": True} if family in ("qwen3", "gemma3_text") else {}),
                **({"sliding_window": int(config["sliding_window"])}
                   if family in ("mistral", "phi3") and config.get("sliding_window") else {}),
                **(_gemma2(config, src) if family in ("gemma2", "gemma3_text") else {}),
                **(_gemma3(config) if family == "gemma3_text" else {}))


def _gemma3(config: dict) -> dict:
    """Gemma 3's sliding layers' RoPE base (transformers 5's ``rope_parameters`` per layer type, or
    the older ``rope_local_base_freq``)."""
    local = (config.get("rope_parameters") or {}).get("sliding_attention") or {}
    return {"local_rope_theta": float(local.get("rope_theta", config.get("rope_local_base_freq", 10_000.0)))}


def _gemma2(config: dict, src) -> dict:
    """Gemma 2's own fields: the window on its ``sliding_attention`` layers (every other one by
    default), the sub-layers' output norms, its query scale and the two soft caps."""
    depth = config["num_hidden_layers"]
    # Gemma 3: every 6th layer global, or its config's sliding_window_pattern (as transformers reads it)
    pattern = int(config.get("sliding_window_pattern") or 6) if config.get("model_type") == "gemma3_text" else 2
    types = config.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                          for i in range(depth)]
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise ValueError(f"{src}: layer types {unknown} are not supported.")
    return dict(sliding_window=int(config.get("sliding_window") or 4096), post_norms=True,
                window_layers=tuple(i for i, t in enumerate(types) if t == "sliding_attention"),
                query_scale=float(config.get("query_pre_attn_scalar") or 256),
                attn_softcap=config.get("attn_logit_softcapping"), logit_softcap=config.get("final_logit_softcapping"))


def _linear(sd: StateDict, name: str, bias: bool) -> dict:
    out = {"kernel": sd.take(f"{name}.weight").T}
    if bias:
        out["bias"] = sd.take(f"{name}.bias")
    return out


# A block's norms: vitmm's name → transformers'. Gemma 2 normalises each sub-layer's output too, and
# its post_attention_layernorm is that output norm, not the MLP's input norm as in Llama.
NORMS = {"llama": {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"},
         "gemma2": {"attn_norm": "input_layernorm", "attn_post_norm": "post_attention_layernorm",
                    "mlp_norm": "pre_feedforward_layernorm", "mlp_post_norm": "post_feedforward_layernorm"}}


def _qkv_sizes(kwargs: dict) -> tuple[int, int, int]:
    head_dim = kwargs["head_dim"] or kwargs["width"] // kwargs["num_heads"]
    return kwargs["num_heads"] * head_dim, kwargs["num_kv_heads"] * head_dim, kwargs["num_kv_heads"] * head_dim


def _split(sd: StateDict, name: str, roles, sizes) -> None:
    """A fused ``[sum(sizes), in]`` weight (``{name}.weight``) into one per role, named as the
    unfused layers are (``..._proj`` of each role), back into ``sd``."""
    fused = sd.take(f"{name}.weight")
    if fused.shape[0] != sum(sizes):
        sd.missing.append(f"{name}.weight of {sum(sizes)} rows (it has {fused.shape[0]})")
        return
    parent = name.rsplit(".", 1)[0]
    for role, part in zip(roles, np.split(fused, np.cumsum(sizes)[:-1]), strict=True):
        sd.tensors[f"{parent}.{role}_proj.weight"] = part


def load_lm(src: str | pathlib.Path) -> tuple[dict, dict]:
    """``(LM kwargs, params)`` of a transformers ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` /
    ``GemmaForCausalLM`` folder; anything missing, left over or mis-shaped is listed in one error."""
    return lm_from_tensors(io.read_json(src), io.read_tensors(src), src)


def lm_from_tensors(config: dict, tensors: dict, src) -> tuple[dict, dict]:
    """``load_lm`` on a config and tensors already read (``model.*`` and ``lm_head.*`` names; a VLM's
    language model once its own prefix is taken off)."""
    from vitmm.models.lm import LM

    kwargs = lm_kwargs(config, src)
    tensors = dict(tensors)
    if kwargs["tie_embeddings"]:
        tensors.pop("lm_head.weight", None)  # a tied head, when saved at all, is the embedding matrix
    sd = StateDict(tensors, str(src))
    params = {"token_embedding": {"embedding": sd.take("model.embed_tokens.weight")},
              "final_norm": {"scale": sd.take("model.norm.weight")}}
    for i in range(kwargs["depth"]):
        p = f"model.layers.{i}"
        if sd.has(f"{p}.self_attn.qkv_proj.weight"):  # Phi-3: q, k and v in one matrix, gate and up in another
            _split(sd, f"{p}.self_attn.qkv_proj", ("q", "k", "v"), _qkv_sizes(kwargs))
            _split(sd, f"{p}.mlp.gate_up_proj", ("gate", "up"), (kwargs["mlp_dim"],) * 2)
        attn = {r: _linear(sd, f"{p}.self_attn.{r}_proj", kwargs["qkv_bias"]) for r in ("q", "k", "v")}
        attn["o"] = _linear(sd, f"{p}.self_attn.o_proj", False)
        if sd.has(f"{p}.self_attn.o_proj.bias"):  # attention_bias=true biases o_proj too; vitmm's o has none
            if np.any(sd.take(f"{p}.self_attn.o_proj.bias") != 0):
                raise ValueError(f"{src}: {p}.self_attn.o_proj.bias is not all zeros (attention_bias=true), and "
                                 "vitmm's LM has no bias on the attention output (only q/k/v biases): it cannot run "
                                 "this model.")
        if kwargs.get("qk_norm"):
            attn.update({f"{r}_norm": {"scale": sd.take(f"{p}.self_attn.{r}_norm.weight")} for r in "qk"})
        norms = NORMS["gemma2" if kwargs.get("post_norms") else "llama"]  # Gemma 3's are Gemma 2's
        params[f"block_{i:02d}"] = {
            **{ours: {"scale": sd.take(f"{p}.{theirs}.weight")} for ours, theirs in norms.items()},
            "attn": attn, "mlp": {r: _linear(sd, f"{p}.mlp.{r}_proj", False) for r in ("gate", "up", "down")}}
    if not kwargs["tie_embeddings"]:
        params["head"] = _linear(sd, "lm_head", False)
    params = finish(sd, LM(**kwargs), params, (jnp.zeros((1, 4), jnp.int32),), f"a vitmm LM ({config['model_type']})")
    return kwargs, params


def export_lm(kwargs: dict, params: dict, family: str | None = None) -> tuple[dict, dict]:
    """``(tensors, config.json dict)`` of a vitmm ``LM`` in transformers' layout (the inverse of
    ``load_lm``): Gemma if the settings say so (norm offset, embedding scale), else Qwen2 with
    q/k/v biases, else Llama; merge LoRA adapters first (``lora.merge``). A Llama, Qwen3 or Gemma
    with q/k/v biases is written with ``attention_bias`` and the zero o_proj bias it implies."""
    import numpy as np

    family = family or ("gemma3_text" if kwargs.get("post_norms") and kwargs.get("qk_norm")
                        else "gemma2" if kwargs.get("post_norms") else "gemma" if kwargs.get("norm_offset")
                        else "qwen3" if kwargs.get("qk_norm")
                        else "qwen2" if kwargs.get("qkv_bias") else "mistral" if kwargs.get("sliding_window")
                        else "llama")
    if family == "qwen2" and not kwargs.get("qkv_bias"):
        raise ValueError("family 'qwen2': transformers' Qwen2 always has q/k/v biases and this LM has none; write it "
                         "as a 'llama' (the same layers without the biases).")
    if kwargs.get("qkv_bias") and family not in (*ATTENTION_BIAS, "qwen2"):
        raise ValueError("An LM with q/k/v biases is a Qwen2 (or a Llama, Qwen3, Gemma with attention_bias); "
                         f"{family!r}'s layout has none.")
    if kwargs.get("sliding_window") and family not in ("mistral", "gemma2", "gemma3_text"):
        raise ValueError(f"An LM with a sliding window is written as a Mistral; {family!r}'s layout has none.")
    if kwargs.get("qk_norm") and family not in ("qwen3", "gemma3_text"):
        raise ValueError(f"An LM with q/k norms is a Qwen3; {family!r}'s layout has none.")
    if kwargs.get("local_rope_theta") and family != "gemma3_text":
        raise ValueError(f"An LM with a local RoPE base is a Gemma 3; {family!r}'s layout has none.")
    if family in GEMMAS and not (kwargs.get("norm_offset") and kwargs.get("embed_scale")):
        raise ValueError("Gemma's layout needs norm_offset and embed_scale; this LM has neither.")
    if family not in GEMMAS and (kwargs.get("embed_scale") or kwargs.get("norm_offset")):
        raise ValueError(f"An LM with embed_scale or norm_offset alone has no transformers layout ({family!r} has "
                         "neither; Gemma has both).")
    act = kwargs.get("act", "silu")  # LM's default
    if act != ("gelu_tanh" if family in GEMMAS else "silu"):
        raise ValueError(f"act={act!r}: {family!r}'s layout runs {'gelu_tanh' if family in GEMMAS else 'silu'}.")
    extra = [k for k in ("query_scale", "attn_softcap", "logit_softcap", "window_layers") if kwargs.get(k) is not None]
    if extra and family not in ("gemma2", "gemma3_text"):
        raise ValueError(f"{extra} are Gemma 2/3 settings; {family!r}'s layout has none.")
    t = lambda x: np.ascontiguousarray(np.asarray(x, np.float32).T)  # noqa: E731 - [in, out] -> [out, in]
    tensors = {"model.embed_tokens.weight": np.asarray(params["token_embedding"]["embedding"], np.float32),
               "model.norm.weight": np.asarray(params["final_norm"]["scale"], np.float32)}
    for i in range(kwargs["depth"]):
        b, p = params[f"block_{i:02d}"], f"model.layers.{i}"
        for ours, theirs in NORMS["gemma2" if family in ("gemma2", "gemma3_text") else "llama"].items():
            tensors[f"{p}.{theirs}.weight"] = np.asarray(b[ours]["scale"], np.float32)
        for role in ("q", "k", "v", "o"):
            tensors[f"{p}.self_attn.{role}_proj.weight"] = t(b["attn"][role]["kernel"])
            if "bias" in b["attn"][role]:
                tensors[f"{p}.self_attn.{role}_proj.bias"] = np.asarray(b["attn"][role]["bias"], np.float32)
        if kwargs.get("qkv_bias") and family in ATTENTION_BIAS:  # its attention_bias biases o_proj too: zeros
            tensors[f"{p}.self_attn.o_proj.bias"] = np.zeros(kwargs["width"], np.float32)
        for role in ("gate", "up", "down"):
            tensors[f"{p}.mlp.{role}_proj.weight"] = t(b["mlp"][role]["kernel"])
        for role in ("q", "k") if kwargs.get("qk_norm") else ():
            tensors[f"{p}.self_attn.{role}_norm.weight"] = np.asarray(b["attn"][f"{role}_norm"]["scale"], np.float32)
    if not kwargs.get("tie_embeddings"):
        tensors["lm_head.weight"] = t(params["head"]["kernel"])
    heads = kwargs["num_heads"]
    if (kwargs.get("rope_scaling") or {}).get("rope_type") == "factors":
        raise ValueError("the LM's RoPE holds a GGUF's per-frequency factors (rope_freqs), which transformers has no "
                         "rope_type for; convert the LM from its transformers folder (its llama3 rope_parameters) "
                         "to export it.")
    classes = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
               "mistral": "MistralForCausalLM", "gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM",
               "gemma3_text": "Gemma3ForCausalLM"}
    config = {"model_type": family, "architectures": [classes[family]],
              "vocab_size": kwargs["vocab_size"], "hidden_size": kwargs["width"], "num_hidden_layers": kwargs["depth"],
              "num_attention_heads": heads, "num_key_value_heads": kwargs.get("num_kv_heads") or heads,
              "head_dim": kwargs.get("head_dim") or kwargs["width"] // heads,
              "intermediate_size": kwargs.get("mlp_dim") or int(8 * kwargs["width"] / 3) // 8 * 8,
              "rms_norm_eps": kwargs.get("norm_eps", 1e-6), "tie_word_embeddings": bool(kwargs.get("tie_embeddings")),
              "rope_parameters": {"rope_theta": kwargs.get("rope_theta", 10_000.0),
                                  **(kwargs.get("rope_scaling") or {"rope_type": "default"})},
              "torch_dtype": "float32"}
    if family in ATTENTION_BIAS:
        config["attention_bias"] = bool(kwargs.get("qkv_bias"))
    if family == "mistral":
        config["sliding_window"] = kwargs["sliding_window"]
    if family in ("gemma2", "gemma3_text"):
        depth, windowed = kwargs["depth"], bool(kwargs.get("sliding_window"))  # no window: every layer full
        layers = kwargs.get("window_layers")
        # the scale the LM runs: query_scale, or by default the head size (scores times head_dim^-1/2)
        scale = float(kwargs.get("query_scale") or kwargs.get("head_dim") or kwargs["width"] // heads)
        if not scale.is_integer():
            raise ValueError(f"the LM's query_scale={scale} is not a whole number, which transformers' "
                             "query_pre_attn_scalar (an int) cannot hold.")
        config.update(sliding_window=kwargs["sliding_window"], query_pre_attn_scalar=int(scale),
                      attn_logit_softcapping=kwargs.get("attn_softcap"),
                      final_logit_softcapping=kwargs.get("logit_softcap"),
                      layer_types=["sliding_attention" if windowed and (layers is None or i in layers)
                                   else "full_attention" for i in range(depth)])
    # transformers 4's RoPE fields too (5 reads either form alike; 4 reads only these)
    config["rope_theta"] = kwargs.get("rope_theta", 10_000.0)
    if kwargs.get("rope_scaling"):
        config["rope_scaling"] = dict(kwargs["rope_scaling"])
    if family == "gemma3_text":  # the RoPE of each layer type: the sliding layers' own base, unscaled
        config["rope_local_base_freq"] = kwargs.get("local_rope_theta") or 10_000.0
        config["rope_parameters"] = {"full_attention": config["rope_parameters"], "sliding_attention": {
            "rope_type": "default", "rope_theta": config["rope_local_base_freq"]}}
    if family in GEMMAS:
        config["hidden_activation"] = "gelu_pytorch_tanh"
    else:
        config["hidden_act"] = "silu"
    return tensors, config
