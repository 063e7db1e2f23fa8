"""A vitmm VLM as one transformers folder: ``python -m vitmm.export --format hf``.

    from vitmm import export_hf
    export_hf.export_hf("workdirs/llava15_ft", "exported/llava15_ft")

``export_hf`` writes a VLM with prefix attention as ``PaliGemmaForConditionalGeneration``, one with
M-RoPE as ``Qwen2VLForConditionalGeneration`` (``interop.hf_qwen2_vl``), one with AnyRes views made
by the ``anyres`` op as ``LlavaNextForConditionalGeneration`` and any other as
``LlavaForConditionalGeneration``, each with its processor (the run's image steps), tokenizer
and chat template, for ``AutoModelForImageTextToText`` and ``AutoProcessor``; a VLM whose parts do not
fit is refused with every reason before anything is written. The inverse of ``hf_vlm``'s importers
(an export imports back to the same parameters; tested, also through transformers).
"""

from __future__ import annotations

import json
import pathlib

from vitmm.interop import hf_lm, io


def _export_problems(model: dict, vision: dict, tower: dict) -> list[str]:
    """Why ``LlavaForConditionalGeneration`` (``LlavaNextForConditionalGeneration`` with
    ``model.anyres``; ``LlavaOnevisionForConditionalGeneration`` with a SigLIP tower and AnyRes's
    ``max_patches``) cannot hold this VLM (empty: it can)."""
    from vitmm.export import clip_vision_problem

    anyres = model.get("anyres")
    if not vision.get("class_token", True):  # a SigLIP tower: every patch (the "full" strategy)
        siglip = vision.get("posemb", "learn") == "learn" and not vision.get("pre_norm") and "map_head" not in tower
        problems = [] if siglip else ["the tower (SigLIP's layout: no class token, learned positions, no pre-norm)"]
        if model.get("vision_layer", -1) == -1 and vision.get("final_norm", True):
            problems.append("vision_layer=-1 of a tower with its final norm (transformers reads its last block "
                            "before it, hidden_states[-1]: final_norm=False)")
    elif anyres and anyres.get("max_patches"):
        problems = ["a CLIP tower with max_patches (LLaVA-OneVision's tower is SigLIP's)"]
    else:
        problems = [f"the tower: {p}"] if (p := clip_vision_problem(vision, tower)) else []
        if not model.get("vision_layer", -1) <= -2:
            problems.append(f"vision_layer={model.get('vision_layer')} (LLaVA reads hidden_states[-2] or earlier; -1 "
                            "is vitmm's normed output)")
    connector = dict(model["connector"])
    if connector.get("name") != "mlp" or connector.get("depth", 2) != 2 or connector.get("act", "gelu") != "gelu" \
            or connector.get("hidden") not in (None, model["lm"]["width"]) or connector.get("budget") != "all":
        problems.append(f"connector {connector} (LLaVA's projector is mlp, depth 2, GELU, the LM's width, every patch)")
    for key in ("use_cls", "prefix_lm", "mrope"):
        if model.get(key):
            problems.append(f"model.{key}={model[key]!r}")
    made_for = tower["pos_embedding"].shape[1] * vision["patch_size"] if "pos_embedding" in tower else None
    if anyres and int(anyres["tile"]) != made_for:
        problems.append(f"AnyRes tiles of {anyres['tile']}px on a tower whose positions are for {made_for}px "
                        "(LLaVA-NeXT's tile is its tower's input)")
    return problems


def _image_processor(pp: str, size: int, mean, std, anyres: dict | None = None) -> dict:
    """transformers' image-processor settings doing what the run's pp does to an image, or
    ValueError naming the step they cannot do."""
    from vitmm.data import preprocess

    steps = [(name, args, kwargs) for name, args, kwargs in preprocess.ops(pp)
             if name in preprocess.IMAGE_OPS_NAMES and name not in ("decode", "normalize")]
    common = {"do_convert_rgb": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
              "image_mean": list(mean), "image_std": list(std), "do_resize": True,
              "crop_size": {"height": size, "width": size}, "size": {"shortest_edge": size}}
    names = [name for name, _, _ in steps]
    if anyres:  # LLaVA-NeXT's processor: what the `anyres` op does, at the model's tiles and candidates
        if names != ["anyres"] or [list(p) for p in steps[0][1][0]] != [list(p) for p in anyres["pinpoints"]] or \
                steps[0][1][1] != anyres["tile"]:
            raise ValueError(f"the run's image steps {'|'.join(names) or '(none)'} are not LLaVA-NeXT's processor: "
                             "it makes the AnyRes views on the host, as one anyres(pinpoints, tile, …) op (a run on "
                             "flat sequences makes them after normalize: not exportable)")
        resample = 3 if steps[0][2].get("method") == "bicubic" else 2
        if anyres.get("max_patches"):  # LLaVA-OneVision's: every view squashed to the tile's square
            return {**common, "image_processor_type": "LlavaOnevisionImageProcessor", "do_pad": True,
                    "image_grid_pinpoints": [list(p) for p in anyres["pinpoints"]], "resample": resample,
                    "size": {"height": size, "width": size}, "crop_size": None, "do_center_crop": False}
        return {**common, "image_processor_type": "LlavaNextImageProcessor", "do_pad": True,
                "image_grid_pinpoints": [list(p) for p in anyres["pinpoints"]], "do_center_crop": True,
                "resample": resample}
    if names in (["resize", "center_crop"], ["pad_to_square", "resize", "center_crop"]):
        (_, args, kwargs), (_, crop, _) = steps[-2:]
        if kwargs.get("shorter") and crop[0] == size:
            padded = len(names) == 3
            return {**common, "image_processor_type": "LlavaImageProcessor" if padded else "CLIPImageProcessor",
                    "size": {"shortest_edge": args[0]}, "do_pad": padded,
                    "resample": 3 if kwargs.get("method") == "bicubic" else 2, "do_center_crop": True}
    if names in (["pad_to_square", "resize"], ["resize"]) and steps[-1][1][0] == size and not steps[-1][2].get(
            "shorter"):  # (padded to a square, then) squashed to the tower's square: no crop
        return {**common, "image_processor_type": "LlavaImageProcessor", "do_pad": names[0] == "pad_to_square",
                "resample": 3 if steps[-1][2].get("method") == "bicubic" else 2, "do_center_crop": False,
                "size": {"height": size, "width": size}}
    raise ValueError(f"the run's image steps {'|'.join(names)} have no transformers image processor; LLaVA's "
                     "processors do resize(shorter)|center_crop, or pad_to_square|resize to the tower's size")


def export_llava(workdir, out) -> dict:
    """The VLM in ``workdir`` as a transformers ``LlavaForConditionalGeneration`` folder in ``out``
    (``LlavaNextForConditionalGeneration`` for one with ``model.anyres``; weights in the layout every
    transformers version reads, config, processor, tokenizer, chat template), for
    ``AutoModelForImageTextToText`` / ``AutoProcessor``; ValueError with every reason it cannot be,
    before anything is written."""
    import ml_collections
    import numpy as np

    from vitmm import checkpoint as ckpt_lib
    from vitmm.data import tokenizer as tok_lib
    from vitmm.interop.hf import export_clip_vision
    from vitmm.models import lora as lora_lib
    from vitmm.train import tasks

    config = ml_collections.ConfigDict(ckpt_lib.load_config(workdir))
    if config.get("task") != "vlm":
        raise ValueError(f"{workdir} holds a {config.get('task', 'contrastive')!r} run, not a VLM.")
    vision, lm = tasks.vlm_parts(config)
    params = ckpt_lib.load_params(workdir)
    if "lora" in params:
        params = lora_lib.merge({k: v for k, v in params.items() if k != "lora"}, params["lora"], config.lora.alpha)
    model = {**config.model.to_dict(), "vision": vision, "lm": lm}
    anyres = model.get("anyres")
    onevision = bool(anyres and anyres.get("max_patches"))
    architecture, processor_class = ("LlavaOnevisionForConditionalGeneration", "LlavaOnevisionProcessor") \
        if onevision else ("LlavaNextForConditionalGeneration", "LlavaNextProcessor") if anyres else \
        ("LlavaForConditionalGeneration", "LlavaProcessor")
    problems = _export_problems(model, vision, params["tower"])
    tokenizer = tasks.tokenizer_for(config)
    if not isinstance(tokenizer, tok_lib.HFTokenizer):
        problems.append("a byte tokenizer (transformers needs a tokenizer.json: train on a converted LM)")
    if problems:
        raise ValueError(f"{workdir} cannot be a {architecture}: " + "; ".join(problems) + ".")
    size = int(config.input.image_size)
    mean, std = tasks.image_normalization(config)
    images = _image_processor(tasks.pp_string(config), size, mean, std, anyres)
    out = pathlib.Path(out).expanduser()
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty; choose a new --out.")

    siglip = not vision.get("class_token", True)
    if siglip:  # a tower read before its final norm gets an identity one, which transformers skips there too
        from vitmm.interop.hf.clip import export_siglip_vision

        width = vision["width"]
        with_norm = {**params["tower"], "encoder": {"encoder_norm": {"scale": np.ones(width), "bias": np.zeros(width)},
                                                   **params["tower"]["encoder"]}}
        tower, vision_config = export_siglip_vision(vision, with_norm, prefix="vision_tower.vision_model.")
    else:
        tower, vision_config = export_clip_vision(vision, params["tower"], prefix="vision_tower.vision_model.")
    language, text_config = hf_lm.export_lm(lm, params["language"])
    tokenizer_json, image_id, added = _with_image_token(tokenizer)
    if image_id >= lm["vocab_size"]:  # a new row for it: never an input (its places take the image), never chosen
        language, text_config = _grown(language, text_config, image_id + 1)
    tensors = {**tower, **{("language_model." + k): v for k, v in language.items()}}
    if "language_model.lm_head.weight" not in tensors:  # a tied head: written out, what every version reads
        tensors["language_model.lm_head.weight"] = language["model.embed_tokens.weight"]
    for i in (1, 2):
        fc = params["project"]["mlp"][f"fc{i}"]
        tensors[f"multi_modal_projector.linear_{i}.weight"] = np.ascontiguousarray(np.asarray(fc["kernel"]).T)
        tensors[f"multi_modal_projector.linear_{i}.bias"] = np.asarray(fc["bias"], np.float32)
    ids = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.pad_id}
    patches = (size // vision["patch_size"]) ** 2
    if anyres:
        tensors["image_newline"] = np.asarray(params["image_newline"], np.float32)
    hf_config = {"architectures": [architecture],
                 "model_type": "llava_onevision" if onevision else "llava_next" if anyres else "llava",
                 "image_token_index": image_id, "image_seq_length": patches, "projector_hidden_act": "gelu",
                 "vision_feature_layer": int(model["vision_layer"]), "vision_feature_select_strategy": "default",
                 "multimodal_projector_bias": True, "tie_word_embeddings": bool(lm.get("tie_embeddings")),
                 "text_config": {**text_config, **ids}, "vision_config": vision_config, "torch_dtype": "float32"}
    if anyres:
        hf_config["image_grid_pinpoints"] = [list(p) for p in anyres["pinpoints"]]
    if siglip:  # every patch of the SigLIP tower
        hf_config["vision_feature_select_strategy"] = "full"
    if onevision:  # a video token id no text holds (vitmm exports no video)
        hf_config.update(vision_aspect_ratio=f"anyres_max_{anyres['max_patches']}",
                         video_token_index=hf_config["text_config"]["vocab_size"])
    processor = {"image_processor": images, "image_token": "<image>", "num_additional_image_tokens": int(not siglip),
                 "patch_size": vision["patch_size"], "processor_class": processor_class,
                 "vision_feature_select_strategy": "full" if siglip else "default"}
    if onevision:
        processor = {"image_processor": images, "image_token": "<image>", "video_token": "<video>",
                     "num_image_tokens": patches, "vision_feature_select_strategy": "full",
                     "vision_aspect_ratio": hf_config["vision_aspect_ratio"], "processor_class": processor_class}
    token = tokenizer.token
    tokenizer_config = {"bos_token": token(tokenizer.bos_id), "eos_token": token(tokenizer.eos_id),
                        "pad_token": token(tokenizer.pad_id), "extra_special_tokens": ["<image>"],
                        "tokenizer_class": "PreTrainedTokenizerFast", "processor_class": processor_class,
                        "model_max_length": int(config.model.get("max_len") or 2048)}
    out.mkdir(parents=True, exist_ok=True)
    io.write_safetensors(tensors, out / "model.safetensors")
    files = {"config.json": hf_config, "processor_config.json": processor,
             "preprocessor_config.json": {**images, "processor_class": processor_class},
             "tokenizer_config.json": tokenizer_config,
             "generation_config.json": {**ids, **({"suppress_tokens": [image_id]} if added else {})}}
    for name, value in files.items():
        (out / name).write_text(json.dumps(value, indent=1) + "\n")
    (out / "tokenizer.json").write_text(tokenizer_json)
    if tokenizer.chat_template:
        (out / "chat_template.jinja").write_text(tokenizer.chat_template)
    return {"hf": str(out), "architecture": architecture, "image_tokens": patches,
            **({"added": f"<image> as token {image_id}"} if added else {})}


def _with_image_token(tokenizer) -> tuple[str, int, bool]:
    """``(tokenizer.json text, <image>'s id, whether it was added)``: a tokenizer without the
    ``<image>`` LLaVA's processor expands gets it as a special token after its vocabulary (a run
    on a converted LM trains with the visual tokens spliced in, no such token needed)."""
    from tokenizers import AddedToken, Tokenizer

    image_id = tokenizer.token_id("<image>")
    if image_id is not None:
        return tokenizer.to_str(), image_id, False
    grown = Tokenizer.from_str(tokenizer.to_str())
    grown.add_special_tokens([AddedToken("<image>", special=True, normalized=False)])
    return grown.to_str(), grown.token_to_id("<image>"), True


def _grown(language: dict, text_config: dict, vocab: int) -> tuple[dict, dict]:
    """The LM's tensors and config with zero rows up to ``vocab`` in its embedding (and untied head)."""
    import numpy as np

    out = dict(language)
    for key in ("model.embed_tokens.weight", "lm_head.weight"):
        if key in out:
            w = out[key]
            out[key] = np.concatenate([w, np.zeros((vocab - w.shape[0], w.shape[1]), w.dtype)])
    return out, {**text_config, "vocab_size": vocab}


def _paligemma_problems(model: dict, vision: dict, tower: dict, lm: dict) -> list[str]:
    """Why ``PaliGemmaForConditionalGeneration`` cannot hold this VLM (empty: it can)."""
    problems = []
    if vision.get("class_token") or vision.get("posemb", "learn") != "learn" or "map_head" in tower \
            or vision.get("pre_norm"):
        problems.append("the tower (PaliGemma's is SigLIP's: no class token, learned positions, no pre-norm)")
    connector = dict(model["connector"])
    if connector.get("name") != "linear" or connector.get("budget") != "all":
        problems.append(f"connector {connector} (PaliGemma's projector is linear, every patch)")
    if model.get("vision_layer", -1) != -1:
        problems.append(f"vision_layer={model.get('vision_layer')} (PaliGemma reads the tower's normed output, -1)")
    if not (lm.get("norm_offset") and lm.get("embed_scale")) or lm.get("post_norms"):
        problems.append("the LM (PaliGemma's is a Gemma)")
    for key in ("use_cls", "mrope", "anyres"):
        if model.get(key):
            problems.append(f"model.{key}={model[key]!r}")
    return problems


def export_hf(workdir, out) -> dict:
    """``python -m vitmm.export --format hf``: a VLM with prefix attention (``prefix_lm``) as
    ``PaliGemmaForConditionalGeneration``, with M-RoPE as ``Qwen2VLForConditionalGeneration``, any
    other as ``LlavaForConditionalGeneration`` (``LlavaNext…`` with AnyRes)."""
    from vitmm import checkpoint as ckpt_lib

    config = ckpt_lib.load_config(workdir)
    if (config.get("model") or {}).get("prefix_lm"):
        return export_paligemma(workdir, out)
    if (config.get("model") or {}).get("mrope"):
        from vitmm.interop.hf_qwen2_vl import export_qwen2_vl

        return export_qwen2_vl(workdir, out)
    if ((config.get("model") or {}).get("connector") or {}).get("name") == "pixel_shuffle":
        from vitmm.interop.hf_idefics3 import export_idefics3

        return export_idefics3(workdir, out)
    return export_llava(workdir, out)


def export_paligemma(workdir, out) -> dict:
    """The VLM in ``workdir`` as a transformers ``PaliGemmaForConditionalGeneration`` folder (weights
    in the layout every transformers version reads, config, processor, tokenizer) or ValueError with
    every reason it cannot be, before anything is written."""
    import ml_collections
    import numpy as np

    from vitmm import checkpoint as ckpt_lib
    from vitmm.data import preprocess
    from vitmm.data import tokenizer as tok_lib
    from vitmm.interop.hf.clip import export_siglip_vision
    from vitmm.models import lora as lora_lib
    from vitmm.train import tasks

    config = ml_collections.ConfigDict(ckpt_lib.load_config(workdir))
    vision, lm = tasks.vlm_parts(config)
    params = ckpt_lib.load_params(workdir)
    if "lora" in params:
        params = lora_lib.merge({k: v for k, v in params.items() if k != "lora"}, params["lora"], config.lora.alpha)
    model = {**config.model.to_dict(), "vision": vision, "lm": lm}
    problems = _paligemma_problems(model, vision, params["tower"], lm)
    tokenizer = tasks.tokenizer_for(config)
    image_id = tokenizer.token_id("<image>") if isinstance(tokenizer, tok_lib.HFTokenizer) else None
    if image_id is None:
        problems.append("a tokenizer without an <image> token")
    size = int(config.input.image_size)
    steps = [(n, a, k) for n, a, k in preprocess.ops(tasks.pp_string(config))
             if n in preprocess.IMAGE_OPS_NAMES and n not in ("decode", "normalize")]
    if [n for n, _, _ in steps] != ["resize"] or steps[0][2].get("shorter") or steps[0][1][0] != size:
        problems.append(f"the image steps {[n for n, _, _ in steps]} (PaliGemma's processor resizes to the tower's "
                        "size)")
    if problems:
        raise ValueError(f"{workdir} cannot be a PaliGemmaForConditionalGeneration: " + "; ".join(problems) + ".")
    out = pathlib.Path(out).expanduser()
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty; choose a new --out.")
    tower, vision_config = export_siglip_vision(vision, params["tower"], prefix="vision_tower.vision_model.")
    language, text_config = hf_lm.export_lm(lm, params["language"], family="gemma")
    tensors = {**tower, **{("language_model." + k): v for k, v in language.items()}}
    proj = params["project"]["proj"]
    tensors["multi_modal_projector.linear.weight"] = np.ascontiguousarray(np.asarray(proj["kernel"]).T)
    tensors["multi_modal_projector.linear.bias"] = np.asarray(proj["bias"], np.float32)
    mean, std = tasks.image_normalization(config)
    patches = (size // vision["patch_size"]) ** 2
    ids = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.pad_id}
    hf_config = {"architectures": ["PaliGemmaForConditionalGeneration"], "model_type": "paligemma",
                 "image_token_index": image_id, "projection_dim": lm["width"], "hidden_size": lm["width"],
                 "vocab_size": lm["vocab_size"], "tie_word_embeddings": bool(lm.get("tie_embeddings")),
                 "text_config": {**text_config, **ids, "use_bidirectional_attention": True,
                                 "num_image_tokens": patches},
                 "vision_config": {**vision_config, "projection_dim": lm["width"]}, "torch_dtype": "float32"}
    method = steps[0][2].get("method", "bilinear")
    images = {"image_processor_type": "SiglipImageProcessor", "do_convert_rgb": True, "do_resize": True,
              "size": {"height": size, "width": size}, "resample": 3 if method == "bicubic" else 2,
              "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": list(mean),
              "image_std": list(std), "image_seq_length": patches}
    token = tokenizer.token
    tokenizer_config = {"bos_token": token(tokenizer.bos_id), "eos_token": token(tokenizer.eos_id),
                        "pad_token": token(tokenizer.pad_id), "extra_special_tokens": ["<image>"],
                        "tokenizer_class": "PreTrainedTokenizerFast", "processor_class": "PaliGemmaProcessor",
                        "add_bos_token": False, "add_eos_token": False}
    out.mkdir(parents=True, exist_ok=True)
    io.write_safetensors(tensors, out / "model.safetensors")
    files = {"config.json": hf_config, "processor_config.json": {"image_processor": images,
                                                                 "processor_class": "PaliGemmaProcessor"},
             "preprocessor_config.json": {**images, "processor_class": "PaliGemmaProcessor"},
             "tokenizer_config.json": tokenizer_config, "generation_config.json": ids}
    for name, value in files.items():
        (out / name).write_text(json.dumps(value, indent=1) + "\n")
    (out / "tokenizer.json").write_text(tokenizer.to_str())
    return {"hf": str(out), "architecture": "PaliGemmaForConditionalGeneration", "image_tokens": patches}
