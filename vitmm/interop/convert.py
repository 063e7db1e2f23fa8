"""Another codebase's checkpoint → a vitmm checkpoint folder, through one table of loaders.

Every source module has ``load(src, *, tower, image_size, **options) -> (TwoTowers kwargs,
params)``; ``LOADERS`` maps the source names to them. The folder written is laid out like a
``vitmm.train`` workdir (``checkpoints/0`` with ``params`` and a ``meta`` config), so
``--config.init.vision=DIR`` (a VLM's tower), ``--config.init.checkpoint=DIR`` and
``checkpoint.load_params(DIR)`` read it. Parameters sit under ``img``/``txt``/``img_proj``/
``txt_proj``/``t``/``b`` as in ``TwoTowers``; the model's keyword arguments are in the config at
``model`` (``TwoTowers(**config["model"])``; ``model.image`` alone for a ViT), the image
size its position table is for at ``input.image_size``, and the tower's input statistics at
``input.image_mean``/``input.image_std`` (``image_normalization``).
"""

from __future__ import annotations

import inspect
import json
import pathlib

from vitmm.checkpoint import Checkpointer
from vitmm.interop import big_vision, hf, openclip, timm_vit
from vitmm.interop.common import TOWERS

LOADERS = {"hf": hf.load, "timm": timm_vit.load, "open_clip": openclip.load, "big_vision": big_vision.load}


def load(source: str, src, *, tower: str = "both", image_size=None, **options) -> tuple[dict, dict]:
    """``(TwoTowers kwargs, params)`` of ``src`` read by the ``source`` loader; ``options`` are
    that loader's own (timm: ``num_heads``, ``global_pool``, ``act``, ``norm_eps``; open_clip:
    ``quick_gelu``, ``head_width``, ``text_heads``)."""
    if source not in LOADERS:
        raise ValueError(f"source {source!r} is not supported; choose one of {tuple(LOADERS)}.")
    if tower not in TOWERS:
        raise ValueError(f"tower must be one of {TOWERS}, got {tower!r}.")
    loader = LOADERS[source]
    known = set(inspect.signature(loader).parameters) - {"src", "tower", "image_size"}
    given = {k: v for k, v in options.items() if v is not None}
    if set(given) - known:
        raise ValueError(f"{sorted(set(given) - known)} do not apply to {source!r} checkpoints "
                         f"(its options: {sorted(known) or 'none'}).")
    return loader(src, tower=tower, image_size=image_size, **given)


LM_SOURCES = ("hf", "gguf")


def is_language_model(source: str, src) -> bool:
    """A GGUF file, or a transformers folder whose ``model_type`` is a causal LM vitmm reads."""
    from vitmm.interop import hf_lm, io

    if source == "gguf":
        return True
    if source != "hf":
        return False
    try:
        return io.read_json(src).get("model_type") in hf_lm.FAMILIES
    except FileNotFoundError:
        return False


def load_language_model(source: str, src) -> tuple[dict, dict, str | None, str | None, dict]:
    """``(LM kwargs, params, tokenizer.json text or None, chat template or None, special token
    ids {bos_id, eos_id, pad_id, eos_ids})``."""
    from vitmm.interop import gguf_lm, hf_lm, io

    if source == "gguf":
        kwargs, params, tokenizer, template = gguf_lm.load(src)
        metadata, _ = gguf_lm.read_metadata(src)
        return kwargs, params, tokenizer.to_str(), template, gguf_special_ids(metadata)
    kwargs, params = hf_lm.load_lm(src)
    folder = pathlib.Path(src).expanduser()
    folder = folder if folder.is_dir() else folder.parent
    tokenizer = (folder / "tokenizer.json").read_text() if (folder / "tokenizer.json").is_file() else None
    return (kwargs, params, tokenizer, io.chat_template(folder),
            special_ids(io.read_json(folder), generation=io.generation_config(folder)))


def special_ids(*configs: dict, generation: dict | None = None) -> dict:
    """``{bos_id, eos_id, pad_id, eos_ids}`` from transformers ``configs``, the first that sets one
    winning (a VLM's ``text_config``, then its ``config.json``). ``eos_ids``: every EOS id they and
    the ``generation`` config (``generation_config.json``) list, in that order: instruct models end
    a turn with one past the first (Llama 3's ``<|eot_id|>``, Gemma-it's ``<end_of_turn>``). ``eos_id``
    is the first of them, the one that pads (sticky EOS)."""
    listed = lambda v: [] if v is None else list(v) if isinstance(v, list) else [v]  # noqa: E731
    eos_ids = list(dict.fromkeys(i for c in [*configs, generation or {}] for i in listed(c.get("eos_token_id"))))
    first = {k: next((c[g] for c in configs if c.get(g) is not None), None)
             for k, g in (("bos_id", "bos_token_id"), ("pad_id", "pad_token_id"))}
    return {**first, "eos_id": eos_ids[0] if eos_ids else None, "eos_ids": eos_ids or None}


# Token texts llama.cpp ends generation on wherever the vocabulary has them (llama-vocab.cpp): its
# converter writes no eot/eom key for Qwen2/2.5/3 or Llama 3.x, whose generation_config.json lists them.
END_OF_GENERATION = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>",
                     "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>",
                     "<｜end▁of▁sentence｜>")


def gguf_special_ids(metadata: dict) -> dict:
    """``{bos_id, eos_id, pad_id, eos_ids}`` from a GGUF's ``tokenizer.ggml.*`` keys. ``eos_ids``: the
    EOS, then the end-of-turn and end-of-message ids llama.cpp records apart (Gemma-it's
    ``<end_of_turn>``, Llama 3's ``<|eot_id|>`` and ``<|eom_id|>``), those present, then every token
    whose text llama.cpp ends generation on (``END_OF_GENERATION``: Qwen's ``<|endoftext|>``, Llama
    3.1's ``<|end_of_text|>``), as the same model converted from its Hugging Face folder stops."""
    key = lambda name: metadata.get(f"tokenizer.ggml.{name}")  # noqa: E731
    listed = [key(n) for n in ("eos_token_id", "eot_token_id", "eom_token_id")]
    named = [i for i, t in enumerate(key("tokens") or ()) if t in END_OF_GENERATION]
    eos_ids = [int(i) for i in dict.fromkeys([*listed, *named]) if i is not None]
    return {"bos_id": key("bos_token_id"), "eos_id": key("eos_token_id"), "pad_id": key("padding_token_id"),
            "eos_ids": eos_ids or None}


# Input statistics (mean, std per channel of x / 255) each source's towers were trained with.
OPENAI_CLIP = ((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))
IMAGENET = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
HALF = ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))  # value_range(-1, 1): vitmm, big_vision, SigLIP, HF ViT
HF_DEFAULTS = {"clip": OPENAI_CLIP, "clip_vision_model": OPENAI_CLIP, "siglip": HALF, "siglip_vision_model": HALF,
               "vit": HALF, "dinov2": IMAGENET, "dinov2_with_registers": IMAGENET}


def image_normalization(source: str, src) -> tuple[tuple, tuple]:
    """``(mean, std)`` of the tower's input: the checkpoint's own preprocessing file where it
    has one (HF ``preprocessor_config.json``, timm ``config.json`` ``pretrained_cfg``, open_clip
    ``preprocess_cfg``), else the source's default for the model type."""
    from vitmm.interop import io

    folder = pathlib.Path(src).expanduser()
    folder = folder if folder.is_dir() else folder.parent

    def read(name):
        return json.loads((folder / name).read_text()) if (folder / name).is_file() else {}

    if source == "hf":
        pre = read("preprocessor_config.json")
        if "image_mean" in pre:
            return tuple(pre["image_mean"]), tuple(pre["image_std"])
        return HF_DEFAULTS.get(io.read_json(src).get("model_type"), OPENAI_CLIP)
    if source == "timm":
        cfg = read("config.json").get("pretrained_cfg") or {}
        return (tuple(cfg["mean"]), tuple(cfg["std"])) if "mean" in cfg else IMAGENET
    if source == "open_clip":
        cfg = read("open_clip_config.json").get("preprocess_cfg") or {}
        return (tuple(cfg["mean"]), tuple(cfg["std"])) if "mean" in cfg else OPENAI_CLIP
    return HALF


def new_folder(out) -> pathlib.Path:
    """``out`` as an absolute path: a new (or empty) folder that can be written (``cli.new_output_folder``),
    or what a stopped conversion left there (its tokenizer, written first; no checkpoint yet)."""
    from vitmm import cli

    out = pathlib.Path(out).expanduser().absolute()
    if out.is_dir() and {p.name for p in out.iterdir()} == {"tokenizer.json"}:
        return out
    return cli.new_output_folder(out)


def write(out: pathlib.Path, params: dict, config: dict) -> pathlib.Path:
    """``params`` and ``config`` as checkpoint 0 of ``out``, written whole or not at all."""
    checkpointer = Checkpointer(out, keep=1, async_save=False)
    checkpointer.save(0, {"params": params}, {}, {"step": 0, "config": json.dumps(config)})
    checkpointer.close()
    return out


def convert_language_model(source: str, src, out) -> pathlib.Path:
    """An LM checkpoint folder: parameters under ``lm``, the model's settings at
    ``config["model"]["lm"]``, the chat template at ``config["chat_template"]``, and the tokenizer
    as ``out/tokenizer.json`` (when the source has one)."""
    out = new_folder(out)
    kwargs, params, tokenizer, template, ids = load_language_model(source, src)
    config = {"model": {"lm": kwargs}, "source": {"from": source, "src": str(src)}, "chat_template": template,
              "tokens": ids}
    if tokenizer is not None:  # before the checkpoint, whose presence marks the folder done (a rerun may redo it)
        out.mkdir(parents=True, exist_ok=True)
        (out / "tokenizer.json").write_text(tokenizer)
    else:  # a VLM run on this LM reads its tokenizer here (init.lm): said now, not at that run's start
        print(f"Warning: {src} has no tokenizer.json (a fast tokenizer's file); a VLM run with init.lm={out} "
              "needs one: copy it into that folder.", flush=True)
    return write(out, {"lm": params}, config)


def convert(source: str, src, out, *, tower: str = "both", image_size=None, **options) -> pathlib.Path:
    """Writes ``load(source, src, ...)`` to the new checkpoint folder ``out`` and returns it
    (a language model goes through ``convert_language_model``)."""
    from vitmm.interop import io as io_lib
    from vitmm.interop import vlm
    from vitmm.models.patch_embed import to_pair

    if source == "hf" and vlm.is_vlm(src):  # a whole VLM: a VLM workdir
        given = {k: v for k, v in options.items() if v is not None}
        if given or image_size is not None or tower != "both":
            names = "/".join(io_lib.read_json(src).get("architectures") or ["VLM"])
            raise ValueError(f"{src} is a whole VLM ({names}); --tower, --image_size and {sorted(given)} do not "
                             "apply.")
        return vlm.import_vlm(src, out)
    if is_language_model(source, src):
        given = {k: v for k, v in options.items() if v is not None}
        if given or image_size is not None or tower != "both":
            raise ValueError(f"{src} is a language model; --tower, --image_size and {sorted(given)} do not apply.")
        return convert_language_model(source, src, out)
    out = new_folder(out)
    model, params = load(source, src, tower=tower, image_size=image_size, **options)
    config = {"model": model, "source": {"from": source, "src": str(src), "tower": tower}}
    size = None
    if model["image"] is not None and "pos_embedding" in params["img"]:  # the resolution the table is for
        grid, patch = params["img"]["pos_embedding"].shape[1:3], to_pair(model["image"]["patch_size"])
        size = (int(grid[0] * patch[0]), int(grid[1] * patch[1]))
    elif model["image"] is not None and image_size is not None:  # fixed sin-cos positions fit any size
        size = to_pair(image_size)
    if model["image"] is not None:  # what the tower's input must look like
        mean, std = image_normalization(source, src)
        config["input"] = {"image_mean": list(mean), "image_std": list(std)}
    if size is not None:  # an int for a square image, else [height, width]
        config["input"]["image_size"] = size[0] if size[0] == size[1] else list(size)
    return write(out, params, config)
