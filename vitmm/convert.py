"""Convert another codebase's checkpoint into a vitmm checkpoint folder.

    python -m vitmm.convert --from hf --src ~/models/clip-vit-base-patch16 --out workdirs/hf_clip_b16
    python -m vitmm.convert --from hf --src PATH --out DIR --tower vision --image_size 336
    python -m vitmm.convert --from hf --src PATH --out DIR --tower vision --image_size 336x448   # H x W
    python -m vitmm.convert --from hf --src ~/models/dinov2-small --out workdirs/dinov2_s --image_size 224
    python -m vitmm.convert --from timm --src vit_small_patch16_224/model.safetensors --out DIR --num_heads 6
    python -m vitmm.convert --from open_clip --src ViT-B-16-quickgelu/open_clip_model.safetensors --out DIR
    python -m vitmm.convert --from big_vision --src webli_en_b16_224_63724782.npz --out DIR   # SigLIP

``--from hf`` reads ``CLIPModel``/``CLIPVisionModel``/``CLIPTextModel`` (``--tower`` picks
both, vision or text), ``SiglipModel``/``SiglipVisionModel`` and ``ViTModel``/``Dinov2Model``/
``Dinov2WithRegistersModel`` folders (``config.json`` + ``model.safetensors`` or
``pytorch_model.bin``), by their ``model_type``. ``--from timm`` reads a ``VisionTransformer``
state dict (``--num_heads``, default width/64; ``--global_pool`` when a CLS model was trained with
``avg``); ``--from open_clip`` a ViT ``CLIP`` state dict (QuickGELU from ``open_clip_config.json``
beside it, or ``--quick_gelu true|false``); ``--from big_vision`` a big_vision ``.npz`` (a ViT, or
``img``/``txt`` two towers such as SigLIP; also vision_transformer's AugReg ViTs), every shape
read from the file (``--tower vision`` keeps the image tower of two). ``--image_size`` resamples
the learned position table the way the source does (``posemb_resample`` in the saved model config).

``DIR`` is laid out like a ``vitmm.train`` workdir (``checkpoints/0`` with ``params`` and a
``meta`` config), so ``--config.init.vision=DIR`` (a VLM's tower), ``--config.init.checkpoint=DIR``
and ``checkpoint.load_params(DIR)`` read it. Parameters sit under ``img``/``txt``/``img_proj``/
``txt_proj``/``t``/``b`` as in ``TwoTowers``; the model's keyword arguments are in the config
at ``model`` (``TwoTowers(**config["model"])``; ``model.image`` alone for a ViT).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

SOURCES = ("hf", "timm", "open_clip", "big_vision")
TOWERS = ("both", "vision", "text")


def _vision(kwargs: dict, img: dict) -> tuple[dict, dict]:
    """``(model config, params)`` of an image tower alone (a ``TwoTowers`` without text)."""
    return {"image": kwargs, "text": None, "embed_dim": None}, {"img": img}


def _text(kwargs: dict, txt: dict) -> tuple[dict, dict]:
    return {"image": None, "text": kwargs, "embed_dim": None}, {"txt": txt}


def _one_tower(model: dict, params: dict, tower: str) -> tuple[dict, dict]:
    """The ``vision`` or ``text`` half of a two-tower ``(model, params)``; ``both`` as is."""
    if tower == "vision":
        return _vision(model["image"], params["img"])
    if tower == "text":
        return _text(model["text"], params["txt"])
    return model, params


def _from_hf(src, tower, image_size) -> tuple[dict, dict]:
    from vitmm.interop import hf, io

    kind = io.read_json(src).get("model_type")
    if kind in hf.VIT_TYPES:  # a ViT / Dinov2 backbone: one tower
        if tower == "text":
            raise ValueError(f"{src} is a {kind} image backbone; it has no text tower.")
        kwargs, img = hf.load_vit(src, image_size=image_size)
        model, params = _vision(kwargs, img)
    elif kind in ("siglip", "siglip_vision_model"):
        if tower == "text":
            raise ValueError("A SigLIP text tower alone is not supported; convert both towers (--tower both).")
        if tower == "both" and kind == "siglip":
            kwargs, params = hf.load_siglip(src, image_size=image_size)
            model = dict(kwargs)
        else:
            kwargs, img = hf.load_siglip_vision(src, image_size=image_size)
            model, params = _vision(kwargs, img)
    elif tower == "both":
        kwargs, params = hf.load_clip(src, image_size=image_size)
        model = dict(kwargs)
    elif tower == "vision":
        kwargs, img = hf.load_clip_vision(src, image_size=image_size)
        model, params = _vision(kwargs, img)
    else:
        kwargs, txt = hf.load_clip_text(src)
        model, params = _text(kwargs, txt)
    return model, params


def _from_big_vision(src, tower, image_size) -> tuple[dict, dict]:
    from vitmm.interop import big_vision

    if not big_vision.is_two_towers(src):
        if tower == "text":
            raise ValueError(f"{src} is a big_vision ViT; it has no text tower.")
        return _vision(*big_vision.load_vit(src, image_size=image_size))
    model, params = big_vision.load_two_towers(src, image_size=image_size)
    return _one_tower(model, params, tower)


def convert(source: str, src: str, out: str, tower: str = "both", image_size: int | tuple[int, int] | None = None,
            num_heads: int | None = None, global_pool: str | None = None,
            quick_gelu: bool | None = None) -> pathlib.Path:
    from vitmm.checkpoint import Checkpointer
    from vitmm.interop import openclip, timm_vit
    from vitmm.models.patch_embed import to_pair

    if source not in SOURCES:
        raise ValueError(f"--from {source!r} is not supported yet; choose one of {SOURCES}.")
    if tower not in TOWERS:
        raise ValueError(f"--tower must be one of {TOWERS}, got {tower!r}.")
    out = pathlib.Path(out).expanduser().absolute()
    if (out / "checkpoints").is_dir() and any((out / "checkpoints").iterdir()):
        raise FileExistsError(f"{out} already holds a checkpoint; choose a new --out.")
    if source == "hf":
        model, params = _from_hf(src, tower, image_size)
    elif source == "timm":
        if tower == "text":
            raise ValueError(f"{src} is a timm image backbone; it has no text tower.")
        kwargs, img = timm_vit.load(src, num_heads=num_heads, global_pool=global_pool, image_size=image_size)
        model, params = _vision(kwargs, img)
    elif source == "open_clip":
        model, params = openclip.load(src, quick_gelu=quick_gelu, image_size=image_size)
        model, params = _one_tower(model, params, tower)
    else:
        model, params = _from_big_vision(src, tower, image_size)
    config = {"model": model, "source": {"from": source, "src": str(src), "tower": tower}}
    size = None
    if model["image"] is not None and "pos_embedding" in params["img"]:  # the resolution the table is for
        grid, patch = params["img"]["pos_embedding"].shape[1:3], to_pair(model["image"]["patch_size"])
        size = (int(grid[0] * patch[0]), int(grid[1] * patch[1]))
    elif model["image"] is not None and image_size is not None:  # fixed sin-cos positions fit any size
        size = to_pair(image_size)
    if size is not None:  # an int for a square image, else [height, width]
        config["input"] = {"image_size": size[0] if size[0] == size[1] else list(size)}
    checkpointer = Checkpointer(out, keep=1, async_save=False)
    checkpointer.save(0, {"params": params}, {}, {"step": 0, "config": json.dumps(config)})
    checkpointer.close()
    return out


def image_size_arg(text: str) -> int | tuple[int, int]:
    """``"336"`` → 336, ``"336x448"`` → ``(336, 448)`` (height × width)."""
    parts = text.lower().split("x")
    if len(parts) not in (1, 2) or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"--image_size {text!r}: give a positive size (336) or HxW (336x448).")
    return int(parts[0]) if len(parts) == 1 else (int(parts[0]), int(parts[1]))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m vitmm.convert", description=__doc__.splitlines()[0])
    parser.add_argument("--from", dest="source", required=True, choices=SOURCES)
    parser.add_argument("--src", required=True, help="checkpoint folder (config.json + weights) or weights file")
    parser.add_argument("--out", required=True, help="new vitmm checkpoint folder")
    parser.add_argument("--tower", default="both", choices=TOWERS)
    parser.add_argument("--image_size", type=image_size_arg, default=None,
                        help="resample positions to this resolution: 336, or HxW such as 336x448")
    parser.add_argument("--num_heads", type=int, default=None, help="timm: attention heads (default width // 64)")
    parser.add_argument("--global_pool", default=None, help="timm: token | avg | map | '' (default: from the tensors)")
    parser.add_argument("--quick_gelu", default=None, choices=("true", "false"),
                        help="open_clip: QuickGELU MLPs (default: open_clip_config.json beside the weights)")
    args = parser.parse_args(argv)
    quick_gelu = None if args.quick_gelu is None else args.quick_gelu == "true"
    try:
        out = convert(args.source, args.src, args.out, args.tower, args.image_size, args.num_heads, args.global_pool,
                      quick_gelu)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        sys.exit(f"vitmm.convert: {e}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
