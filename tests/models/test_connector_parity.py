"""Connectors against the reference implementations' own modules: stored outputs of transformers'
LLaVA projector, Qwen2-VL ``PatchMerger``, InternVL's pixel shuffle and projector, BLIP-2
Q-Former and Idefics2's connector (SwiGLU projection + perceiver resampler), of Honeybee's
C-Abstractor as built from timm's ``RegStage``, and of MobileVLM's own LDPv2 projector code and
OpenFlamingo's own perceiver resampler (``tests/fixtures/interop/make_fixtures.py``),
loaded into vitmm's connectors through the weight mappings below. Tolerance: max abs difference
≤ 1e-6 of the reference's largest value, float32 (measured: ≤ 4.3e-7).
"""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vitmm.models import connectors as C

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures/connectors"
RTOL = 1e-6  # 1e-5 let a LayerNorm eps of 1e-6 instead of 1e-5 pass (4.5e-6)


def _load(name):
    data = np.load(FIXTURES / f"{name}.npz")
    weights = {k[2:]: data[k] for k in data.files if k.startswith("w/")}
    return data, weights


def linear(w, prefix):
    return {"kernel": w[f"{prefix}.weight"].T, "bias": w[f"{prefix}.bias"]}


def norm(w, prefix):
    return {"scale": w[f"{prefix}.weight"], "bias": w[f"{prefix}.bias"]}


def conv(w, prefix):  # torch [out, in, kh, kw] → flax [kh, kw, in, out]
    return {"kernel": w[f"{prefix}.weight"].transpose(2, 3, 1, 0)}


def llava_projector(w):
    return {"mlp": {"fc1": linear(w, "linear_1"), "fc2": linear(w, "linear_2")}}


def qwen2vl_patch_merger(w):
    return {"ln_q": norm(w, "ln_q"), "mlp": {"fc1": linear(w, "mlp.0"), "fc2": linear(w, "mlp.2")}}


def blip2_qformer(w):
    p = {"ln_vision": norm(w, "ln_vision"), "queries": w["query_tokens"][0],
         "query_norm": norm(w, "qformer.layernorm"), "out_proj": linear(w, "language_projection")}
    layers = sorted({int(k.split(".")[3]) for k in w if k.startswith("qformer.encoder.layer.")})
    for i in layers:
        layer = f"qformer.encoder.layer.{i}"
        for ours, theirs, norm_name in (("self", "attention", "sa_norm"), ("cross", "crossattention", "ca_norm")):
            if f"{layer}.{theirs}.attention.query.weight" not in w:
                continue
            for role, name in (("q", "query"), ("k", "key"), ("v", "value")):
                p[f"{ours}_{i}_{role}"] = linear(w, f"{layer}.{theirs}.attention.{name}")
            p[f"{ours}_{i}_out"] = linear(w, f"{layer}.{theirs}.output.dense")
            p[f"{norm_name}_{i}"] = norm(w, f"{layer}.{theirs}.output.LayerNorm")
        p[f"ff_in_{i}"] = linear(w, f"{layer}.intermediate_query.dense")
        p[f"ff_out_{i}"] = linear(w, f"{layer}.output_query.dense")
        p[f"ff_norm_{i}"] = norm(w, f"{layer}.output_query.LayerNorm")
    return p


def c_abstractor(w):
    p = {"pos_emb": w["pos_emb"], "readout": {"fc1": linear(w, "readout.0"), "fc2": linear(w, "readout.2")}}
    for stage in ("s1", "s2"):
        blocks = sorted({k.split(".")[1] for k in w if k.startswith(stage + ".")})
        for j, b in enumerate(blocks):
            t = f"{stage}.{b}"
            block = {"conv1": conv(w, f"{t}.conv1.conv"), "norm1": norm(w, f"{t}.conv1.bn"),
                     "conv2": conv(w, f"{t}.conv2.conv"), "norm2": norm(w, f"{t}.conv2.bn"),
                     "se_reduce": {**conv(w, f"{t}.se.fc1"), "bias": w[f"{t}.se.fc1.bias"]},
                     "se_expand": {**conv(w, f"{t}.se.fc2"), "bias": w[f"{t}.se.fc2.bias"]},
                     "conv3": conv(w, f"{t}.conv3.conv"), "norm3": norm(w, f"{t}.conv3.bn")}
            if f"{t}.downsample.conv.weight" in w:
                block.update(shortcut=conv(w, f"{t}.downsample.conv"), shortcut_norm=norm(w, f"{t}.downsample.bn"))
            p[f"{stage}_{j}"] = block
    return p


def internvl_pixel_shuffle(w):
    return {"norm": norm(w, "layer_norm"), "mlp": {"fc1": linear(w, "linear_1"), "fc2": linear(w, "linear_2")}}


def idefics2_perceiver(w):
    kernel = lambda k: {"kernel": w[f"{k}.weight"].T}  # noqa: E731
    glu = lambda k: {n: kernel(f"{k}.{n}_proj") for n in ("gate", "up", "down")}  # noqa: E731
    r = "perceiver_resampler"
    p = {"modality_projection": glu("modality_projection"), "latents": w[f"{r}.latents"],
         "norm_out": {"scale": w[f"{r}.norm.weight"]}}
    layers = sorted({int(k.split(".")[2]) for k in w if k.startswith(f"{r}.layers.")})
    for i in layers:
        layer = f"{r}.layers.{i}"
        p[f"norm_latents_{i}"] = {"scale": w[f"{layer}.input_latents_norm.weight"]}
        p[f"norm_context_{i}"] = {"scale": w[f"{layer}.input_context_norm.weight"]}
        p[f"ff_norm_{i}"] = {"scale": w[f"{layer}.post_attention_layernorm.weight"]}
        for role in ("q", "k", "v"):
            p[f"attn_{i}_{role}"] = kernel(f"{layer}.self_attn.{role}_proj")
        p[f"attn_{i}_out"] = kernel(f"{layer}.self_attn.o_proj")
        p[f"ff_{i}"] = glu(f"{layer}.mlp")
    return p


def mobilevlm_ldpv2(w):
    peg = w["peg.peg.0.weight"]  # depthwise [C, 1, 3, 3] → [3, 3, 1, C]
    return {"mlp": {"fc1": linear(w, "mlp.mlp.0"), "fc2": linear(w, "mlp.mlp.2")},
            "peg": {"kernel": peg.transpose(2, 3, 1, 0), "bias": w["peg.peg.0.bias"]}}


def openflamingo_perceiver(w):
    kernel = lambda k: {"kernel": w[f"{k}.weight"].T}  # noqa: E731
    r = "resampler"
    p = {"in_proj": linear(w, "in_proj"), "latents": w[f"{r}.latents"], "norm_out": norm(w, f"{r}.norm")}
    for i in sorted({int(k.split(".")[2]) for k in w if k.startswith(f"{r}.layers.")}):
        attn, ff = f"{r}.layers.{i}.0", f"{r}.layers.{i}.1"
        kv = w[f"{attn}.to_kv.weight"]
        p.update({f"norm_media_{i}": norm(w, f"{attn}.norm_media"),
                  f"norm_latents_{i}": norm(w, f"{attn}.norm_latents"),
                  f"attn_{i}_q": kernel(f"{attn}.to_q"), f"attn_{i}_k": {"kernel": kv[: len(kv) // 2].T},
                  f"attn_{i}_v": {"kernel": kv[len(kv) // 2:].T}, f"attn_{i}_out": kernel(f"{attn}.to_out"),
                  f"ff_norm_{i}": norm(w, f"{ff}.0"), f"ff_in_{i}": kernel(f"{ff}.1"),
                  f"ff_out_{i}": kernel(f"{ff}.3")})
    return p


CASES = {  # fixture: (connector config, grid, weight mapping)
    "openflamingo_perceiver": ({"name": "perceiver", "budget": 5, "depth": 2, "head_dim": 8}, (4, 6),
                               openflamingo_perceiver),
    "mobilevlm_ldpv2": ({"name": "ldp", "budget": 144}, (16, 16), mobilevlm_ldpv2),
    "llava_projector": ({"name": "mlp"}, (4, 6), llava_projector),
    "qwen2vl_patch_merger": ({"name": "patch_merger", "budget": 6}, (4, 6), qwen2vl_patch_merger),
    "internvl_pixel_shuffle": ({"name": "pixel_shuffle", "budget": 6}, (4, 6), internvl_pixel_shuffle),
    "blip2_qformer": ({"name": "qformer", "budget": 5, "depth": 3, "width": 32, "head_dim": 8}, (4, 6), blip2_qformer),
    "c_abstractor": ({"name": "c_abstractor", "budget": 4, "hidden": 16, "depth": 2}, (4, 6), c_abstractor),
    "idefics2_perceiver": ({"name": "idefics2_perceiver", "budget": 5, "depth": 2, "head_dim": 8, "num_heads": 4,
                            "num_kv_heads": 2, "proj_dim": 48, "eps": 1e-5}, (4, 6), idefics2_perceiver),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_connector_matches_the_reference_implementation(name):
    cfg, grid, mapping = CASES[name]
    data, weights = _load(name)
    x, want = jnp.asarray(data["x"]), data["out"]
    module = C.build(cfg, want.shape[-1])
    expected = jax.eval_shape(lambda x: module.init(jax.random.key(0), x, grid), x)["params"]
    params = jax.tree.map(jnp.asarray, mapping(weights))
    assert jax.tree.structure(params) == jax.tree.structure(expected)
    assert jax.tree.map(jnp.shape, params) == jax.tree.map(lambda s: s.shape, expected)
    got = np.asarray(module.apply({"params": params}, x, grid))
    assert got.shape == want.shape == (x.shape[0], C.num_visual_tokens(cfg, grid), want.shape[-1])
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err <= RTOL, f"{name}: {err:.2e}"
