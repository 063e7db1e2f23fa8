"""Idefics3 and SmolVLM (``Idefics3ForConditionalGeneration``) → a vitmm VLM workdir
(``vlm.import_vlm``), and back (``export_idefics3``).

Its vision model is SigLIP's layout (learned positions over a tile's grid, the normed output:
``vision_layer=-1``); its connector is the pixel shuffle by ``scale_factor`` (``space_to_depth``'s
channel order, tested) into one bias-free projection: the ``pixel_shuffle`` connector with
``norm=False, depth=1, use_bias=False``; its LM a Llama. Its processor's image splitting is the
``idefics3_tiles`` op (``data.tiles``): each image becomes tiles plus the whole image, each a slot
of a flat sequence (``input.sequences``), with the processor's text around them. Full tiles only:
the processor pads none (every side is a multiple of the tile), and then its fractional positions
are each patch's own (checked for grids of 4 to 64 patches a side).
"""

from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from vitmm.interop import hf_lm, io
from vitmm.interop.common import StateDict, finish

MAX_IMAGES = 2  # images a prompt may hold (each its tiles and the whole image)
METHODS = {1: "lanczos", 2: "bilinear", 3: "bicubic"}  # PIL's resampling codes


def _names(tensors: dict) -> dict:
    """Idefics3's tensors as ``vision.*`` (SigLIP's without ``vision_model.``), ``connector.*``,
    ``model.*`` (the LM's own) and ``lm_head.*``."""
    out = {}
    for key, value in tensors.items():
        name = key.removeprefix("model.") if key.startswith(("model.vision_model.", "model.connector.",
                                                             "model.text_model.")) else key
        for old, new in (("vision_model.", "vision."), ("text_model.", "model.")):
            if name.startswith(old):
                name = new + name[len(old):]
                break
        out[name] = value
    return out


def _image_pp(images: dict, tile: int, src) -> str:
    longest = (images.get("size") or {}).get("longest_edge")
    tile_side = (images.get("max_image_size") or {}).get("longest_edge")
    if not images.get("do_resize", True) or not images.get("do_image_splitting", True) or longest is None \
            or tile_side != tile or images.get("resample", 1) not in METHODS:
        raise ValueError(f"{src}: image processing {json.dumps({k: images.get(k) for k in ('size', 'max_image_size', 'do_image_splitting', 'resample')})} "  # noqa: E501
                         f"is not supported; vitmm reads Idefics3's splitting into tiles of the tower's {tile}px "
                         "input (max_image_size) after a longest_edge resize, Lanczos, bilinear or bicubic.")
    return (f"decode(max_images={MAX_IMAGES}, alpha='white')|idefics3_tiles({int(longest)}, {tile}, "
            f"method='{METHODS[images.get('resample', 1)]}')|")


def load_idefics3(src) -> tuple[dict, dict, dict]:
    """``(run config, VLM params, extras)`` of an ``Idefics3ForConditionalGeneration`` folder."""
    from vitmm import tree
    from vitmm.interop.hf import clip
    from vitmm.interop.vlm.common import conversation_pp, processor_settings
    from vitmm.models.vit import ViT
    from vitmm.models.vlm import VLM

    src = pathlib.Path(src).expanduser()
    config = io.read_json(src)
    tensors = _names(io.read_tensors(src))
    vision_sd = StateDict({k: v for k, v in tensors.items() if k.startswith("vision.")}, f"{src} (vision tower)")
    vision, tower = clip._siglip_vision(vision_sd, config, tensors, "vision.")
    tile = int((config.get("vision_config") or {}).get("image_size") or 224)
    tower = finish(vision_sd, ViT(**vision), tower, (jnp.zeros((1, tile, tile, 3)),),
                   "a vitmm ViT (Idefics3's vision model)")
    text = {"model_type": "llama", **(config.get("text_config") or {})}
    lm_tensors = {k: v for k, v in tensors.items() if k.startswith(("model.", "lm_head."))}
    lm, language = hf_lm.lm_from_tensors(text, lm_tensors, f"{src} (language model)")
    proj_sd = StateDict({k: v for k, v in tensors.items() if k.startswith("connector.")}, f"{src} (connector)")
    project = {"mlp": {"fc1": {"kernel": proj_sd.take("connector.modality_projection.proj.weight").T}}}
    left = sorted(set(tensors) - set(vision_sd.tensors) - set(lm_tensors) - set(proj_sd.tensors))
    problems = [f"  missing: {k}" for k in proj_sd.missing] + [f"  unused: {k}" for k in proj_sd.unused() + left]
    connector = {"name": "pixel_shuffle", "merge": int(config.get("scale_factor", 2)), "norm": False, "depth": 1,
                 "use_bias": False}
    model = dict(vision=vision, connector=connector, lm=lm, vision_layer=-1, use_cls=False, prefix_lm=False,
                 mrope=False, anyres=None, max_len=2048, loss_positions=None)
    params = {"tower": tower, "project": jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), project),
              "language": language}
    if not problems:
        expected = jax.eval_shape(VLM(vision, connector, lm, -1).init, jax.random.key(0),
                                  jnp.zeros((1, tile, tile, 3)), jnp.zeros((1, 4), jnp.int32))["params"]
        problems = tree.mismatches(expected, params)
    if problems:
        raise ValueError(f"Cannot load {src} as a vitmm VLM (Idefics3):\n" + "\n".join(problems))
    images, _ = processor_settings(src)
    pp = (_image_pp(images, tile, src) + "normalize({image_mean}, {image_std})|"
          + conversation_pp(keep=", optional=('more_images', 'image_positions')"))
    per_image = (int(images["size"]["longest_edge"]) // tile) ** 2 + 1  # the most tiles an image gets, + the whole
    sequences = dict(length=2048, max_images=MAX_IMAGES * per_image, pack=True, bins=8, max_num_patches=0,
                     tower_length=0)
    run = {"task": "vlm", "seed": 0, "model": model, "init": {"vision": None, "lm": None, "checkpoint": None},
           "lora": {"rank": 0, "alpha": 0.0, "dropout": 0.0, "targets": []},
           "input": {"pp": pp, "image_size": tile, "image_mean": list(images.get("image_mean", (0.5,) * 3)),
                     "image_std": list(images.get("image_std", (0.5,) * 3)), "sequences": sequences}}
    return run, params, {"text_config": text}


def export_problems(model: dict, vision: dict, tower: dict, steps: list) -> list[str]:
    """Why ``Idefics3ForConditionalGeneration`` cannot hold this VLM (empty: it can)."""
    from vitmm.interop.hf.clip_export import tower_problems

    problems = tower_problems(vision, tower, siglip=True)  # Idefics3's tower is SigLIP's
    c = dict(model["connector"])
    if c.get("name") != "pixel_shuffle" or c.get("norm", True) or c.get("depth", 2) != 1 or c.get("use_bias", True) \
            or not c.get("merge"):
        problems.append(f"connector {c} (Idefics3's: pixel_shuffle with a fixed merge, norm=False, depth=1, "
                        "use_bias=False)")
    if model.get("vision_layer", -1) != -1 or any(model.get(k) for k in ("use_cls", "mrope", "anyres", "prefix_lm")):
        problems.append("the VLM (Idefics3 reads the tower's normed output; no CLS, M-RoPE, AnyRes or prefix "
                        "attention)")
    lm = model["lm"]
    if lm.get("qkv_bias") or lm.get("norm_offset") or lm.get("qk_norm") or lm.get("sliding_window"):
        problems.append("the LM (Idefics3's is a Llama)")
    if "idefics3_tiles" not in [name for name, _, _ in steps]:
        problems.append(f"the image steps {[name for name, _, _ in steps]} (Idefics3's processor: idefics3_tiles)")
    return problems


def export_idefics3(workdir, out) -> dict:
    """The VLM in ``workdir`` as a transformers ``Idefics3ForConditionalGeneration`` folder (the
    inverse of ``load_idefics3``) or ValueError with every reason it cannot be, before anything
    is written."""
    from vitmm.interop.hf.clip_export import export_siglip_vision
    from vitmm.interop.vlm.common import export_folder, export_start, generation_ids, marks_ids, write_folder
    from vitmm.train import pp_template

    config, vision, lm, params, tokenizer, steps = export_start(workdir)
    marks = ("<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>")
    ids, missing = marks_ids(tokenizer, marks)
    problems = export_problems({**config.model.to_dict(), "lm": lm}, vision, params["tower"], steps) + missing
    out = export_folder(workdir, "Idefics3ForConditionalGeneration", problems, out)

    tower, vision_config = export_siglip_vision(vision, params["tower"], prefix="model.vision_model.")
    language, text_config = hf_lm.export_lm(lm, params["language"], family="llama")
    tensors = {**tower, **{("model.text_model." + k.removeprefix("model.")): v for k, v in language.items()
                           if k.startswith("model.")}}
    tensors["lm_head.weight"] = language.get("lm_head.weight", language["model.embed_tokens.weight"])
    tensors["model.connector.modality_projection.proj.weight"] = np.ascontiguousarray(
        np.asarray(params["project"]["mlp"]["fc1"]["kernel"], np.float32).T)
    special = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.pad_id}
    merge, tile = int(config.model.connector.merge), int(config.input.image_size)
    hf_config = {"architectures": ["Idefics3ForConditionalGeneration"], "model_type": "idefics3",
                 "image_token_id": ids["<image>"], "scale_factor": merge, **special,
                 "tie_word_embeddings": bool(lm.get("tie_embeddings")),
                 "text_config": {**{k: v for k, v in text_config.items() if k != "architectures"}, **special},
                 "vision_config": {**vision_config, "model_type": "idefics3_vision", "image_size": tile},
                 "torch_dtype": "float32"}
    (longest, _), split_kwargs = next((a, k) for n, a, k in steps if n == "idefics3_tiles")
    mean, std = pp_template.image_normalization(config)
    images = {"image_processor_type": "Idefics3ImageProcessor", "do_convert_rgb": True, "do_resize": True,
              "size": {"longest_edge": int(longest)}, "max_image_size": {"longest_edge": tile},
              "do_image_splitting": True, "do_pad": True, "resample": {v: k for k, v in METHODS.items()}[
                  split_kwargs.get("method", "lanczos")], "do_rescale": True, "rescale_factor": 1 / 255,
              "do_normalize": True, "image_mean": list(mean), "image_std": list(std)}
    seq_len = (tile // vision["patch_size"] // merge) ** 2
    token = tokenizer.token
    tokenizer_config = {"bos_token": token(tokenizer.bos_id), "eos_token": token(tokenizer.eos_id),
                        "pad_token": token(tokenizer.pad_id), "extra_special_tokens": list(marks),
                        "tokenizer_class": "PreTrainedTokenizerFast", "processor_class": "Idefics3Processor",
                        "model_max_length": int(config.model.get("max_len") or 2048)}
    files = {"config.json": hf_config, "generation_config.json": generation_ids(tokenizer),
             "tokenizer_config.json": tokenizer_config,
             "processor_config.json": {"image_processor": images, "image_seq_len": seq_len,
                                       "processor_class": "Idefics3Processor"},
             "preprocessor_config.json": {**images, "processor_class": "Idefics3Processor"}}
    write_folder(out, tensors, files, tokenizer.to_str(), tokenizer.chat_template)
    return {"hf": str(out), "architecture": "Idefics3ForConditionalGeneration", "image_tokens": seq_len}
