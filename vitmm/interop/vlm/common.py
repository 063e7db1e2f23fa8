"""What the whole-VLM converters share: the architectures ``import_vlm`` reads, a folder's processor
settings, the pp's text steps, LLaVA-style tensor names, and the export's ``<image>`` token."""

from __future__ import annotations

import json
import pathlib

from vitmm.interop import io

ARCHITECTURES = ("LlavaForConditionalGeneration", "LlavaNextForConditionalGeneration",
                 "LlavaOnevisionForConditionalGeneration",
                 "PaliGemmaForConditionalGeneration", "Qwen2VLForConditionalGeneration",
                 "Idefics3ForConditionalGeneration")



def conversation_pp(args: str = "", keep: str = "") -> str:
    """The pp's text steps: the conversation through the chat template (``conversation_tokens``,
    with ``args`` more), then the keys a VLM batch holds (and ``keep`` more)."""
    return (f"conversation_tokens({{max_len}}, overflow='truncate_turns', max_answer={{loss_positions}}{args})|"
            f"keep('image', 'ids', 'answer_mask', 'prompt_len', 'image_pos', 'has_image'{keep})")



def generation_ids(tokenizer) -> dict:
    """``generation_config.json``'s special ids: ``eos_token_id`` every id the run stops on (a list
    when there are several, as transformers' ``generate`` takes it), so the export stops at an
    instruct LM's end of turn and a re-import records each."""
    eos = list(tokenizer.eos_ids)
    return {"bos_token_id": tokenizer.bos_id, "eos_token_id": eos if len(eos) > 1 else eos[0],
            "pad_token_id": tokenizer.pad_id}



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



def llava_names(tensors: dict) -> dict:
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



def processor_settings(folder: pathlib.Path) -> tuple[dict, dict]:
    """``(image processor settings, processor settings)``: transformers 5 nests the image processor's
    in ``processor_config.json``; transformers 4 keeps them in ``preprocessor_config.json`` and, where
    it writes a ``processor_config.json``, only the processor's own keys there (``image_token``,
    ``patch_size``, ...)."""
    read = {name: json.loads((folder / name).read_text())
            for name in ("processor_config.json", "preprocessor_config.json") if (folder / name).is_file()}
    processor = read.get("processor_config.json", {})
    if "image_processor" in processor:
        return processor["image_processor"], processor
    if "preprocessor_config.json" in read:
        image = read["preprocessor_config.json"]
        return image, {**image, **processor}
    raise FileNotFoundError(f"{folder} has no image processor settings (processor_config.json with an "
                            "image_processor, or preprocessor_config.json); save the processor beside the model.")



def with_image_token(tokenizer) -> tuple[str, int, bool]:
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



def grown(language: dict, text_config: dict, vocab: int) -> tuple[dict, dict]:
    """The LM's tensors and config with zero rows up to ``vocab`` in its embedding (and untied head)."""
    import numpy as np

    out = dict(language)
    for key in ("model.embed_tokens.weight", "lm_head.weight"):
        if key in out:
            w = out[key]
            out[key] = np.concatenate([w, np.zeros((vocab - w.shape[0], w.shape[1]), w.dtype)])
    return out, {**text_config, "vocab_size": vocab}



def export_start(workdir) -> tuple:
    """``(config, vision, lm, params, tokenizer, steps)`` of the VLM in ``workdir`` for an exporter:
    its settings, the tower's and the LM's kwargs, its parameters with LoRA merged (what ``vitmm.chat``
    runs), its tokenizer and its pp's ops (``preprocess.ops``)."""

    from vitmm import checkpoint as ckpt_lib
    from vitmm.data import preprocess
    from vitmm.models import lora as lora_lib
    from vitmm.train import pp_template, sources, tasks, vlm_start

    config = sources.run_config(workdir)
    if config.get("task") != "vlm":
        raise ValueError(f"{workdir} holds a {config.get('task', 'contrastive')!r} run, not a VLM.")
    vision, lm = vlm_start.vlm_parts(config)
    params = ckpt_lib.load_params(workdir)
    if "lora" in params:
        base = {k: v for k, v in params.items() if k != "lora"}
        params = lora_lib.merge(base, params["lora"], vlm_start.lora_alpha(config))
    return config, vision, lm, params, tasks.tokenizer_for(config), preprocess.ops(pp_template.pp_string(config))


def marks_ids(tokenizer, marks) -> tuple[dict, list[str]]:
    """Each of ``marks``' token id, and the problem when the tokenizer lacks some (a byte one has none)."""
    from vitmm.data import tokenizer as tok_lib

    ids = {m: tokenizer.token_id(m) if isinstance(tokenizer, tok_lib.HFTokenizer) else None for m in marks}
    missing = [m for m, i in ids.items() if i is None]
    return ids, [f"a tokenizer without {', '.join(missing)}"] if missing else []


def export_folder(workdir, architecture: str, problems: list[str], out) -> pathlib.Path:
    """``out`` for the export, or ValueError with every problem (FileExistsError for a folder that is
    not empty), before anything is written."""
    if problems:
        raise ValueError(f"{workdir} cannot be a{'n' if architecture[0] in 'AEIOU' else ''} {architecture}: "
                         + "; ".join(problems) + ".")
    from vitmm import cli

    return cli.new_output_folder(out)


PIL_RESAMPLE = {"lanczos": 1, "bilinear": 2, "bicubic": 3}  # an image processor's "resample": PIL's codes


def pil_resample(method: str | None) -> int:
    """The ``resample`` code an image processor reads for a resize op's ``method`` (its default: bilinear)."""
    method = method or "bilinear"
    if method not in PIL_RESAMPLE:
        raise ValueError(f"resize method {method!r} has no transformers image processor code; vitmm's are "
                         f"{sorted(PIL_RESAMPLE)}.")
    return PIL_RESAMPLE[method]


# Turns messages whose content is a list of typed parts (transformers' and lmms-eval's form: {"type": "image"},
# {"type": "text", "text": ...}) into plain strings, each image part as IMAGE_TEXT, for a template written for
# strings (a converted LM's); string contents pass unchanged.
TYPED_PARTS = """{%- set ns = namespace(messages=[]) -%}
{%- for message in messages -%}
{%- if message['content'] is string -%}{%- set ns.messages = ns.messages + [message] -%}
{%- else -%}{%- set text = namespace(value='') -%}
{%- for part in message['content'] -%}
{%- if part['type'] == 'image' -%}{%- set text.value = text.value + IMAGE_TEXT -%}
{%- elif part['type'] == 'text' -%}{%- set text.value = text.value + part['text'] -%}{%- endif -%}
{%- endfor -%}
{%- set ns.messages = ns.messages + [{'role': message['role'], 'content': text.value}] -%}
{%- endif -%}
{%- endfor -%}
{%- set messages = ns.messages -%}
"""


def with_typed_parts(chat_template: str, image_text: str = "<image>\n") -> str:
    """``chat_template`` that also reads typed-part contents (``TYPED_PARTS``), unless it already
    does (an imported VLM's own template places its images itself): decided by rendering a
    typed-part question, as transformers would give it."""
    from vitmm.data.tokenizer import render_chat

    probe = "vitmm-typed-part-probe"
    try:  # a template for strings prints the list as it is (its repr), one for parts the text alone
        out = render_chat(chat_template, [{"role": "user", "content": [{"type": "text", "text": probe}]}], True)
        if probe in out and "'type'" not in out:
            return chat_template
    except Exception:  # noqa: BLE001 - a template that fails on a list reads strings only
        pass
    return TYPED_PARTS.replace("IMAGE_TEXT", json.dumps(image_text)) + chat_template


def write_folder(out: pathlib.Path, tensors: dict, files: dict, tokenizer_json: str, chat_template: str | None,
                 image_text: str = "<image>\n"):
    """A transformers folder: ``model.safetensors``, each of ``files`` as JSON, ``tokenizer.json`` and
    ``chat_template.jinja`` (``with_typed_parts``: an image part is ``image_text``)."""
    out.mkdir(parents=True, exist_ok=True)
    io.write_safetensors(tensors, out / "model.safetensors")
    for name, value in files.items():
        (out / name).write_text(json.dumps(value, indent=1) + "\n")
    (out / "tokenizer.json").write_text(tokenizer_json)
    if chat_template:
        (out / "chat_template.jinja").write_text(with_typed_parts(chat_template, image_text))
