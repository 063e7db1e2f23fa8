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
with the run's tokenizer, special ids and chat template), ``out/vision/`` (transformers'
``CLIPVisionModel`` layout, for towers of that form: a CLS token, learned positions with a CLS
slot, pre-norm, LayerNorm, a square grid; a tower of another form is not written and the
summary says why) and ``out/connector.safetensors`` with ``connector.json`` (the connector's and
the VLM's settings; every parameter but the tower's and the LM's under its ``/``-joined path: the
connector's ``project``, AnyRes's ``image_newline``). Every part is made before anything is written.
``hf_lm.load_lm(out/lm)``, ``hf.load_clip_vision(out/vision)`` and ``load_connector(out)`` give back
the exact parameters (tested).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import numpy as np

from vitmm import cli, tree
from vitmm.interop import hf, hf_lm, io


def clip_vision_problem(kwargs: dict, params: dict) -> str | None:
    """Why transformers' CLIP vision layout cannot hold this tower (None: it can)."""
    from vitmm.interop.hf.clip_export import tower_problems

    return "; ".join(p.removeprefix("the tower: ") for p in tower_problems(kwargs, params, siglip=False)) or None


# The VLM's own settings beside the connector's (connector.json), when the run sets them.
VLM_SETTINGS = ("vision_layer", "use_cls", "anyres", "mrope", "prefix_lm", "max_len")


def export_vlm(workdir, out) -> dict:
    """Writes the parts of the VLM in ``workdir`` under ``out``; returns what was written. Every
    part is made before the folder is created, so a refusal or an error leaves nothing behind."""
    from vitmm.data import tokenizer as tok_lib
    from vitmm.interop.vlm.common import export_start, generation_ids

    config, vision, lm, params, tokenizer, _ = export_start(workdir)
    out = cli.new_output_folder(out)  # refused before the work; created after it
    files = {}  # path under out -> tensors (a dict) or text

    tensors, lm_config = hf_lm.export_lm(lm, params["language"])
    files["lm/model.safetensors"] = tensors
    written = {"lm": str(out / "lm")}
    if isinstance(tokenizer, tok_lib.HFTokenizer):  # a converted LM's: with its special ids and template
        ids = generation_ids(tokenizer)
        lm_config.update(bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id)
        files["lm/tokenizer.json"] = tokenizer.to_str()
        files["lm/tokenizer_config.json"] = json.dumps({
            "bos_token": tokenizer.token(tokenizer.bos_id), "eos_token": tokenizer.token(tokenizer.eos_id),
            "pad_token": tokenizer.token(tokenizer.pad_id), "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": int(config.model.get("max_len") or 2048),
            **({"chat_template": tokenizer.chat_template} if tokenizer.chat_template else {})}, indent=1)
        files["lm/generation_config.json"] = json.dumps(ids, indent=1)
    else:
        written["tokenizer"] = ("not written: the run's byte tokenizer has no transformers form (train on a converted "
                                "LM for one)")
    files["lm/config.json"] = json.dumps(lm_config, indent=1)

    problem = clip_vision_problem(vision, params["tower"])
    if problem is None:
        tensors, vision_config = hf.export_clip_vision(vision, params["tower"])
        files["vision/model.safetensors"] = tensors
        files["vision/config.json"] = json.dumps(vision_config, indent=1)
        written["vision"] = str(out / "vision")
    else:
        written["vision"] = f"not written: transformers' CLIP vision layout cannot hold this tower ({problem})"

    # The connector and the VLM's other parameters (an AnyRes newline, a CLS projection): all but the
    # tower and the LM, under their /-joined paths.
    rest = {k: v for k, v in params.items() if k not in ("tower", "language")}
    files["connector.safetensors"] = {k: np.ascontiguousarray(np.asarray(v, np.float32))
                                      for k, v in tree.flatten(rest).items()}
    model = config.model.to_dict()
    settings = {"connector": model["connector"], **{k: model[k] for k in VLM_SETTINGS if model.get(k) is not None}}
    files["connector.json"] = json.dumps(settings, indent=1)
    written["connector"] = str(out / "connector.safetensors")

    for name, value in files.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        if isinstance(value, dict):
            io.write_safetensors(value, out / name)
        else:
            (out / name).write_text(value + "\n")
    return written


def load_connector(folder) -> tuple[dict, dict]:
    """``(settings, params)`` of an exported connector (``export_vlm``'s ``out``): the VLM's
    parameters but its tower and LM (``project``, the connector's; ``image_newline`` with AnyRes;
    ``cls_proj`` with ``use_cls``)."""
    from safetensors.numpy import load_file

    folder = pathlib.Path(folder).expanduser()
    settings = json.loads((folder / "connector.json").read_text())
    params = tree.unflatten(load_file(str(folder / "connector.safetensors")))
    return settings, params if "project" in params else {"project": params}  # written before 2026-12-07: project only


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
