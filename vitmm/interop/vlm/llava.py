"""LLaVA, LLaVA-NeXT and LLaVA-OneVision (``LlavaForConditionalGeneration``,
``LlavaNextForConditionalGeneration``, ``LlavaOnevisionForConditionalGeneration``) in and out.

In: a CLIP tower (its ``vision_feature_layer``, the ``default`` strategy) or SigLIP's (the ``full``
strategy; ``vision_feature_layer=-1``, HF's last block before the final norm, is a tower without it:
``final_norm=False``), LLaVA's two-layer GELU projector as the ``mlp`` connector, a language model
``hf_lm`` reads; NeXT's AnyRes (``model.anyres``: candidate resolutions, tile, ``image_newline``,
unpadding; the views made on the host by the ``anyres`` op as its processor makes them, bicubic,
centred on black) and OneVision's ``anyres_max_N`` (``max_patches``: large grids downsampled
bilinearly). The processor's image steps become the run's pp (shortest edge + centre crop, LLaVA's
pad-to-square, or SigLIP's squash to the square). transformers writes a LLaVA's tensors in several
layouts (``vision_tower.vision_model.*`` or ``vision_tower.*``; ``language_model.model.*`` or
``model.language_model.*``; ``lm_head`` or ``language_model.lm_head``): all are read.

Out (``export_llava``): the inverse, for a VLM whose parts fit, with its processor, tokenizer (an
``<image>`` added when it has none) and chat template; every reason it cannot be, before anything
is written.
"""

from __future__ import annotations

import json
import pathlib
import re

import jax
import jax.numpy as jnp

from vitmm import tree
from vitmm.interop import hf_lm, io
from vitmm.interop.common import StateDict, finish, linear
from vitmm.interop.convert import OPENAI_CLIP
from vitmm.interop.hf import clip
from vitmm.interop.vlm.common import (
    conversation_pp,
    grown,
    llava_names,
    pil_resample,
    processor_settings,
    with_image_token,
)

ANYRES_KEYS = ", 'anyres_layout', 'visual_mask'"  # AnyRes views made on the host: where each token comes from



def _feature_layer(config: dict, depth: int, src) -> int:
    """vitmm's ``vision_layer`` for LLaVA's ``vision_feature_layer`` (HF's ``hidden_states[k]``)."""
    layer = config.get("vision_feature_layer", -2)
    if isinstance(layer, list):
        raise ValueError(f"{src}: vision_feature_layer={layer} (several layers concatenated) is not supported; "
                         "vitmm's VLM reads one layer.")
    n = layer if layer < 0 else layer - (depth + 1)  # as hidden_states[-n]
    if n == -1:
        raise ValueError(f"{src}: vision_feature_layer={layer} is the last block without the final norm, which "
                         "vitmm's VLM does not expose; it reads the second-to-last block or earlier.")
    if not -(depth + 1) <= n <= -2:
        raise ValueError(f"{src}: vision_feature_layer={layer} does not exist in a {depth}-block tower.")
    return n



def _image_pp(images: dict, size: int, src) -> str:
    """The pp doing the image processor's steps: LLaVA's pad-to-square (``do_pad``, the mean colour),
    the shorter side resized (bicubic or bilinear, as ``resample`` says), the centre crop; or (SigLIP's
    processor: ``size`` height and width) the image squashed to the tower's square; then rescale and
    normalize (the caller's ``normalize``)."""
    given = images.get("size") or {}
    shortest = given.get("shortest_edge")
    crop = images.get("crop_size") or {}
    methods = {3: "bicubic", 2: "bilinear"}
    pad = "pad_to_square({image_mean})|" if images.get("do_pad") else ""
    if shortest is None and (given.get("height"), given.get("width")) == (size, size) and \
            not images.get("do_center_crop") and images.get("resample", 3) in methods and images.get("do_resize", True):
        return f"decode(alpha='white')|{pad}resize({size}, method='{methods[images.get('resample', 3)]}')|"
    if not images.get("do_resize", True) or shortest is None or images.get("resample", 3) not in methods:
        raise ValueError(f"{src}: image processing {json.dumps({k: images.get(k) for k in ('size', 'resample')})} "
                         "is not supported; vitmm reads a shortest-edge resize, bicubic (3) or bilinear (2).")
    if not images.get("do_center_crop", True) or (crop.get("height"), crop.get("width")) != (size, size):
        raise ValueError(f"{src}: crop {crop} (do_center_crop={images.get('do_center_crop')}) does not give the "
                         f"tower's {size}x{size} input.")
    method = methods[images.get("resample", 3)]
    return f"decode(alpha='white')|{pad}resize({shortest}, method='{method}', shorter=True)|center_crop({size})|"



def _anyres_pp(images: dict, size: int, patch: int, src, max_patches: int | None = None) -> tuple[str, list, str]:
    """LLaVA-NeXT's (and LLaVA-OneVision's) image processor as a pp (``anyres``: the base view
    squashed to a tile, the tiles of the best candidate resolution with the image centred on black;
    bicubic or bilinear, as ``resample`` says; ``max_patches``: OneVision's downsampling) and its
    candidate resolutions and resampling; then rescale and normalize."""
    pinpoints = images.get("image_grid_pinpoints")
    given = images.get("size") or {}
    square = given.get("height") if given.get("height") == given.get("width") else None  # OneVision's size
    shortest = given.get("shortest_edge") or square
    crop = images.get("crop_size") or {}
    methods = {3: "bicubic", 2: "bilinear"}
    if not pinpoints or not images.get("do_resize", True) or images.get("resample", 3) not in methods or \
            shortest != size or (crop.get("height"), crop.get("width")) not in ((size, size), (None, None)):
        raise ValueError(f"{src}: image processing {json.dumps({k: images.get(k) for k in ('size', 'crop_size', 'resample', 'image_grid_pinpoints')})} "  # noqa: E501
                         f"is not supported; vitmm reads LLaVA-NeXT's tiles of the tower's {size}x{size} input "
                         "(shortest_edge and crop_size both that), bicubic (3) or bilinear (2).")
    pinpoints = [[int(h), int(w)] for h, w in pinpoints]
    if any(h % size or w % size for h, w in pinpoints):
        raise ValueError(f"{src}: image_grid_pinpoints {pinpoints} are not whole numbers of {size}px tiles.")
    grid = (size // patch, size // patch)
    method = methods[images.get("resample", 3)]
    more = f", max_patches={max_patches}" if max_patches else ""
    return f"decode(alpha='white')|anyres({pinpoints}, {size}, {grid}, method='{method}'{more})|", pinpoints, method



def load_llava(src) -> tuple[dict, dict, dict]:
    """``(run config, VLM params, processor settings)`` of a ``LlavaForConditionalGeneration`` or
    ``LlavaNextForConditionalGeneration`` folder (the latter's AnyRes: ``model.anyres`` with its
    candidate resolutions and tile, the learned ``image_newline``; its views made on the host by
    the ``anyres`` op)."""
    from vitmm.models.vit import ViT
    from vitmm.models.vlm import VLM

    src = pathlib.Path(src).expanduser()
    config = io.read_json(src)
    tensors = llava_names(io.read_tensors(src))
    archs = config.get("architectures") or []
    onevision = "LlavaOnevisionForConditionalGeneration" in archs
    next_ = onevision or "LlavaNextForConditionalGeneration" in archs
    newline = tensors.pop("image_newline", None) if next_ else None
    if next_ and newline is None:
        raise ValueError(f"{src}: a LLaVA-NeXT checkpoint without image_newline is not supported.")
    vision_type = (config.get("vision_config") or {}).get("model_type", "clip_vision_model")
    if vision_type not in ("clip_vision_model", "siglip_vision_model"):
        raise ValueError(f"{src}: a {vision_type!r} vision tower is not supported in {archs[0]}; vitmm reads CLIP's "
                         "and SigLIP's.")
    siglip = vision_type == "siglip_vision_model"
    strategy = config.get("vision_feature_select_strategy", "full" if onevision else "default")
    if strategy != ("full" if siglip else "default"):  # the patches, every one: CLIP's without its CLS
        raise ValueError(f"{src}: vision_feature_select_strategy={strategy!r} on a {vision_type} is not supported; "
                         f"vitmm reads {'full' if siglip else 'default'!r} (every patch, no CLS).")
    if not config.get("multimodal_projector_bias", True):
        raise ValueError(f"{src}: a projector without biases is not supported; vitmm's mlp connector has them.")
    act = config.get("projector_hidden_act", "gelu")
    if act != "gelu":
        raise ValueError(f"{src}: projector_hidden_act={act!r} is not supported; LLaVA's is 'gelu'.")
    text_config = config.get("text_config") or {"model_type": "llama"}

    size = int((config.get("vision_config") or {}).get("image_size") or clip.VISION_DEFAULTS["image_size"])
    vision_sd = StateDict({k: v for k, v in tensors.items() if k.startswith("vision.")}, f"{src} (vision tower)")
    vision, tower, vision_layer = _tower(config, vision_sd, tensors, siglip, src)
    tower = finish(vision_sd, ViT(**vision), tower, (jnp.zeros((1, size, size, 3)),),
                   f"a vitmm ViT ({'SigLIP' if siglip else 'CLIP'} tower)")
    lm_tensors = {k: v for k, v in tensors.items() if k.startswith(("model.", "lm_head."))}
    lm, language = hf_lm.lm_from_tensors(text_config, lm_tensors, f"{src} (language model)")
    proj_sd = StateDict({k: v for k, v in tensors.items() if k.startswith("projector.")}, f"{src} (projector)")
    project = {"mlp": {"fc1": linear(proj_sd, "projector.linear_1"), "fc2": linear(proj_sd, "projector.linear_2")}}
    images, processor = processor_settings(src)
    anyres = None
    if next_:
        max_patches = _max_patches(config, src) if onevision else None
        image_pp, pinpoints, method = _anyres_pp(images, size, vision["patch_size"], src, max_patches)
        anyres = {"pinpoints": pinpoints, "tile": size, "method": method,  # method: flat sequences' views
                  **({"max_patches": max_patches} if max_patches else {})}
    else:
        image_pp = _image_pp(images, size, src)
    left = sorted(set(tensors) - set(vision_sd.tensors) - set(lm_tensors) - set(proj_sd.tensors))
    problems = [f"  missing: {k}" for k in proj_sd.missing] + [f"  unused: {k}" for k in proj_sd.unused() + left]
    model = dict(vision=vision, connector={"name": "mlp", "budget": "all"}, lm=lm,
                 vision_layer=vision_layer, use_cls=False, prefix_lm=False,
                 mrope=False, anyres=anyres, max_len=2048, loss_positions=None)
    params = {"tower": tower, "project": jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), project),
              "language": language}
    if next_:
        params["image_newline"] = jnp.asarray(newline, jnp.float32)
    if not problems:
        vlm = VLM(vision, model["connector"], lm, model["vision_layer"], anyres=anyres)
        expected = jax.eval_shape(vlm.init, jax.random.key(0), jnp.zeros((1, size, size, 3)),
                                  jnp.zeros((1, 4), jnp.int32))["params"]
        problems = tree.mismatches(expected, params)
    if problems:
        raise ValueError(f"Cannot load {src} as a vitmm VLM ({archs[0]}):\n" + "\n".join(problems))
    keep = (ANYRES_KEYS + (", 'anyres_weights'" if onevision else "")) if next_ else ""
    pp = image_pp + "normalize({image_mean}, {image_std})|" + conversation_pp(keep=keep)
    mean, std = OPENAI_CLIP
    run = {"task": "vlm", "seed": 0, "model": model, "init": {"vision": None, "lm": None, "checkpoint": None},
           "lora": {"rank": 0, "alpha": 0.0, "dropout": 0.0, "targets": []},
           "input": {"pp": pp, "image_size": size, "image_mean": list(images.get("image_mean", mean)),
                     "image_std": list(images.get("image_std", std))}}
    return run, params, {"image_token": processor.get("image_token", "<image>"), "text_config": text_config}



def _tower(config: dict, vision_sd: StateDict, tensors: dict, siglip: bool, src) -> tuple[dict, dict, int]:
    """``(ViT kwargs, params, vision_layer)`` of a LLaVA-family tower: CLIP's, or (LLaVA-OneVision)
    SigLIP's; ``vision_feature_layer=-1``, HF's last block before the final norm, is a tower
    without it (``final_norm=False``, its tensors read and left out)."""
    if not siglip:
        vision = clip.vision_kwargs(config, tensors, "vision.")
        return vision, clip.vision_params(vision_sd, vision, "vision."), _feature_layer(config, vision["depth"], src)
    vision, params = clip._siglip_vision(vision_sd, config, tensors, "vision.")
    if config.get("vision_feature_layer", -1) in (-1, vision["depth"]):  # hidden_states[depth] is [-1]
        params["encoder"].pop("encoder_norm")
        return {**vision, "final_norm": False}, params, -1
    return vision, params, _feature_layer(config, vision["depth"], src)



def _max_patches(config: dict, src) -> int:
    """LLaVA-OneVision's ``vision_aspect_ratio`` ``anyres_max_N``: N."""
    ratio = str(config.get("vision_aspect_ratio", "anyres_max_9"))
    match = re.fullmatch(r"anyres_max_(\d+)", ratio)
    if not match:
        raise ValueError(f"{src}: vision_aspect_ratio={ratio!r} is not supported; vitmm reads 'anyres_max_N'.")
    return int(match.group(1))



def _export_problems(model: dict, vision: dict, tower: dict) -> list[str]:
    """Why ``LlavaForConditionalGeneration`` (``LlavaNextForConditionalGeneration`` with
    ``model.anyres``; ``LlavaOnevisionForConditionalGeneration`` with a SigLIP tower and AnyRes's
    ``max_patches``) cannot hold this VLM (empty: it can)."""
    from vitmm.interop.hf.clip_export import tower_problems

    anyres = model.get("anyres")
    if not vision.get("class_token", True):  # a SigLIP tower: every patch (the "full" strategy)
        problems = tower_problems(vision, tower, siglip=True, reads_final_norm=False)
        if model.get("vision_layer", -1) == -1 and vision.get("final_norm", True):
            problems.append("vision_layer=-1 of a tower with its final norm (transformers reads its last block "
                            "before it, hidden_states[-1]: final_norm=False)")
    elif anyres and anyres.get("max_patches"):
        problems = ["a CLIP tower with max_patches (LLaVA-OneVision's tower is SigLIP's)"]
    else:
        problems = tower_problems(vision, tower, siglip=False, reads_final_norm=False)
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
                             "flat sequences makes them in data.sequences: not exportable)")
        resample = pil_resample(steps[0][2].get("method"))
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
                    "resample": pil_resample(kwargs.get("method")), "do_center_crop": True}
    if names in (["pad_to_square", "resize"], ["resize"]) and steps[-1][1][0] == size and not steps[-1][2].get(
            "shorter"):  # (padded to a square, then) squashed to the tower's square: no crop
        return {**common, "image_processor_type": "LlavaImageProcessor", "do_pad": names[0] == "pad_to_square",
                "resample": pil_resample(steps[-1][2].get("method")), "do_center_crop": False,
                "size": {"height": size, "width": size}}
    raise ValueError(f"the run's image steps {'|'.join(names)} have no transformers image processor; LLaVA's "
                     "processors do resize(shorter)|center_crop, or pad_to_square|resize to the tower's size")



def export_llava(workdir, out) -> dict:
    """The VLM in ``workdir`` as a transformers ``LlavaForConditionalGeneration`` folder in ``out``
    (``LlavaNextForConditionalGeneration`` for one with ``model.anyres``; weights in the layout every
    transformers version reads, config, processor, tokenizer, chat template), for
    ``AutoModelForImageTextToText`` / ``AutoProcessor``; ValueError with every reason it cannot be,
    before anything is written."""
    import numpy as np

    from vitmm.data import tokenizer as tok_lib
    from vitmm.interop.hf import export_clip_vision
    from vitmm.interop.vlm.common import export_folder, export_start, generation_ids, write_folder
    from vitmm.train import pp_template

    config, vision, lm, params, tokenizer, _ = export_start(workdir)
    model = {**config.model.to_dict(), "vision": vision, "lm": lm}
    anyres = model.get("anyres")
    onevision = bool(anyres and anyres.get("max_patches"))
    architecture, processor_class = ("LlavaOnevisionForConditionalGeneration", "LlavaOnevisionProcessor") \
        if onevision else ("LlavaNextForConditionalGeneration", "LlavaNextProcessor") if anyres else \
        ("LlavaForConditionalGeneration", "LlavaProcessor")
    problems = _export_problems(model, vision, params["tower"])
    if not isinstance(tokenizer, tok_lib.HFTokenizer):
        problems.append("a byte tokenizer (transformers needs a tokenizer.json: train on a converted LM)")
    out = export_folder(workdir, architecture, problems, out)
    size = int(config.input.image_size)
    mean, std = pp_template.image_normalization(config)
    images = _image_processor(pp_template.pp_string(config), size, mean, std, anyres)

    siglip = not vision.get("class_token", True)
    if siglip:  # a tower read before its final norm gets an identity one, which LLaVA never applies
        from vitmm.interop.hf.clip_export import export_siglip_vision

        tower, vision_config = export_siglip_vision(vision, params["tower"], prefix="vision_tower.vision_model.")
    else:
        tower, vision_config = export_clip_vision(vision, params["tower"], prefix="vision_tower.vision_model.")
    language, text_config = hf_lm.export_lm(lm, params["language"])
    tokenizer_json, image_id, added = with_image_token(tokenizer)
    if image_id >= lm["vocab_size"]:  # a new row for it: never an input (its places take the image), never chosen
        language, text_config = grown(language, text_config, image_id + 1)
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
    files = {"config.json": hf_config, "processor_config.json": processor,
             "preprocessor_config.json": {**images, "processor_class": processor_class},
             "tokenizer_config.json": tokenizer_config,
             "generation_config.json": {**generation_ids(tokenizer),
                                        **({"suppress_tokens": [image_id]} if added else {})}}
    write_folder(out, tensors, files, tokenizer_json, tokenizer.chat_template)
    return {"hf": str(out), "architecture": architecture, "image_tokens": patches,
            **({"added": f"<image> as token {image_id}"} if added else {})}

