"""Whole transformers VLMs in and out of vitmm: ``import_vlm`` (``python -m vitmm.interop --from hf``)
writes a VLM workdir that ``vitmm.chat``, ``vitmm.serve`` and ``vitmm.train`` (``init.checkpoint``)
use as it is; ``export_hf`` (``python -m vitmm.export --format hf``) writes a VLM as one transformers
folder for ``AutoModelForImageTextToText`` and ``AutoProcessor``.

    from vitmm.interop import vlm
    vlm.import_vlm("~/models/llava-1.5-7b-hf", "workdirs/llava15")
    vlm.export_hf("workdirs/llava15_ft", "exported/llava15_ft")

One module an architecture family, each with its importer (``load_*``: run config, parameters,
extras) and exporter (``export_*``): ``llava`` (LLaVA, LLaVA-NeXT, LLaVA-OneVision), ``paligemma``,
``qwen2_vl``, ``idefics3``; ``common`` what they share. A folder is recognised by ``config.json``'s
``architectures``; a VLM by its settings (prefix attention: PaliGemma; M-RoPE: Qwen2-VL; the
pixel shuffle: Idefics3; otherwise LLaVA, NeXT with AnyRes, OneVision with ``max_patches``).

What an imported workdir holds (``out``): ``checkpoints/0``, the VLM's parameters (``tower``,
``project``, ``language``, maybe ``image_newline``) and its config (``task="vlm"``, ``model.*``,
``input.pp`` with the processor's image steps then the chat template's conversation,
``input.image_size``, its statistics; ``tokenizer`` (``out/tokenizer.json``, the checkpoint's own),
``chat_template``, the special ``tokens`` and ``source``). The tokenizer path is absolute: move
the workdir and import it again. What a model needs that vitmm does not have is refused in one
line naming it; an export refuses with every reason, before anything is written.
"""

from __future__ import annotations

import pathlib

from vitmm.interop import io
from vitmm.interop.vlm.common import ARCHITECTURES, architecture, is_vlm
from vitmm.interop.vlm.idefics3 import export_idefics3, load_idefics3
from vitmm.interop.vlm.llava import export_llava, load_llava
from vitmm.interop.vlm.paligemma import PALIGEMMA_TEMPLATE, export_paligemma, load_paligemma
from vitmm.interop.vlm.qwen2_vl import export_qwen2_vl, load_qwen2_vl

__all__ = ["ARCHITECTURES", "PALIGEMMA_TEMPLATE", "architecture", "is_vlm", "import_vlm", "export_hf", "load_llava",
           "load_paligemma", "load_qwen2_vl", "load_idefics3", "export_llava", "export_paligemma",
           "export_qwen2_vl", "export_idefics3"]


def import_vlm(src, out) -> pathlib.Path:
    """Writes the VLM workdir ``out`` for the transformers folder ``src`` (see the module docstring)."""
    from vitmm.interop import convert

    src = pathlib.Path(src).expanduser()
    name = architecture(src)
    if name is None:
        raise ValueError(f"{src} is a {'/'.join(io.read_json(src).get('architectures') or ['?'])} VLM, which vitmm "
                         f"does not import; it imports {', '.join(ARCHITECTURES)}.")
    out = convert.new_folder(out)
    load = {"PaliGemmaForConditionalGeneration": load_paligemma, "Qwen2VLForConditionalGeneration": load_qwen2_vl,
            "Idefics3ForConditionalGeneration": load_idefics3}
    run, params, extra = load.get(name, load_llava)(src)
    if not (src / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{src} has no tokenizer.json; save the processor (or tokenizer) beside the model.")
    ids = convert.special_ids(extra["text_config"], io.read_json(src), generation=io.generation_config(src))
    run.update(tokenizer=str(out / "tokenizer.json"), chat_template=extra.get("chat_template") or io.chat_template(src),
               tokens=ids,
               source={"from": "hf", "src": str(src), "architecture": name})
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text((src / "tokenizer.json").read_text())
    return convert.write(out, params, run)


def export_hf(workdir, out) -> dict:
    """``python -m vitmm.export --format hf``: a VLM with prefix attention (``prefix_lm``) as
    ``PaliGemmaForConditionalGeneration``, with M-RoPE as ``Qwen2VLForConditionalGeneration``, with
    the pixel shuffle as ``Idefics3ForConditionalGeneration``, any other as
    ``LlavaForConditionalGeneration`` (``LlavaNext…`` with AnyRes, ``LlavaOnevision…`` with
    ``max_patches``)."""
    from vitmm import checkpoint as ckpt_lib

    config = ckpt_lib.load_config(workdir)
    if (config.get("model") or {}).get("prefix_lm"):
        return export_paligemma(workdir, out)
    if (config.get("model") or {}).get("mrope"):
        return export_qwen2_vl(workdir, out)
    if ((config.get("model") or {}).get("connector") or {}).get("name") == "pixel_shuffle":
        return export_idefics3(workdir, out)
    return export_llava(workdir, out)

