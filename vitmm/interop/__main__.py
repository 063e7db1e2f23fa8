"""``python -m vitmm.interop``: convert another codebase's checkpoint into a vitmm checkpoint folder.

    python -m vitmm.interop --from hf --src ~/models/clip-vit-base-patch16 --out workdirs/hf_clip_b16
    python -m vitmm.interop --from hf --src PATH --out DIR --tower vision --image_size 336x448   # H x W
    python -m vitmm.interop --from hf --src ~/models/dinov2-small --out workdirs/dinov2_s --image_size 224
    python -m vitmm.interop --from timm --src vit_small_patch16_224/model.safetensors --out DIR --num_heads 6
    python -m vitmm.interop --from open_clip --src ViT-B-16-quickgelu/open_clip_model.safetensors --out DIR
    python -m vitmm.interop --from big_vision --src webli_en_b16_224_63724782.npz --out DIR   # SigLIP
    python -m vitmm.interop --from hf --src ~/models/SmolLM2-135M-Instruct --out workdirs/smollm2
    python -m vitmm.interop --from gguf --src SmolLM2-135M-Instruct.Q4_1.gguf --out workdirs/smollm2_q4
    python -m vitmm.interop --from hf --src ~/models/llava-1.5-7b-hf --out workdirs/llava15   # a whole VLM

``--from hf`` reads CLIP (``--tower`` both, vision or text), SigLIP and ViT/DINOv2 folders
(``config.json`` + ``model.safetensors`` or ``pytorch_model.bin``) by their ``model_type``, Llama,
Qwen2, Qwen3, Mistral, Phi-3, Gemma and Gemma 2 language models (with the folder's
``tokenizer.json``), and whole VLMs by their ``architectures`` (``vitmm.interop.vlm``: a VLM
workdir for ``vitmm.chat``/``serve``/``train``); ``--from gguf`` a
GGUF language model with a byte-level BPE vocabulary, rebuilt from the metadata (Llama 3, SmolLM,
Qwen2/2.5/3: ``tokenizer.ggml.pre`` llama-bpe, smollm, qwen2 and their aliases; llama.cpp writes
Gemma 2/3, Phi-3 and Llama-2-style models with a SentencePiece
vocabulary, which vitmm does not rebuild: convert their Hugging Face folders with ``--from hf``);
``--from timm`` a ``VisionTransformer`` state dict (``--num_heads``: by default that of the vitmm
variant with the same width, depth and MLP size, else width/64 where that is the standard, else
asked for;
``--global_pool`` when a CLS model was trained with ``avg``; ``--act``/``--norm_eps``, read from
timm's ``config.json`` beside the weights when there is one: QuickGELU for ``*_clip_quickgelu_*``,
else GELU; eps 1e-5 for ``pre_norm`` CLIP towers, else 1e-6); ``--from open_clip`` a ViT ``CLIP``
state dict (QuickGELU and head counts from ``open_clip_config.json`` beside it, or ``--quick_gelu``,
``--head_width``, ``--text_heads``); ``--from
big_vision`` an ``.npz`` ViT or two towers. ``--image_size`` resamples the learned position
table the way the source does. What is written: ``vitmm.interop.convert``.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

from vitmm.interop.common import TOWERS
from vitmm.interop.convert import LOADERS, convert


def image_size_arg(text: str) -> int | tuple[int, int]:
    """``"336"`` → 336, ``"336x448"`` → ``(336, 448)`` (height × width)."""
    parts = text.lower().split("x")
    if len(parts) not in (1, 2) or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"--image_size {text!r}: give a positive size (336) or HxW (336x448).")
    return int(parts[0]) if len(parts) == 1 else (int(parts[0]), int(parts[1]))


def guess_source(src) -> str | None:
    """The ``--from`` that ``src`` looks like by its file names and headers (no weights read); None
    when it looks like none. A hint for a refusal, never a choice made for the user."""
    import json
    import struct

    path = pathlib.Path(src).expanduser()
    folder = path if path.is_dir() else path.parent
    try:
        if path.is_file():
            with open(path, "rb") as f:
                head = f.read(8)
            if head[:4] == b"GGUF":
                return "gguf"
            if path.suffix == ".npz":
                return "big_vision"
        if (folder / "open_clip_config.json").is_file() or path.name.startswith("open_clip_"):
            return "open_clip"
        if (folder / "config.json").is_file():  # timm's hub folders have one too, naming an architecture
            config = json.loads((folder / "config.json").read_text())
            return "timm" if "architecture" in config or "pretrained_cfg" in config else "hf"
        weights = path if path.is_file() else folder / "model.safetensors"
        if weights.suffix != ".safetensors" or not weights.is_file():
            return None
        with open(weights, "rb") as f:  # safetensors: an 8-byte length, then a JSON header naming the tensors
            (length,) = struct.unpack("<Q", f.read(8))
            names = set(json.loads(f.read(min(length, 100_000_000)))) if length < 100_000_000 else set()
    except (OSError, ValueError, struct.error):
        return None
    if any(name.startswith("visual.") for name in names):
        return "open_clip"
    if "patch_embed.proj.weight" in names:
        return "timm"
    return None


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m vitmm.interop", description=__doc__.splitlines()[0])
    parser.add_argument("--from", dest="source", required=True, choices=(*LOADERS, "gguf"))
    parser.add_argument("--src", required=True, help="checkpoint folder (config.json + weights) or weights file")
    parser.add_argument("--out", required=True, help="new vitmm checkpoint folder")
    parser.add_argument("--tower", default="both", choices=TOWERS)
    parser.add_argument("--image_size", type=image_size_arg, default=None,
                        help="resample positions to this resolution: 336, or HxW such as 336x448")
    parser.add_argument("--num_heads", type=int, default=None,
                        help="timm: attention heads (default: config.json's, else the vitmm variant of this width, "
                             "depth and MLP size, e.g. 16 for ViT-H; refused when unknown)")
    parser.add_argument("--global_pool", default=None, help="timm: token | avg | map | '' (default: from the tensors)")
    parser.add_argument("--act", default=None, choices=("gelu", "quick_gelu", "gelu_tanh", "relu", "silu"),
                        help="timm: MLP activation (default: config.json beside the weights, QuickGELU for "
                             "*_clip_quickgelu_* architectures, else gelu; OpenAI CLIP weights without "
                             "config.json need quick_gelu)")
    parser.add_argument("--norm_eps", type=float, default=None,
                        help="timm: LayerNorm epsilon (default: 1e-5 for pre_norm CLIP towers, else 1e-6)")
    parser.add_argument("--head_width", type=int, default=None,
                        help="open_clip: image tower head width (default: open_clip_config.json, else the vitmm "
                             "variant of this width, depth and MLP size: ViT-H/14 80, g/14 88, bigG/14 104)")
    parser.add_argument("--text_heads", type=int, default=None,
                        help="open_clip: text tower heads (default: open_clip_config.json, else width // 64)")
    parser.add_argument("--quick_gelu", default=None, choices=("true", "false"),
                        help="open_clip: QuickGELU MLPs (default: open_clip_config.json beside the weights)")
    args = parser.parse_args(argv)
    from vitmm import console

    console.quiet()  # the libraries' expected warnings (vitmm/console.py)
    options = dict(num_heads=args.num_heads, global_pool=args.global_pool, act=args.act, norm_eps=args.norm_eps,
                   head_width=args.head_width, text_heads=args.text_heads,
                   quick_gelu=None if args.quick_gelu is None else args.quick_gelu == "true")
    try:
        if not pathlib.Path(args.src).expanduser().exists():  # before any format's own reading of it
            raise FileNotFoundError(f"--src {args.src} does not exist (vitmm only reads local files; nothing is "
                                    "downloaded).")
        if args.source == "gguf" and not pathlib.Path(args.src).expanduser().is_file():
            raise ValueError(f"--src {args.src} is a folder; --from gguf reads one .gguf file.")
        out = convert(args.source, args.src, args.out, tower=args.tower, image_size=args.image_size, **options)
    except (ValueError, FileNotFoundError, FileExistsError) as e:  # bad input: one message, exit 2
        if os.environ.get("VITMM_DEBUG", "") not in ("", "0"):
            raise
        looks = guess_source(args.src)
        hint = f" (--src looks like a --from {looks} checkpoint: rerun with --from {looks}.)" if looks not in (
            None, args.source) else ""
        print(f"python -m vitmm.interop: {e}{hint}", file=sys.stderr)
        sys.exit(2)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
