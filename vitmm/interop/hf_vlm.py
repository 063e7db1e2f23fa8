"""Whole transformers VLMs → a vitmm VLM workdir that ``vitmm.chat``, ``vitmm.serve`` and
``vitmm.train`` (``init.checkpoint``) use as it is.

    python -m vitmm.interop --from hf --src ~/models/llava-1.5-7b-hf --out workdirs/llava15

A folder is recognised by ``config.json``'s ``architectures``. Supported: ``LlavaForConditionalGeneration``
(a CLIP vision tower, its ``vision_feature_layer``, the ``default`` feature strategy, LLaVA's
two-layer GELU projector as the ``mlp`` connector, and a language model ``hf_lm`` reads),
``LlavaNextForConditionalGeneration`` (the same with AnyRes: ``model.anyres`` with its candidate
resolutions and tile, the learned ``image_newline``, the unpadded grid; the views made on the host by
the ``anyres`` op as its processor makes them, bicubic, the image centred on black) and
``PaliGemmaForConditionalGeneration`` (SigLIP's normed output, the ``linear`` connector, Gemma, the
image first and attention both ways over it and the prompt: ``prefix_lm``; its prompt format, which
the processor builds and transformers has no chat template for, as ``PALIGEMMA_TEMPLATE``).
What the workdir holds (``out``):

* ``checkpoints/0``: the VLM's parameters (``tower``, ``project``, ``language``) and its config:
  ``task="vlm"``, ``model.vision`` / ``model.connector`` / ``model.lm`` / ``model.vision_layer``,
  ``input.pp`` (the processor's image steps: the shorter side resized with bicubic resampling,
  the centre crop, the mean and std; then the chat template's conversation), ``input.image_size``;
  ``tokenizer`` (``out/tokenizer.json``), ``chat_template`` and the special ``tokens``;
* ``tokenizer.json``, the checkpoint's own.

The tokenizer path is absolute: move the workdir and import it again. transformers writes a LLaVA
checkpoint's tensors in several layouts (``vision_tower.vision_model.*`` or ``vision_tower.*``;
``language_model.model.*`` or ``model.language_model.*``; ``lm_head`` or ``language_model.lm_head``):
all are read. What a model needs that vitmm does not have is refused in one line naming it.
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

ARCHITECTURES = ("LlavaForConditionalGeneration", "LlavaNextForConditionalGeneration",
                 "LlavaOnevisionForConditionalGeneration",
                 "PaliGemmaForConditionalGeneration", "Qwen2VLForConditionalGeneration",
                 "Idefics3ForConditionalGeneration")
# PaliGemma's prompt as its processor builds it: the image first, then BOS, the prompt and a newline;
# the answer and EOS after (its training suffix). One user turn; the <image> tag may lead it.
PALIGEMMA_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}<image>{{ bos_token }}"
                      "{{ m['content'] | replace('<image>', '') }}{{ '\\n' }}{% elif m['role'] == 'assistant' %}"
                      "{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")
ANYRES_KEYS = ", 'anyres_layout', 'visual_mask'"  # AnyRes views made on the host: where each token comes from


def conversation_pp(args: str = "", keep: str = "") -> str:
    """The pp's text steps: the conversation through the chat template (``conversation_tokens``,
    with ``args`` more), then the keys a VLM batch holds (and ``keep`` more)."""
    return (f"conversation_tokens({{max_len}}, overflow='truncate_turns', max_answer={{loss_positions}}{args})|"
            f"keep('image', 'ids', 'answer_mask', 'prompt_len', 'image_pos', 'has_image'{keep})")


def architecture(src) -> str | None:
    """The VLM architecture ``src``'s ``config.json`` names, if vitmm imports it (else None)."""
    try:
        names = io.read_json(src).get("architectures") or []
    except FileNotFoundError:
        return None
    return next((n for n in names if n in ARCHITECTURES), None)


def is_vlm(src) -> bool:
    """Whether ``src`` is a whole transformers VLM (an architecture ``...ForConditionalGeneration``;
    CLIP and SigLIP hold a vision and a text config too, but are two towers), supported or not."""
    try:
        config = io.read_json(src)
    except FileNotFoundError:
        return False
    return any(n.endswith("ForConditionalGeneration") for n in config.get("architectures") or [])


def _llava_names(tensors: dict) -> dict:
    """LLaVA's tensors under one set of names: ``vision.*`` (CLIP's ``vision_model.*`` without that
    prefix), ``projector.*``, ``model.*`` and ``lm_head.*`` (the language model's own)."""
    out = {}
    for key, value in tensors.items():
        name = key.removeprefix("model.") if key.startswith(("model.vision_tower", "model.multi_modal_projector",
                                                             "model.language_model", "model.image_newline")) else key
        for old, new in (("vision_tower.vision_model.", "vision."), ("vision_tower.", "vision."),
                         ("multi_modal_projector.", "projector."), ("language_model.model.", "model."),
                         ("language_model.lm_head.", "lm_head."), ("language_model.", "model.")):
            if name.startswith(old):
                name = new + name[len(old):]
                break
        out[name] = value
    return out


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


def _processor(folder: pathlib.Path) -> tuple[dict, dict]:
    """``(image processor settings, processor settings)`` from ``processor_config.json``
    (transformers 5) or ``preprocessor_config.json`` (older folders)."""
    for name in ("processor_config.json", "preprocessor_config.json"):
        if (folder / name).is_file():
            data = json.loads((folder / name).read_text())
            return data.get("image_processor", data), data
    raise FileNotFoundError(f"{folder} has no processor_config.json or preprocessor_config.json (the image "
                            "settings); save the processor beside the model.")


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
        return f"decode|{pad}resize({size}, method='{methods[images.get('resample', 3)]}')|"
    if not images.get("do_resize", True) or shortest is None or images.get("resample", 3) not in methods:
        raise ValueError(f"{src}: image processing {json.dumps({k: images.get(k) for k in ('size', 'resample')})} "
                         "is not supported; vitmm reads a shortest-edge resize, bicubic (3) or bilinear (2).")
    if not images.get("do_center_crop", True) or (crop.get("height"), crop.get("width")) != (size, size):
        raise ValueError(f"{src}: crop {crop} (do_center_crop={images.get('do_center_crop')}) does not give the "
                         f"tower's {size}x{size} input.")
    method = methods[images.get("resample", 3)]
    return f"decode|{pad}resize({shortest}, method='{method}', shorter=True)|center_crop({size})|"


def _anyres_pp(images: dict, size: int, patch: int, src, max_patches: int | None = None) -> tuple[str, list]:
    """LLaVA-NeXT's (and LLaVA-OneVision's) image processor as a pp (``anyres``: the base view
    squashed to a tile, the tiles of the best candidate resolution with the image centred on black;
    bicubic or bilinear, as ``resample`` says; ``max_patches``: OneVision's downsampling) and its
    candidate resolutions; then rescale and normalize."""
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
    return f"decode|anyres({pinpoints}, {size}, {grid}, method='{method}'{more})|", pinpoints


def load_llava(src) -> tuple[dict, dict, dict]:
    """``(run config, VLM params, processor settings)`` of a ``LlavaForConditionalGeneration`` or
    ``LlavaNextForConditionalGeneration`` folder (the latter's AnyRes: ``model.anyres`` with its
    candidate resolutions and tile, the learned ``image_newline``; its views made on the host by
    the ``anyres`` op)."""
    from vitmm.models.vit import ViT
    from vitmm.models.vlm import VLM

    src = pathlib.Path(src).expanduser()
    config = io.read_json(src)
    tensors = _llava_names(io.read_tensors(src))
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
    images, processor = _processor(src)
    anyres = None
    if next_:
        max_patches = _max_patches(config, src) if onevision else None
        image_pp, pinpoints = _anyres_pp(images, size, vision["patch_size"], src, max_patches)
        anyres = {"pinpoints": pinpoints, "tile": size, **({"max_patches": max_patches} if max_patches else {})}
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
    if config.get("vision_feature_layer", -1) == -1:
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


def load_paligemma(src) -> tuple[dict, dict, dict]:
    """``(run config, VLM params, extras)`` of a ``PaliGemmaForConditionalGeneration`` folder: its SigLIP
    tower's normed output (``vision_layer=-1``; a pooling head, never used, is left out), the linear
    projector, Gemma, attention both ways over the image and the prompt (``prefix_lm``)."""
    from vitmm.models.vit import ViT
    from vitmm.models.vlm import VLM

    src = pathlib.Path(src).expanduser()
    config = io.read_json(src)
    tensors = {k: v for k, v in _llava_names(io.read_tensors(src)).items() if not k.startswith("vision.head.")}
    vision_type = (config.get("vision_config") or {}).get("model_type", "siglip_vision_model")
    if vision_type != "siglip_vision_model":
        raise ValueError(f"{src}: a {vision_type!r} vision tower is not supported in PaliGemma; vitmm reads SigLIP's.")
    text_config = {"model_type": "gemma", **(config.get("text_config") or {})}
    vision_sd = StateDict({k: v for k, v in tensors.items() if k.startswith("vision.")}, f"{src} (vision tower)")
    vision, tower = clip._siglip_vision(vision_sd, config, tensors, "vision.")
    size = int((config.get("vision_config") or {}).get("image_size") or 224)
    tower = finish(vision_sd, ViT(**vision), tower, (jnp.zeros((1, size, size, 3)),),
                   "a vitmm ViT (PaliGemma's SigLIP tower)")
    lm_tensors = {k: v for k, v in tensors.items() if k.startswith(("model.", "lm_head."))}
    lm, language = hf_lm.lm_from_tensors(text_config, lm_tensors, f"{src} (language model)")
    proj_sd = StateDict({k: v for k, v in tensors.items() if k.startswith("projector.")}, f"{src} (projector)")
    project = {"proj": linear(proj_sd, "projector.linear")}
    left = sorted(set(tensors) - set(vision_sd.tensors) - set(lm_tensors) - set(proj_sd.tensors))
    problems = [f"  missing: {k}" for k in proj_sd.missing] + [f"  unused: {k}" for k in proj_sd.unused() + left]
    model = dict(vision=vision, connector={"name": "linear", "budget": "all"}, lm=lm, vision_layer=-1,
                 use_cls=False, prefix_lm=True, mrope=False, anyres=None, max_len=2048, loss_positions=None)
    params = {"tower": tower, "project": jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), project),
              "language": language}
    if not problems:
        expected = jax.eval_shape(VLM(vision, model["connector"], lm, -1).init, jax.random.key(0),
                                  jnp.zeros((1, size, size, 3)), jnp.zeros((1, 4), jnp.int32))["params"]
        problems = tree.mismatches(expected, params)
    if problems:
        raise ValueError(f"Cannot load {src} as a vitmm VLM (PaliGemma):\n" + "\n".join(problems))
    images, _ = _processor(src)
    hw = (images.get("size") or {}).get("height"), (images.get("size") or {}).get("width")
    if hw != (size, size) or images.get("resample", 3) not in (2, 3) or images.get("do_center_crop"):
        raise ValueError(f"{src}: image processing {json.dumps(images.get('size'))} is not supported; vitmm reads "
                         f"SigLIP's resize to the tower's {size}x{size}.")
    method = "bicubic" if images.get("resample", 3) == 3 else "bilinear"
    pp = f"decode|resize({size}, method='{method}')|normalize({{image_mean}}, {{image_std}})|" + conversation_pp()
    run = {"task": "vlm", "seed": 0, "model": model, "init": {"vision": None, "lm": None, "checkpoint": None},
           "lora": {"rank": 0, "alpha": 0.0, "dropout": 0.0, "targets": []},
           "input": {"pp": pp, "image_size": size, "image_mean": list(images.get("image_mean", (0.5,) * 3)),
                     "image_std": list(images.get("image_std", (0.5,) * 3))}}
    return run, params, {"text_config": text_config, "chat_template": PALIGEMMA_TEMPLATE}


def import_vlm(src, out) -> pathlib.Path:
    """Writes the VLM workdir ``out`` for the transformers folder ``src`` (see the module docstring)."""
    from vitmm.interop import convert

    src = pathlib.Path(src).expanduser()
    name = architecture(src)
    if name is None:
        raise ValueError(f"{src} is a {'/'.join(io.read_json(src).get('architectures') or ['?'])} VLM, which vitmm "
                         f"does not import; it imports {', '.join(ARCHITECTURES)}.")
    from vitmm.interop.hf_idefics3 import load_idefics3
    from vitmm.interop.hf_qwen2_vl import load_qwen2_vl

    out = convert.new_folder(out)
    load = {"PaliGemmaForConditionalGeneration": load_paligemma, "Qwen2VLForConditionalGeneration": load_qwen2_vl,
            "Idefics3ForConditionalGeneration": load_idefics3}
    run, params, extra = load.get(name, load_llava)(src)
    if not (src / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{src} has no tokenizer.json; save the processor (or tokenizer) beside the model.")
    ids = {k: v if v is not None else convert.special_ids(io.read_json(src)).get(k)
           for k, v in convert.special_ids(extra["text_config"]).items()}
    run.update(tokenizer=str(out / "tokenizer.json"), chat_template=extra.get("chat_template") or io.chat_template(src),
               tokens=ids,
               source={"from": "hf", "src": str(src), "architecture": name})
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text((src / "tokenizer.json").read_text())
    return convert.write(out, params, run)
