"""PaliGemma (``PaliGemmaForConditionalGeneration``) in and out: SigLIP's normed output, the
``linear`` connector, Gemma, the image first and attention both ways over it and the prompt
(``prefix_lm``); its prompt format, which the processor builds and transformers has no chat template
for, as ``PALIGEMMA_TEMPLATE``."""

from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp

from vitmm import tree
from vitmm.interop import hf_lm, io
from vitmm.interop.common import StateDict, finish, linear
from vitmm.interop.hf import clip
from vitmm.interop.vlm.common import conversation_pp, llava_names, pil_resample, processor_settings

# PaliGemma's prompt as its processor builds it: the image first, then BOS, the prompt and a newline;
# the answer and EOS after (its training suffix). The image and BOS lead the first user turn only (one
# image prefix); later turns follow as text. The <image> tag may lead a turn's text.
PALIGEMMA_TEMPLATE = ("{% set ns = namespace(first=true) %}{% for m in messages %}{% if m['role'] == 'user' %}"
                      "{% if ns.first %}<image>{{ bos_token }}{% set ns.first = false %}{% endif %}"
                      "{{ m['content'] | replace('<image>', '') }}{{ '\\n' }}{% elif m['role'] == 'assistant' %}"
                      "{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")



def load_paligemma(src) -> tuple[dict, dict, dict]:
    """``(run config, VLM params, extras)`` of a ``PaliGemmaForConditionalGeneration`` folder: its SigLIP
    tower's normed output (``vision_layer=-1``; a pooling head, never used, is left out), the linear
    projector, Gemma, attention both ways over the image and the prompt (``prefix_lm``)."""
    from vitmm.models.vit import ViT
    from vitmm.models.vlm import VLM

    src = pathlib.Path(src).expanduser()
    config = io.read_json(src)
    tensors = {k: v for k, v in llava_names(io.read_tensors(src)).items() if not k.startswith("vision.head.")}
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
    images, _ = processor_settings(src)
    hw = (images.get("size") or {}).get("height"), (images.get("size") or {}).get("width")
    if hw != (size, size) or images.get("resample", 3) not in (2, 3) or images.get("do_center_crop"):
        raise ValueError(f"{src}: image processing {json.dumps(images.get('size'))} is not supported; vitmm reads "
                         f"SigLIP's resize to the tower's {size}x{size}.")
    method = "bicubic" if images.get("resample", 3) == 3 else "bilinear"
    pp = (f"decode(alpha='white')|resize({size}, method='{method}')|normalize({{image_mean}}, {{image_std}})|"
          + conversation_pp())
    run = {"task": "vlm", "seed": 0, "model": model, "init": {"vision": None, "lm": None, "checkpoint": None},
           "lora": {"rank": 0, "alpha": 0.0, "dropout": 0.0, "targets": []},
           "input": {"pp": pp, "image_size": size, "image_mean": list(images.get("image_mean", (0.5,) * 3)),
                     "image_std": list(images.get("image_std", (0.5,) * 3))}}
    return run, params, {"text_config": text_config, "chat_template": PALIGEMMA_TEMPLATE}



def _paligemma_problems(model: dict, vision: dict, tower: dict, lm: dict) -> list[str]:
    """Why ``PaliGemmaForConditionalGeneration`` cannot hold this VLM (empty: it can)."""
    from vitmm.interop.hf.clip_export import tower_problems

    problems = tower_problems(vision, tower, siglip=True)  # PaliGemma's tower is SigLIP's
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



def export_paligemma(workdir, out) -> dict:
    """The VLM in ``workdir`` as a transformers ``PaliGemmaForConditionalGeneration`` folder (weights
    in the layout every transformers version reads, config, processor, tokenizer) or ValueError with
    every reason it cannot be, before anything is written."""
    import numpy as np

    from vitmm.data import preprocess
    from vitmm.interop.hf.clip_export import export_siglip_vision
    from vitmm.interop.vlm.common import export_folder, export_start, generation_ids, marks_ids, write_folder
    from vitmm.train import pp_template

    config, vision, lm, params, tokenizer, ops = export_start(workdir)
    model = {**config.model.to_dict(), "vision": vision, "lm": lm}
    marks, missing = marks_ids(tokenizer, ("<image>",))
    image_id = marks["<image>"]
    problems = _paligemma_problems(model, vision, params["tower"], lm) + missing
    size = int(config.input.image_size)
    steps = [(n, a, k) for n, a, k in ops if n in preprocess.IMAGE_OPS_NAMES and n not in ("decode", "normalize")]
    if [n for n, _, _ in steps] != ["resize"] or steps[0][2].get("shorter") or steps[0][1][0] != size:
        problems.append(f"the image steps {[n for n, _, _ in steps]} (PaliGemma's processor resizes to the tower's "
                        "size)")
    out = export_folder(workdir, "PaliGemmaForConditionalGeneration", problems, out)
    tower, vision_config = export_siglip_vision(vision, params["tower"], prefix="vision_tower.vision_model.")
    language, text_config = hf_lm.export_lm(lm, params["language"], family="gemma")
    tensors = {**tower, **{("language_model." + k): v for k, v in language.items()}}
    proj = params["project"]["proj"]
    tensors["multi_modal_projector.linear.weight"] = np.ascontiguousarray(np.asarray(proj["kernel"]).T)
    tensors["multi_modal_projector.linear.bias"] = np.asarray(proj["bias"], np.float32)
    mean, std = pp_template.image_normalization(config)
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
              "size": {"height": size, "width": size}, "resample": pil_resample(method),
              "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": list(mean),
              "image_std": list(std), "image_seq_length": patches}
    token = tokenizer.token
    tokenizer_config = {"bos_token": token(tokenizer.bos_id), "eos_token": token(tokenizer.eos_id),
                        "pad_token": token(tokenizer.pad_id), "extra_special_tokens": ["<image>"],
                        "tokenizer_class": "PreTrainedTokenizerFast", "processor_class": "PaliGemmaProcessor",
                        "add_bos_token": False, "add_eos_token": False}
    files = {"config.json": hf_config, "processor_config.json": {"image_processor": images,
                                                                 "processor_class": "PaliGemmaProcessor"},
             "preprocessor_config.json": {**images, "processor_class": "PaliGemmaProcessor"},
             "tokenizer_config.json": tokenizer_config, "generation_config.json": generation_ids(tokenizer)}
    write_folder(out, tensors, files, tokenizer.to_str(), None)
    return {"hf": str(out), "architecture": "PaliGemmaForConditionalGeneration", "image_tokens": patches}

