"""CLIP/SigLIP two-tower model: a ViT image tower, a text tower, projections, temperature, bias.

    model = TwoTowers(image=dict(variant="B/16", pool="tok"), text=dict(vocab_size=259, ...),
                      embed_dim=512, temperature_init=1 / 0.07)             # CLIP
    zimg, ztxt, out = model.apply(variables, images, ids)

Both embeddings are L2-normalised. The temperature is a parameter stored as a log
(``params["t"] = log t``; CLIP init ``ln(1/0.07)``, SigLIP init ``ln 10``); ``out["t"]`` is
``exp``. SigLIP's bias ``b`` (init -10) exists when ``bias_init`` is set. Either input may be
``None`` (image-only evaluation); either tower config may be ``None`` (a one-tower model).
``out`` re-exports each tower's intermediates under ``img/`` and ``txt/``.

Projections: both towers get a bias-free linear map to ``embed_dim`` (CLIP). The original
SigLIP uses its MAP-pooled image output as the embedding (``image_proj=False``) and a text head
with a bias (``text_proj_bias=True``); ``embed_dim=None`` drops both projections.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax.numpy as jnp

from vitmm.models import common, layers
from vitmm.models.text import TextTransformer
from vitmm.models.vit import ViT

CLIP_TEMPERATURE_INIT = 1 / 0.07
MAX_TEMPERATURE = 100.0


def l2_normalize(x: jnp.ndarray, eps: float = 1e-8) -> jnp.ndarray:
    """``x / (|x| + eps)``; an all-zero vector (an empty slot of a packed batch) stays zero with a
    zero gradient, where the norm's own gradient would be 0/0."""
    zero = jnp.all(x == 0, axis=-1, keepdims=True)
    safe = jnp.where(zero, jnp.ones_like(x), x)
    return jnp.where(zero, jnp.zeros_like(x), safe / (jnp.linalg.norm(safe, axis=-1, keepdims=True) + eps))


class TwoTowers(nn.Module):
    image: dict | None = None
    text: dict | None = None
    embed_dim: int | None = 512
    image_proj: bool = True
    text_proj_bias: bool = False
    temperature_init: float = CLIP_TEMPERATURE_INIT
    bias_init: float | None = None

    @nn.compact
    def __call__(self, images: jnp.ndarray | None = None, texts: jnp.ndarray | None = None, *,
                 train: bool = False):
        out = {}
        zimg = ztxt = None
        if images is not None:
            if self.image is None:
                raise ValueError("This TwoTowers model has no image tower (image=None).")
            pooled, img_out = ViT(**self.image, name="img")(images, train=train)
            zimg = self._project(pooled, "img_proj") if self.image_proj else pooled
            out.update({f"img/{k}": v for k, v in img_out.items()})
            out["img/norm"] = jnp.linalg.norm(zimg, axis=-1)
            zimg = l2_normalize(zimg)
        if texts is not None:
            if self.text is None:
                raise ValueError("This TwoTowers model has no text tower (text=None).")
            pooled, txt_out = TextTransformer(**self.text, name="txt")(texts, train=train)
            ztxt = self._project(pooled, "txt_proj", bias=self.text_proj_bias)
            out.update({f"txt/{k}": v for k, v in txt_out.items()})
            out["txt/norm"] = jnp.linalg.norm(ztxt, axis=-1)
            ztxt = l2_normalize(ztxt)
        log_t = self.param("t", nn.initializers.constant(math.log(self.temperature_init)), (1,))
        out["t"] = jnp.exp(log_t[0])
        if self.bias_init is not None:
            out["b"] = self.param("b", nn.initializers.constant(self.bias_init), (1,))[0]
        return zimg, ztxt, out

    def _project(self, pooled: jnp.ndarray, name: str, bias: bool = False) -> jnp.ndarray:
        if not self.embed_dim:
            return pooled
        return layers.Dense(self.embed_dim, use_bias=bias, kernel_init=common.trunc_normal(0.02),
                            name=name)(pooled)


def clamp_temperature(params: dict, max_temperature: float = MAX_TEMPERATURE) -> dict:
    """Clips the stored ``log t`` to ``[0, ln(max_temperature)]`` (CLIP: at most 100; open_clip's
    ``logit_scale.clamp_(0, ln 100)`` also keeps it at least 1), after a step."""
    if "t" not in params:
        return params
    return {**params, "t": jnp.clip(params["t"], 0.0, math.log(max_temperature))}
