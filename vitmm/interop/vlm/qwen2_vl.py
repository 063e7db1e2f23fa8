"""Qwen2-VL (``Qwen2VLForConditionalGeneration``) → a vitmm VLM workdir (``vlm.import_vlm``).

Its ViT becomes a vitmm ``ViT`` without class token or final norm, 2D RoPE (``posemb="rope2d"``,
its theta), QuickGELU, a bias-free patch embedding over two frames: a still image is repeated
into a 6-channel one by the ``temporal_patch(2)`` op (frame-major channels, as vitmm lays out a
video's temporal patches), the Conv3d kernel ``[D, 3, 2, p, p]`` read as ``[p, p, 2·3, D]``. Its
fused ``qkv`` has vitmm's layout; Qwen2-VL turns the first quarter of each head's rotation pairs
with the row and the second with the column, vitmm the other way round, so the query and key
channels of each head swap those quarters (``rope_order``, its own inverse: scores are unchanged).
The patch merger is the ``patch_merger`` connector (``merge`` 2: ``ln_q``, 2×2 windows, the MLP);
the LM is Qwen2 with M-RoPE (``mrope_section``; ``model.mrope``). Images keep their own sizes:
``smart_resize`` (its processor's rule), the tower's patches packed a prompt at a time with each
image's windows together (``input.sequences`` with ``tower_length``; ``data.sequences``), where
each ``<image>`` becomes ``<|vision_start|><image><|vision_end|>`` (``conversation_tokens``'s
``image_text``). Video frames are not imported (the processor's video branch needs torchvision).
"""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from vitmm.interop import hf_lm, io
from vitmm.interop.common import StateDict, finish, linear, norm

IMAGE_TEXT = "<|vision_start|><image><|vision_end|>"
MAX_IMAGES = 4  # images a prompt may hold (the image slots of vitmm.chat's flat sequences)


def rope_order(w: np.ndarray, heads: int) -> np.ndarray:
    """``w [..., heads · head_dim]`` with each head's channel quarters in the order (1, 0, 3, 2):
    between Qwen2-VL's 2D RoPE (row pairs first) and vitmm's (column pairs first). Its own inverse."""
    shape = w.shape
    quarters = w.reshape(*shape[:-1], heads, 4, shape[-1] // heads // 4)
    return quarters[..., [1, 0, 3, 2], :].reshape(shape)


def _swap_qk(qkv: dict, width: int, heads: int) -> dict:
    """A fused ``qkv`` Dense with its queries' and keys' channels in the other rotation order
    (``rope_order``; either way)."""
    kernel, bias = np.array(qkv["kernel"]), np.array(qkv["bias"])
    for part in (slice(0, width), slice(width, 2 * width)):
        kernel[:, part], bias[part] = rope_order(kernel[:, part], heads), rope_order(bias[part], heads)
    return {"kernel": kernel, "bias": bias}


def _names(tensors: dict) -> dict:
    """Qwen2-VL's tensors under one set of names (transformers writes ``visual.*`` and
    ``model.layers.*``, or ``model.visual.*`` and ``model.language_model.*``): ``visual.*``,
    ``model.*`` (the LM's own) and ``lm_head.*``."""
    out = {}
    for key, value in tensors.items():
        for old, new in (("model.visual.", "visual."), ("model.language_model.", "model.")):
            if key.startswith(old):
                key = new + key[len(old):]
                break
        out[key] = value
    return out


def vision_kwargs(config: dict, src) -> dict:
    from vitmm.interop.hf.layers import hf_activation

    v = config.get("vision_config") or {}
    width, heads = int(v.get("embed_dim", 1280)), int(v.get("num_heads", 16))
    if int(v.get("temporal_patch_size", 2)) != 2 or int(v.get("in_channels", 3)) != 3:
        raise ValueError(f"{src}: temporal_patch_size={v.get('temporal_patch_size')}, in_channels="
                         f"{v.get('in_channels')} are not supported; vitmm reads Qwen2-VL's 2 frames of RGB.")
    theta = float((v.get("rope_parameters") or {}).get("rope_theta", v.get("rope_theta", 10_000.0)))
    return dict(width=width, depth=int(v.get("depth", 32)), num_heads=heads,
                mlp_dim=int(width * v.get("mlp_ratio", 4)), patch_size=int(v.get("patch_size", 14)), class_token=False,
                posemb="rope2d", rope_theta=theta, pool="none", final_norm=False,
                act=hf_activation(v.get("hidden_act", "quick_gelu")), embed_bias=False, norm_eps=1e-6)


def _tower_params(sd: StateDict, vision: dict) -> dict:
    conv = sd.take("visual.patch_embed.proj.weight")  # [D, 3, T, p, p] → [p, p, T·3, D], frame-major
    d, c, t, p, q = conv.shape
    blocks = {}
    for i in range(vision["depth"]):
        b = f"visual.blocks.{i}"
        attn = {"qkv": _swap_qk(linear(sd, f"{b}.attn.qkv"), vision["width"], vision["num_heads"]),
                "out": linear(sd, f"{b}.attn.proj")}
        blocks[f"block_{i:02d}"] = {"norm1": norm(sd, f"{b}.norm1"), "norm2": norm(sd, f"{b}.norm2"), "attn": attn,
                                    "mlp": {"fc1": linear(sd, f"{b}.mlp.fc1"), "fc2": linear(sd, f"{b}.mlp.fc2")}}
    return {"embedding": {"kernel": conv.transpose(3, 4, 2, 1, 0).reshape(p, q, t * c, d)}, "encoder": blocks}


def _image_pp(images: dict, patch: int, merge: int, src) -> str:
    """Qwen2-VL's image processor as a pp: ``smart_resize`` to multiples of patch × merge between its
    pixel bounds (bicubic or bilinear, as ``resample`` says), then normalize and the two frames."""
    size = images.get("size") or {}  # min_pixels / max_pixels, when given, override it (as transformers reads them)
    low = images["min_pixels"] if images.get("min_pixels") is not None else size.get("shortest_edge")
    high = images["max_pixels"] if images.get("max_pixels") is not None else size.get("longest_edge")
    methods = {3: "bicubic", 2: "bilinear"}
    if not images.get("do_resize", True) or low is None or high is None or images.get("resample", 3) not in methods \
            or int(images.get("patch_size", patch)) != patch or int(images.get("merge_size", merge)) != merge:
        raise ValueError(f"{src}: image processing {images} is not supported; vitmm reads Qwen2-VL's smart_resize "
                         "(size shortest_edge/longest_edge as pixel counts), bicubic (3) or bilinear (2), the "
                         "model's patch and merge sizes.")
    return (f"decode(max_images={MAX_IMAGES}, alpha='white')|smart_resize({int(low)}, {int(high)}, {patch * merge}, "
            f"method='{methods[images.get('resample', 3)]}')|")


def load_qwen2_vl(src) -> tuple[dict, dict, dict]:
    """``(run config, VLM params, extras)`` of a ``Qwen2VLForConditionalGeneration`` folder."""
    from vitmm.interop.vlm.common import conversation_pp, processor_settings
    from vitmm.models.vit import ViT
    from vitmm.models.vlm import VLM

    src = pathlib.Path(src).expanduser()
    config = io.read_json(src)
    tensors = _names(io.read_tensors(src))
    vision = vision_kwargs(config, src)
    merge = int((config.get("vision_config") or {}).get("spatial_merge_size", 2))
    vision_sd = StateDict({k: v for k, v in tensors.items() if k.startswith("visual.") and
                           not k.startswith("visual.merger.")}, f"{src} (vision tower)")
    patch = vision["patch_size"]
    example = jnp.zeros((1, 2 * merge * patch, 2 * merge * patch, 6))
    tower = finish(vision_sd, ViT(**vision), _tower_params(vision_sd, vision), (example,),
                   "a vitmm ViT (Qwen2-VL's)")
    text = dict(config.get("text_config") or config)
    rope = {**(text.get("rope_scaling") or {}), **(text.get("rope_parameters") or {})}
    section = rope.pop("mrope_section", None)
    if section is None:
        raise ValueError(f"{src}: the text config has no mrope_section (Qwen2-VL's M-RoPE).")
    text.update(model_type="qwen2", rope_parameters={**rope, "rope_type": "default"}, rope_scaling=None)
    lm_tensors = {k: v for k, v in tensors.items() if k.startswith(("model.", "lm_head."))}
    lm, language = hf_lm.lm_from_tensors(text, lm_tensors, f"{src} (language model)")
    lm["mrope_section"] = tuple(int(s) for s in section)
    proj_sd = StateDict({k: v for k, v in tensors.items() if k.startswith("visual.merger.")}, f"{src} (merger)")
    project = {"ln_q": norm(proj_sd, "visual.merger.ln_q"),
               "mlp": {"fc1": linear(proj_sd, "visual.merger.mlp.0"), "fc2": linear(proj_sd, "visual.merger.mlp.2")}}
    left = sorted(set(tensors) - set(vision_sd.tensors) - set(lm_tensors) - set(proj_sd.tensors))
    problems = [f"  missing: {k}" for k in proj_sd.missing] + [f"  unused: {k}" for k in proj_sd.unused() + left]
    connector = {"name": "patch_merger", "merge": merge}
    model = dict(vision=vision, connector=connector, lm=lm, vision_layer=-1, use_cls=False, prefix_lm=False,
                 mrope=True, anyres=None, max_len=2048, loss_positions=None)
    params = {"tower": tower, "project": jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), project),
              "language": language}
    if not problems:
        expected = jax.eval_shape(VLM(vision, connector, lm, -1, mrope=True).init, jax.random.key(0), example,
                                  jnp.zeros((1, 4), jnp.int32))["params"]
        from vitmm import tree

        problems = tree.mismatches(expected, params)
    if problems:
        raise ValueError(f"Cannot load {src} as a vitmm VLM (Qwen2-VL):\n" + "\n".join(problems))
    images, _ = processor_settings(src)
    pp = (_image_pp(images, patch, merge, src) + "normalize({image_mean}, {image_std})|temporal_patch(2)|"
          + conversation_pp(f", image_text='{IMAGE_TEXT}'", ", optional=('more_images', 'image_positions')"))
    mean, std = images.get("image_mean"), images.get("image_std")
    factor = patch * merge  # a square within the pixel bounds: what a batch of square images would be
    side = max(factor, int(np.sqrt((images.get("size") or {}).get("longest_edge") or factor**2)) // factor * factor)
    # A prompt a row, its images at their own sizes, the tower's patches packed (vitmm.chat sizes
    # both to the prompts it gets; training sets its own input.sequences).
    sequences = dict(length=2048, max_images=MAX_IMAGES, pack=False, bins=1, max_num_patches=0, tower_length=4096)
    run = {"task": "vlm", "seed": 0, "model": model, "init": {"vision": None, "lm": None, "checkpoint": None},
           "lora": {"rank": 0, "alpha": 0.0, "dropout": 0.0, "targets": []},
           "input": {"pp": pp, "image_size": side, "image_mean": list(mean), "image_std": list(std),
                     "sequences": sequences}}
    return run, params, {"text_config": text}


def export_problems(model: dict, vision: dict, tower: dict, steps: list) -> list[str]:
    """Why ``Qwen2VLForConditionalGeneration`` cannot hold this VLM (empty: it can). ``steps``: the
    run's pp as ``preprocess.ops``."""
    wants = {"class_token": False, "posemb": "rope2d", "final_norm": False, "embed_bias": False, "pool": "none",
             "num_registers": 0, "qk_norm": False, "layerscale": None, "pre_norm": False, "stem": "patch"}
    wrong = [f"{k}={vision.get(k)!r} (needs {v!r})" for k, v in wants.items() if vision.get(k, _DEFAULTS.get(k)) != v]
    if vision.get("act", "gelu") not in ("quick_gelu", "gelu"):
        wrong.append(f"act={vision.get('act')!r}")
    if vision.get("mlp_dim") % vision["width"]:
        wrong.append(f"mlp_dim={vision.get('mlp_dim')} (Qwen2-VL's is a whole multiple of the width)")
    if tower["embedding"]["kernel"].shape[2] != 6:
        wrong.append("a patch embedding over one frame (Qwen2-VL's sees two: temporal_patch(2))")
    problems = [f"the tower: {'; '.join(wrong)}"] if wrong else []
    connector = dict(model["connector"])
    if connector.get("name") != "patch_merger" or connector.get("hidden") not in (None,) or not connector.get("merge"):
        problems.append(f"connector {connector} (Qwen2-VL's is the patch merger with a fixed merge)")
    if model.get("vision_layer", -1) != -1 or not model.get("mrope") or model.get("use_cls") or model.get("anyres") \
            or model.get("prefix_lm"):
        problems.append("the VLM (Qwen2-VL reads the tower's last block, M-RoPE, no CLS, AnyRes or prefix attention)")
    if not model["lm"].get("qkv_bias") or model["lm"].get("norm_offset") or model["lm"].get("qk_norm") \
            or model["lm"].get("sliding_window"):
        problems.append("the LM (Qwen2-VL's is a Qwen2)")
    names = [name for name, _, _ in steps]
    if "smart_resize" not in names or ("temporal_patch", (2,), {}) not in steps:
        problems.append(f"the image steps {names} (Qwen2-VL's processor: smart_resize, normalize, temporal_patch(2))")
    return problems


_DEFAULTS = {"posemb": "learn", "final_norm": True, "embed_bias": True, "pool": "tok", "class_token": True,
             "num_registers": 0, "qk_norm": False, "layerscale": None, "pre_norm": False, "stem": "patch"}


def export_qwen2_vl(workdir, out) -> dict:
    """The VLM in ``workdir`` as a transformers ``Qwen2VLForConditionalGeneration`` folder (the
    inverse of ``load_qwen2_vl``: weights in the layout transformers writes, config, processor,
    tokenizer, chat template) or ValueError with every reason it cannot be, before anything is
    written."""
    from vitmm.interop.vlm import common
    from vitmm.interop.vlm.common import export_folder, export_start, marks_ids, pil_resample, write_folder
    from vitmm.train import pp_template

    config, vision, lm, params, tokenizer, steps = export_start(workdir)
    marks = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
    ids, missing = marks_ids(tokenizer, marks)
    problems = export_problems({**config.model.to_dict(), "lm": lm}, vision, params["tower"], steps) + missing
    out = export_folder(workdir, "Qwen2VLForConditionalGeneration", problems, out)

    p = jax.tree.map(lambda x: np.asarray(x, np.float32), params)
    t = lambda x: np.ascontiguousarray(x.T)  # noqa: E731 - [in, out] -> [out, in]
    width, heads, merge = vision["width"], vision["num_heads"], int(config.model.connector.merge)
    kernel = p["tower"]["embedding"]["kernel"]
    ph, pw, _, d = kernel.shape
    tensors = {"visual.patch_embed.proj.weight": np.ascontiguousarray(
        kernel.reshape(ph, pw, 2, 3, d).transpose(4, 3, 2, 0, 1))}
    for i in range(vision["depth"]):
        b, name = p["tower"]["encoder"][f"block_{i:02d}"], f"visual.blocks.{i}"
        layers = {"norm1": b["norm1"], "norm2": b["norm2"], "attn.qkv": _swap_qk(b["attn"]["qkv"], width, heads),
                  "attn.proj": b["attn"]["out"], "mlp.fc1": b["mlp"]["fc1"], "mlp.fc2": b["mlp"]["fc2"]}
        tensors.update(_torch_layers(name, layers, t))
    project = p["project"]
    tensors.update(_torch_layers("visual.merger", {"ln_q": project["ln_q"], "mlp.0": project["mlp"]["fc1"],
                                                   "mlp.2": project["mlp"]["fc2"]}, t))
    language, text_config = hf_lm.export_lm(lm, params["language"], family="qwen2")
    tensors.update(language)
    if "lm_head.weight" not in tensors:  # a tied head: written out, what every version reads
        tensors["lm_head.weight"] = language["model.embed_tokens.weight"]
    special = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.pad_id}
    rope = {"rope_type": "default", "rope_theta": lm.get("rope_theta", 10_000.0),
            "mrope_section": [int(s) for s in lm["mrope_section"]]}
    text_config = {**{k: v for k, v in text_config.items() if k != "architectures"}, **special,
                   "model_type": "qwen2_vl_text", "rope_parameters": rope}
    vision_config = {"model_type": "qwen2_vl_vision", "depth": vision["depth"], "embed_dim": width,
                     "hidden_size": lm["width"], "hidden_act": "quick_gelu" if vision.get("act") == "quick_gelu"
                     else "gelu", "mlp_ratio": vision["mlp_dim"] // width, "num_heads": heads, "in_channels": 3,
                     "patch_size": ph, "spatial_merge_size": merge, "temporal_patch_size": 2,
                     "rope_parameters": {"rope_type": "axial", "rope_theta": vision.get("rope_theta", 100.0)}}
    hf_config = {"architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl",
                 "image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
                 "vision_start_token_id": ids["<|vision_start|>"], "vision_end_token_id": ids["<|vision_end|>"],
                 "tie_word_embeddings": bool(lm.get("tie_embeddings")), "text_config": text_config,
                 "vision_config": vision_config, "torch_dtype": "float32"}
    low, high, _ = next(a for n, a, _ in steps if n == "smart_resize")
    method = next(k for n, _, k in steps if n == "smart_resize").get("method", "bicubic")
    mean, std = pp_template.image_normalization(config)
    images = {"image_processor_type": "Qwen2VLImageProcessor", "do_convert_rgb": True, "do_resize": True,
              "size": {"shortest_edge": int(low), "longest_edge": int(high)},
              "resample": pil_resample(method), "do_rescale": True, "rescale_factor": 1 / 255,
              "do_normalize": True, "image_mean": list(mean),
              "image_std": list(std), "patch_size": ph, "temporal_patch_size": 2, "merge_size": merge}
    # Its video processor's settings (AutoProcessor loads one; vitmm imports no video from Qwen2-VL).
    videos = {**{k: v for k, v in images.items() if k != "image_processor_type"},
              "video_processor_type": "Qwen2VLVideoProcessor", "processor_class": "Qwen2VLProcessor"}
    token = tokenizer.token
    tokenizer_config = {"bos_token": token(tokenizer.bos_id), "eos_token": token(tokenizer.eos_id),
                        "pad_token": token(tokenizer.pad_id), "extra_special_tokens": list(marks),
                        "tokenizer_class": "PreTrainedTokenizerFast", "processor_class": "Qwen2VLProcessor",
                        "model_max_length": int(config.model.get("max_len") or 2048)}
    files = {"config.json": hf_config, "generation_config.json": common.generation_ids(tokenizer),
             "tokenizer_config.json": tokenizer_config,
             "processor_config.json": {"image_processor": images, "processor_class": "Qwen2VLProcessor"},
             "preprocessor_config.json": {**images, "processor_class": "Qwen2VLProcessor"},
             "video_preprocessor_config.json": videos}
    write_folder(out, tensors, files, tokenizer.to_str(), tokenizer.chat_template,
                 image_text="<|vision_start|><|image_pad|><|vision_end|>")
    return {"hf": str(out), "architecture": "Qwen2VLForConditionalGeneration"}


def _torch_layers(prefix: str, layers: dict, t) -> dict:
    """vitmm's Dense (``kernel``, ``bias``) and LayerNorm (``scale``, ``bias``) parameters as
    PyTorch's ``{prefix}.{name}.weight`` / ``.bias``."""
    out = {}
    for name, layer in layers.items():
        out[f"{prefix}.{name}.weight"] = t(layer["kernel"]) if "kernel" in layer else layer["scale"]
        out[f"{prefix}.{name}.bias"] = layer["bias"]
    return out
