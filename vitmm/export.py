"""A trained VLM back in the layouts other codebases read: whole, or its parts.

    python -m vitmm.export --workdir workdirs/llava_s2 --out exported_hf/ --format hf
    python -m vitmm.export --workdir workdirs/smol/smollm2_stage2_lora --out exported/

``--format hf`` writes one transformers folder (``vitmm.interop.vlm.export_hf``), LoRA merged, with
its processor (the run's image steps), tokenizer and chat template, for ``AutoModelForImageTextToText``
and ``AutoProcessor`` (transformers 5's file layout): with prefix attention
``PaliGemmaForConditionalGeneration``, with M-RoPE ``Qwen2VLForConditionalGeneration``, with the pixel
shuffle ``Idefics3ForConditionalGeneration``, else ``LlavaForConditionalGeneration`` (a CLIP- or
SigLIP-layout tower; ``LlavaNext…`` with AnyRes, ``LlavaOnevision…`` with ``max_patches``); weights
as float32 in one ``model.safetensors``. A VLM none of them holds is refused with every reason. The
default, ``parts``, writes ``out/lm/`` (transformers' ``config.json`` + ``model.safetensors``, LoRA adapters merged,
with the tokenizer and chat template of the run's ``init.lm``), ``out/vision/`` (transformers'
``CLIPVisionModel`` layout, for towers of that form: a CLS token, learned positions with a CLS
slot, pre-norm, LayerNorm, a square grid; a tower of another form is not written and the
summary says why) and ``out/connector.safetensors`` with ``connector.json`` (the connector's
settings, its parameters under their ``/``-joined paths). ``hf_lm.load_lm(out/lm)``,
``hf.load_clip_vision(out/vision)`` and ``load_connector(out)`` give back the exact parameters
(tested).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import sys

import numpy as np

from vitmm import cli, tree
from vitmm.interop import hf, hf_lm, io


def clip_vision_problem(kwargs: dict, params: dict) -> str | None:
    """Why transformers' CLIP vision layout cannot hold this tower (None: it can)."""
    from vitmm.interop.hf.clip_export import tower_problems

    return "; ".join(p.removeprefix("the tower: ") for p in tower_problems(kwargs, params, siglip=False)) or None


def export_vlm(workdir, out) -> dict:
    """Writes the parts of the VLM in ``workdir`` under ``out``; returns what was written."""

    from vitmm import checkpoint as ckpt_lib
    from vitmm.models import lora as lora_lib
    from vitmm.train import sources, tasks, vlm_start

    config = sources.run_config(workdir)
    if config.get("task") != "vlm":
        raise ValueError(f"{workdir} holds a {config.get('task', 'contrastive')!r} run, not a VLM.")
    out = cli.new_output_folder(out)
    vision, lm = tasks.vlm_parts(config)
    params = ckpt_lib.load_params(workdir)
    if "lora" in params:
        base = {k: v for k, v in params.items() if k != "lora"}
        params = lora_lib.merge(base, params["lora"], vlm_start.lora_alpha(config))
    written = {}

    tensors, hf_config = hf_lm.export_lm(lm, params["language"])
    (out / "lm").mkdir(parents=True)
    io.write_safetensors(tensors, out / "lm" / "model.safetensors")
    (out / "lm" / "config.json").write_text(json.dumps(hf_config, indent=1))
    if sources.folder(config, "lm"):  # the tokenizer and chat template travel with the LM
        source = pathlib.Path(sources.folder(config, "lm")).expanduser()
        if (source / "tokenizer.json").is_file():
            shutil.copy(source / "tokenizer.json", out / "lm" / "tokenizer.json")
        saved = ckpt_lib.load_config(source)
        if saved.get("chat_template"):
            (out / "lm" / "tokenizer_config.json").write_text(json.dumps({"chat_template": saved["chat_template"]}))
    written["lm"] = str(out / "lm")

    problem = clip_vision_problem(vision, params["tower"])
    if problem is None:
        tensors, hf_config = hf.export_clip_vision(vision, params["tower"])
        (out / "vision").mkdir()
        io.write_safetensors(tensors, out / "vision" / "model.safetensors")
        (out / "vision" / "config.json").write_text(json.dumps(hf_config, indent=1))
        written["vision"] = str(out / "vision")
    else:
        written["vision"] = f"not written: transformers' CLIP vision layout cannot hold this tower ({problem})"

    flat = {k: np.ascontiguousarray(np.asarray(v, np.float32)) for k, v in tree.flatten(params["project"]).items()}
    io.write_safetensors(flat, out / "connector.safetensors")
    (out / "connector.json").write_text(json.dumps({"connector": config.model.connector.to_dict(),
                                                    "vision_layer": config.model.vision_layer,
                                                    "use_cls": config.model.use_cls}, indent=1))
    written["connector"] = str(out / "connector.safetensors")
    return written


def load_connector(folder) -> tuple[dict, dict]:
    """``(settings, params)`` of an exported connector (``export_vlm``'s ``out``)."""
    from safetensors.numpy import load_file

    folder = pathlib.Path(folder).expanduser()
    settings = json.loads((folder / "connector.json").read_text())
    return settings, tree.unflatten(load_file(str(folder / "connector.safetensors")))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vitmm.export", description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", required=True, help="a `python -m vitmm.train` VLM workdir")
    parser.add_argument("--out", required=True, help="a new folder")
    parser.add_argument("--format", default="parts", choices=("parts", "hf"),
                        help="parts: the LM, tower and connector apart; hf: one transformers VLM folder")
    args = parser.parse_args(argv)
    from vitmm import console

    console.quiet()  # the libraries' expected warnings (vitmm/console.py)
    try:
        if args.format == "hf":
            from vitmm.interop import vlm

            written = vlm.export_hf(args.workdir, args.out)
        else:
            written = export_vlm(args.workdir, args.out)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"python -m vitmm.export: {e}", file=sys.stderr)
        return 2
    for part, where in written.items():
        print(f"{part}: {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
