"""Hugging Face transformers checkpoints → vitmm: CLIP and SigLIP (``clip.py``), ViT and DINOv2
backbones (``vit.py``), sharing one block mapping (``layers.py``); ``load`` reads any of them by
its ``model_type``; ``clip_export.py`` writes towers back.

    kwargs, params = hf.load_clip("path/to/clip")          # CLIPModel folder or file
    kwargs, params = hf.load_clip_vision("path/to/clip")   # a ViT (CLIPModel or CLIPVisionModel)
    kwargs, params = hf.load_vit("path/to/dinov2-small")   # a ViT
    tensors, config = hf.export_clip_vision(kwargs, params)  # back to CLIPVisionModel's layout
"""

from __future__ import annotations

import pathlib

from vitmm.interop import io
from vitmm.interop.common import pick_tower, text_only, vision_only
from vitmm.interop.hf.clip import (
    load_clip,
    load_clip_text,
    load_clip_vision,
    load_siglip,
    load_siglip_vision,
)
from vitmm.interop.hf.clip_export import export_clip_vision, export_siglip_vision
from vitmm.interop.hf.vit import VIT_TYPES, load_vit

__all__ = ["load", "load_clip", "load_clip_vision", "load_clip_text", "load_siglip", "load_siglip_vision",
           "load_vit", "export_clip_vision", "export_siglip_vision", "VIT_TYPES"]


def load(src: str | pathlib.Path, *, tower: str = "both",
         image_size: int | tuple[int, int] | None = None) -> tuple[dict, dict]:
    """``(TwoTowers kwargs, params)`` of any transformers folder vitmm reads, by its
    ``model_type``: CLIP (``tower`` both, vision or text), SigLIP (both or vision), ViT/DINOv2
    backbones (vision)."""
    kind = io.read_json(src).get("model_type")
    if kind in VIT_TYPES:  # an image backbone: one tower
        return pick_tower(*vision_only(*load_vit(src, image_size=image_size)), tower, src)
    if kind in ("siglip", "siglip_vision_model"):
        if tower == "text":
            raise ValueError("A SigLIP text tower alone is not supported; convert both towers (tower='both').")
        if tower == "both" and kind == "siglip":
            return load_siglip(src, image_size=image_size)
        return vision_only(*load_siglip_vision(src, image_size=image_size))
    if tower == "both":
        return load_clip(src, image_size=image_size)
    if tower == "vision":
        return vision_only(*load_clip_vision(src, image_size=image_size))
    return pick_tower(*text_only(*load_clip_text(src)), tower, src)
