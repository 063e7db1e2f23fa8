"""What the interop parity tests share: the fixture folder, the tolerance, reading a fixture's
inputs and reference outputs, and the SigLIP two-tower comparison (transformers' outputs, read
from the hf and the big_vision files alike)."""

import pathlib

import jax.numpy as jnp
import numpy as np

from vitmm.models.two_towers import TwoTowers

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures/interop"
ATOL = 1e-4  # max abs difference in float32


def load_io(name: str) -> dict:
    """A fixture's inputs and reference outputs."""
    return dict(np.load(FIXTURES / name / "io.npz"))


def images(ref: dict) -> jnp.ndarray:
    return jnp.asarray(ref["pixel_values"].transpose(0, 2, 3, 1))  # NCHW → NHWC


def check_siglip(kwargs: dict, params: dict, ref: dict):
    """A loaded SigLIP ``TwoTowers`` against transformers' outputs; returns ``(zimg, ztxt)``."""
    zimg, ztxt, out = TwoTowers(**kwargs).apply({"params": params}, images(ref),
                                                jnp.asarray(ref["input_ids"], jnp.int32))
    checks = {
        "vision_last_hidden_state": out["img/encoded"],  # SigLIP's is after post_layernorm
        "vision_pooler_output": out["img/pooled"],       # the MAP head
        "image_embeds": zimg,
        "text_last_hidden_state": out["txt/encoded"],
        "text_embeds": ztxt,
        "logits_per_image": out["t"] * zimg @ ztxt.T + out["b"],
    }
    for key, got in checks.items():
        np.testing.assert_allclose(np.asarray(got), ref[key], atol=ATOL, rtol=0, err_msg=key)
    return zimg, ztxt
