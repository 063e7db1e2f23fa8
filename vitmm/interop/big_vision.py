"""big_vision ``.npz`` checkpoints → vitmm ``ViT`` and ``TwoTowers`` (SigLIP, LiT).

    kwargs, params = big_vision.load_vit("vit_s16_i1k.npz")
    logits, out = ViT(**kwargs).apply({"params": params}, images_nhwc)

    kwargs, params = big_vision.load_two_towers("webli_en_b16_224_63724782.npz")   # SigLIP
    zimg, ztxt, out = TwoTowers(**kwargs).apply({"params": params}, images_nhwc, ids)

An ``.npz`` holds the flattened Flax tree, keys joined by ``/``, optionally under ``params/``
(big_vision's own checkpoints) or ``opt/target/`` (google-research/vision_transformer's); other
top-level entries (optimizer state, step) are ignored. Everything the model needs is in the
shapes: Flax keeps attention kernels as ``[D, heads, head_dim]``, so unlike a PyTorch state dict
the head count is read, not guessed. Checked to 1e-4 in ``tests/interop`` against timm's own
big_vision reader and against transformers' SigLIP on the same weights.

Layouts read:

* big_vision ``vit.py``: ``embedding`` (conv kernel ``[ph, pw, C, D]``, vitmm's own layout),
  ``pos_embedding`` ``[1, h·w, D]`` on the patches only (CLS gets no position, vitmm's default
  ``posemb_layout="patches"``; no table = fixed 2D sin-cos), ``cls`` (only with ``tok``
  pooling), ``Transformer/encoderblock_{i}/{LayerNorm_0, MultiHeadDotProductAttention_0,
  LayerNorm_1, MlpBlock_0}``, or one stacked ``Transformer/encoderblock`` when trained with
  ``scan=True``, ``Transformer/encoder_norm``, ``MAPHead_0`` (→ ``pool="map"``) and ``head``
  (→ ``num_classes``). Pooling: ``MAPHead_0`` → map, a CLS token → tok, else gap (mean of all
  tokens, which in big_vision never include CLS).
* google-research/vision_transformer (AugReg): ``Transformer/posembed_input/pos_embedding``
  with a CLS row (→ ``posemb_layout="with_cls"``) and blocks ``LayerNorm_0,
  MultiHeadDotProductAttention_1, LayerNorm_2, MlpBlock_3``.
* big_vision ``two_towers.py``: ``img/`` (a ViT as above), ``txt/`` (``Embed_0``,
  ``pos_embedding``, ``Encoder_0/...``, optional ``head``), ``t`` (log temperature) and ``b``
  (SigLIP's logit bias). The text tower is bidirectional and pools the last token (big_vision's
  default ``pool_type="last"``; SigLIP pads with EOS). An image ``head`` becomes the ViT's
  ``num_classes`` head and the text ``head`` vitmm's ``txt_proj`` with bias.

Not in the shapes, so arguments: ``act`` (default ``gelu_tanh``: Flax's ``nn.gelu`` is the tanh
approximation, which big_vision and vision_transformer both use) and ``norm_eps`` (Flax's 1e-6).
Refused with the reason: a ``pre_logits`` representation layer (Dense + tanh, some ImageNet-21k
AugReg models) which vitmm's ViT does not have.
"""

from __future__ import annotations

import pathlib
import re

import jax.numpy as jnp
import numpy as np

from vitmm.interop import io
from vitmm.interop.common import StateDict, finish, grid_table, pick_tower, resize, vision_only
from vitmm.models.patch_embed import to_pair

TOP = ("params/", "opt/target/")
# (attention, second norm, MLP) names inside an encoder block.
BLOCK_NAMES = {"big_vision": ("MultiHeadDotProductAttention_0", "LayerNorm_1", "MlpBlock_0"),
               "vision_transformer": ("MultiHeadDotProductAttention_1", "LayerNorm_2", "MlpBlock_3")}


def _top(names) -> str:
    """The prefix the model's tensors sit under: ``params/``, ``opt/target/`` or none."""
    return next((top for top in TOP if any(k.startswith(top) for k in names)), "")


def _npz(src: str | pathlib.Path) -> pathlib.Path:
    path = io.weights_path(src)
    if path.suffix != ".npz":
        raise ValueError(f"{path} is not an .npz file; big_vision and vision_transformer save .npz checkpoints.")
    return path


def read(src: str | pathlib.Path) -> dict[str, np.ndarray]:
    """The model's tensors of a big_vision ``.npz``, with ``params/`` or ``opt/target/`` removed."""
    tensors = io.read_tensors(_npz(src))
    top = _top(tensors)
    return {k[len(top):]: v for k, v in tensors.items() if k.startswith(top)}


def is_two_towers(src: str | pathlib.Path) -> bool:
    """Whether the file holds ``img/``/``txt/`` towers (reads the names only, not the arrays)."""
    with np.load(_npz(src), allow_pickle=False) as data:
        names = data.files
    top = _top(names)
    return any(k.startswith((top + "img/", top + "txt/")) for k in names)


def _has_towers(tensors: dict) -> bool:
    return any(k.startswith(("img/", "txt/")) for k in tensors)


class _Tower:
    """A subtree (``img/``, ``txt/`` or the root) of a checkpoint's tensors."""

    def __init__(self, sd: StateDict, root: str):
        self.sd, self.root = sd, root

    def key(self, name: str) -> str:
        return self.root + name

    def has(self, name: str) -> bool:
        return self.sd.has(self.key(name))

    def shape(self, name: str) -> tuple:
        return self.sd.tensors[self.key(name)].shape

    def take(self, name: str) -> np.ndarray:
        return self.sd.take(self.key(name))

    def dense(self, name: str) -> dict:
        return {"kernel": self.take(f"{name}/kernel"), "bias": self.take(f"{name}/bias")}

    def norm(self, name: str) -> dict:
        return {"scale": self.take(f"{name}/scale"), "bias": self.take(f"{name}/bias")}


class _Encoder:
    """``encoderblock_{i}`` or one stacked ``encoderblock`` (``scan=True``) under ``root``."""

    def __init__(self, tower: _Tower, root: str):
        self.tower, self.root = tower, root
        self.scanned = tower.has(f"{root}/encoderblock/LayerNorm_0/scale")
        if self.scanned:
            self.depth = tower.shape(f"{root}/encoderblock/LayerNorm_0/scale")[0]
        else:
            pattern = re.compile(re.escape(tower.key(root)) + r"/encoderblock_(\d+)/")
            found = {int(m.group(1)) for k in tower.sd.tensors if (m := pattern.match(k))}
            if not found:
                raise ValueError(f"{tower.sd.source}: no encoder blocks under {tower.key(root)}/encoderblock_N/ "
                                 f"or a stacked {tower.key(root)}/encoderblock/.")
            self.depth = max(found) + 1
        first = f"{root}/encoderblock{'' if self.scanned else '_0'}"
        self.layout = ("vision_transformer" if tower.has(f"{first}/MultiHeadDotProductAttention_1/query/kernel")
                       else "big_vision")
        attn = f"{first}/{BLOCK_NAMES[self.layout][0]}/query/kernel"
        mlp = f"{first}/{BLOCK_NAMES[self.layout][2]}/Dense_0/kernel"
        if not (tower.has(attn) and tower.has(mlp)):
            raise ValueError(f"{tower.sd.source}: an encoder block without {tower.key(attn)} / {tower.key(mlp)}; "
                             "not a big_vision or vision_transformer layout.")
        self.width, self.num_heads = tower.shape(attn)[-3:-1]
        self.mlp_dim = tower.shape(mlp)[-1]

    def _get(self, i: int, name: str) -> np.ndarray:
        if self.scanned:
            x = self.tower.take(f"{self.root}/encoderblock/{name}")
            return x[i] if x.size else x  # an empty array marks a missing key, reported by finish()
        return self.tower.take(f"{self.root}/encoderblock_{i}/{name}")

    def _dense(self, i: int, name: str) -> dict:
        return {"kernel": self._get(i, f"{name}/kernel"), "bias": self._get(i, f"{name}/bias")}

    def _norm(self, i: int, name: str) -> dict:
        return {"scale": self._get(i, f"{name}/scale"), "bias": self._get(i, f"{name}/bias")}

    def params(self) -> dict:
        attn, norm2, mlp = BLOCK_NAMES[self.layout]
        enc = {}
        for i in range(self.depth):
            q, k, v, o = (self._dense(i, f"{attn}/{n}") for n in ("query", "key", "value", "out"))
            enc[f"block_{i:02d}"] = {
                "norm1": self._norm(i, "LayerNorm_0"),
                "attn": {"qkv": _fuse(q, k, v), "out": _out(o)},
                "norm2": self._norm(i, norm2),
                "mlp": {"fc1": self._dense(i, f"{mlp}/Dense_0"), "fc2": self._dense(i, f"{mlp}/Dense_1")},
            }
        enc["encoder_norm"] = self.tower.norm(f"{self.root}/encoder_norm")
        return enc


def _fuse(*projections: dict) -> dict:
    """Flax ``[D, heads, head_dim]`` query/key/value kernels → one ``[D, n·heads·head_dim]``."""
    return {"kernel": np.concatenate([p["kernel"].reshape(p["kernel"].shape[0], -1) for p in projections], axis=1),
            "bias": np.concatenate([p["bias"].reshape(-1) for p in projections])}


def _out(p: dict) -> dict:
    """Flax ``[heads, head_dim, D]`` output kernel → ``[heads·head_dim, D]``."""
    return {"kernel": p["kernel"].reshape(-1, p["kernel"].shape[-1]), "bias": p["bias"]}


def _map_head(t: _Tower, num_heads: int) -> dict:
    heads = t.shape("MAPHead_0/MultiHeadDotProductAttention_0/query/kernel")[1]
    if heads != num_heads:
        raise ValueError(f"The MAP head has {heads} heads, the encoder {num_heads}; vitmm's MAPHead uses the "
                         "encoder's count.")
    attn = {n: t.dense(f"MAPHead_0/MultiHeadDotProductAttention_0/{n}") for n in ("query", "key", "value", "out")}
    return {"probe": t.take("MAPHead_0/probe"),
            "attn": {"q": _fuse(attn["query"]), "kv": _fuse(attn["key"], attn["value"]), "out": _out(attn["out"])},
            "norm": t.norm("MAPHead_0/LayerNorm_0"),
            "mlp": {"fc1": t.dense("MAPHead_0/MlpBlock_0/Dense_0"), "fc2": t.dense("MAPHead_0/MlpBlock_0/Dense_1")}}


def _vit(t: _Tower, act: str, norm_eps: float, pool: str | None) -> tuple[dict, dict, int | None]:
    """``(ViT kwargs, params, side of the position grid or None)`` of an image tower."""
    if not t.has("embedding/kernel"):
        raise ValueError(f"{t.sd.source}: no {t.key('embedding/kernel')}; not a big_vision ViT.")
    if t.has("pre_logits/kernel"):
        raise ValueError(f"{t.sd.source} has a pre_logits representation layer (Dense + tanh before the head); "
                         "vitmm's ViT has none, so its logits would differ. Not supported.")
    enc = _Encoder(t, "Transformer")
    ph, pw, channels, width = t.shape("embedding/kernel")
    has_cls = t.has("cls")
    kwargs = dict(width=width, depth=enc.depth, mlp_dim=enc.mlp_dim, num_heads=enc.num_heads,
                  patch_size=ph if ph == pw else (ph, pw), class_token=has_cls, posemb="learn",
                  posemb_layout="patches", posemb_resample="big_vision", act=act, norm_eps=norm_eps,
                  pool=pool or ("map" if t.has("MAPHead_0/probe") else "tok" if has_cls else "gap"))
    params = {"embedding": {"kernel": t.take("embedding/kernel"), "bias": t.take("embedding/bias")},
              "encoder": enc.params()}
    side = None
    legacy_pos = "Transformer/posembed_input/pos_embedding"
    if t.has("pos_embedding") or t.has(legacy_pos):
        pos = t.take("pos_embedding" if t.has("pos_embedding") else legacy_pos)
        pos = pos.reshape(-1, width)
        square = lambda n: round(n ** 0.5) ** 2 == n  # noqa: E731
        if has_cls and not square(pos.shape[0]) and square(pos.shape[0] - 1):  # the CLS position comes first
            kwargs["posemb_layout"] = "with_cls"
            params["cls_pos_embedding"], pos = pos[None, :1], pos[1:]
        params["pos_embedding"] = grid_table(pos, t.key("pos_embedding"))
        side = params["pos_embedding"].shape[1]
    else:
        kwargs["posemb"] = "sincos2d"  # big_vision's fixed table, same convention as vitmm's default
    if has_cls:
        params["cls"] = t.take("cls").reshape(1, 1, width)
    if kwargs["pool"] == "map":
        params["map_head"] = _map_head(t, enc.num_heads)
    if t.has("head/kernel"):
        kwargs["num_classes"] = t.shape("head/kernel")[-1]
        params["head"] = t.dense("head")
    return kwargs, params, side


def _example(kwargs: dict, side: int | None, channels: int, image_size: int | tuple[int, int] | None) -> jnp.ndarray:
    ph, pw = (kwargs["patch_size"],) * 2 if isinstance(kwargs["patch_size"], int) else kwargs["patch_size"]
    if side is None:  # sin-cos positions work at any size
        h, w = to_pair(image_size or 224, "image_size")
        return jnp.zeros((1, h // ph * ph, w // pw * pw, channels))
    return jnp.zeros((1, side * ph, side * pw, channels))


def load_vit(src: str | pathlib.Path, act: str = "gelu_tanh", norm_eps: float = 1e-6, pool: str | None = None,
             image_size: int | tuple[int, int] | None = None) -> tuple[dict, dict]:
    """``(ViT kwargs, params)`` of a big_vision or vision_transformer ViT ``.npz`` (or the image
    tower of a two-tower one). ``pool`` (vitmm's ``tok | gap | map | none``) overrides the pooling
    read from the tensors, e.g. ``"none"`` for a backbone whose pooled output is not wanted."""
    from vitmm.models.vit import ViT

    tensors = read(src)
    if _has_towers(tensors):
        tensors = {k[len("img/"):]: v for k, v in tensors.items() if k.startswith("img/")}
    sd = StateDict(tensors, str(src))
    kwargs, params, side = _vit(_Tower(sd, ""), act, norm_eps, pool)
    example = _example(kwargs, side, tensors["embedding/kernel"].shape[2], image_size)
    params = finish(sd, ViT(**kwargs), params, (example,), "a vitmm ViT (big_vision)")
    if image_size is not None and side is not None:
        params = resize(params, kwargs, image_size)
    return kwargs, params


def load_two_towers(src: str | pathlib.Path, act: str = "gelu_tanh", norm_eps: float = 1e-6,
                    image_size: int | tuple[int, int] | None = None) -> tuple[dict, dict]:
    """``(TwoTowers kwargs, params)`` of a big_vision two-tower ``.npz`` (SigLIP, LiT)."""
    from vitmm.models.two_towers import TwoTowers

    tensors = read(src)
    if not _has_towers(tensors):
        raise ValueError(f"{src} has no img/ and txt/ towers; use load_vit for a single ViT.")
    sd = StateDict(tensors, str(src))
    image, img, side = _vit(_Tower(sd, "img/"), act, norm_eps, None)
    txt = _Tower(sd, "txt/")
    if not txt.has("Embed_0/embedding"):
        raise ValueError(f"{src}: no txt/Embed_0/embedding; the text tower is missing or not big_vision's.")
    enc = _Encoder(txt, "Encoder_0")
    vocab, width = txt.shape("Embed_0/embedding")
    max_len = txt.shape("pos_embedding")[-2]
    text = dict(vocab_size=vocab, width=width, depth=enc.depth, mlp_dim=enc.mlp_dim, num_heads=enc.num_heads,
                max_len=max_len, causal=False, pool="last", act=act, norm_eps=norm_eps)
    params = {"img": img,
              "txt": {"token_embedding": {"embedding": txt.take("Embed_0/embedding")},
                      "pos_embedding": txt.take("pos_embedding").reshape(1, max_len, width),
                      "encoder": enc.params()},
              "t": sd.take("t").reshape(1)}
    embed_dim = None
    if txt.has("head/kernel"):
        embed_dim = txt.shape("head/kernel")[-1]
        params["txt_proj"] = txt.dense("head")
    kwargs = dict(image=image, text=text, embed_dim=embed_dim, image_proj=False, text_proj_bias=True)
    if sd.has("b"):
        params["b"] = sd.take("b").reshape(1)
        kwargs.update(temperature_init=10.0, bias_init=-10.0)  # SigLIP's; the values come from the file
    example = (_example(image, side, tensors["img/embedding/kernel"].shape[2], image_size),
               jnp.zeros((1, max_len), jnp.int32))
    params = finish(sd, TwoTowers(**kwargs), params, example, "a vitmm TwoTowers (big_vision)")
    if image_size is not None and side is not None:
        params = {**params, "img": resize(params["img"], image, image_size)}
    return kwargs, params


def load(src: str | pathlib.Path, *, tower: str = "both",
         image_size: int | tuple[int, int] | None = None) -> tuple[dict, dict]:
    """``(TwoTowers kwargs, params)`` of a big_vision ``.npz``: a ViT (its only tower) or two
    towers (both, or one by ``tower``)."""
    if not is_two_towers(src):
        return pick_tower(*vision_only(*load_vit(src, image_size=image_size)), tower, src)
    return pick_tower(*load_two_towers(src, image_size=image_size), tower, src)
