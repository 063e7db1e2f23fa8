"""Converted towers at a new, non-square resolution against their sources' own outputs there.

    python -m experiments.bench.resample_parity > results/interop/resample_parity.md

The interop fixtures' 4x4 position tables at 5x7 patches (40x56 px; 35x49 for DINOv2), resampled
on the fly (``dynamic_img_size``): max abs difference over the largest reference value, with each
source's resampling method (what the converters record) and with vitmm's default instead. Needs
only the committed fixtures.
"""

import json

import jax.numpy as jnp
import numpy as np

from tests.interop.parity import FIXTURES, images, load_io
from vitmm.interop import hf, openclip, timm_vit
from vitmm.models.two_towers import TwoTowers
from vitmm.models.vit import ViT

TIMM = ("timm_vit", "timm_vit_reg", "timm_vit_gap", "timm_vit_fc_norm", "timm_vit_map")


def rel(got, want) -> float:
    return float(np.abs(np.asarray(got) - want).max() / np.abs(want).max())


def tower(kwargs: dict, params: dict, ref: dict, method: str | None) -> tuple[str, dict]:
    """The tower applied at the fixture's second resolution; returns its method and ``out``."""
    kwargs = {**kwargs, "dynamic_img_size": True, **({"posemb_resample": method} if method else {})}
    _, out = ViT(**kwargs).apply({"params": params}, images(ref, "pixel_values_resized"))
    return kwargs["posemb_resample"], out


def sequence(out: dict, kwargs: dict) -> jnp.ndarray:
    """``[CLS?, registers, patches]`` as transformers and timm order them."""
    parts = [out["encoded"][:, :1]] if kwargs["class_token"] else []
    if kwargs["num_registers"]:
        parts.append(out["registers"])
    return jnp.concatenate([*parts, out["patch_tokens"]], axis=1)


def rows(method: str | None):
    ref = load_io("hf_clip")
    kwargs, params = hf.load_clip_vision(FIXTURES / "hf_clip")
    m, out = tower(kwargs, params, ref, method)
    yield "transformers CLIP", m, rel(out[f"block_{kwargs['depth'] - 1:02d}"], ref["vision_last_hidden_state_resized"])
    ref = load_io("hf_siglip")
    kwargs, params = hf.load_siglip_vision(FIXTURES / "hf_siglip")
    m, out = tower(kwargs, params, ref, method)
    yield "transformers SigLIP", m, rel(out["encoded"], ref["vision_last_hidden_state_resized"])
    for name in ("hf_vit", "hf_dinov2", "hf_dinov2_registers"):
        ref = load_io(name)
        kwargs, params = hf.load_vit(FIXTURES / name)
        m, out = tower(kwargs, params, ref, method)
        yield f"transformers {name[3:]}", m, rel(sequence(out, kwargs), ref["last_hidden_state_resized"])
    for name in TIMM:
        ref, build = load_io(name), json.loads((FIXTURES / name / "build.json").read_text())
        kwargs, params = timm_vit.load_vit(FIXTURES / name / "model.safetensors", num_heads=build["num_heads"],
                                           norm_eps=1e-6)  # bare VisionTransformers: LayerNorm's default eps
        m, out = tower(kwargs, params, ref, method)
        yield name, m, rel(sequence(out, kwargs), ref["features_resized"])
    ref = load_io("open_clip")
    kwargs, params = openclip.load_two_towers(FIXTURES / "open_clip" / "open_clip_model.safetensors")
    image = {**kwargs["image"], "dynamic_img_size": True, **({"posemb_resample": method} if method else {})}
    zimg, _, out = TwoTowers(**{**kwargs, "image": image}).apply({"params": params},
                                                                 images(ref, "pixel_values_resized"), None)
    yield "open_clip", image["posemb_resample"], rel(zimg * out["img/norm"][:, None], ref["image_proj_resized"])


def main():
    print("| source | resampling | max abs diff / max |")
    print("|---|---|---:|")
    for method in (None, "bicubic_aa"):
        for source, used, err in rows(method):
            print(f"| {source} | {used}{'' if method is None else ' (vitmm default)'} | {err:.1e} |")


if __name__ == "__main__":
    from vitmm import xla_flags

    # Before JAX opens a backend, as the committed table was made (with XLA:CPU's YNNPACK fusions, the
    # default without this, the same command gave up to 6.7e-7 here on 2026-12-07).
    xla_flags.use_vitmm_defaults()
    main()
