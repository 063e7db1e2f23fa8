"""Vision Transformer (pre-LN) with every option a field.

    model = ViT(variant="B/16", posemb="learn", pool="tok", num_registers=0)
    variables = model.init(jax.random.key(0), jnp.zeros((1, 224, 224, 3)))
    pooled, out = model.apply(variables, images)          # images: [B, H, W, C]

Token sequence entering the encoder: ``[cls | registers | patches]`` (``out["with_posemb"]``,
``[B, 1 + R + N, D]``). Positions are added to patch tokens before CLS and registers are
prepended (big_vision, timm ``no_embed_class``), or, with ``posemb_layout="with_cls"``, the
learned table also covers the CLS position (CLIP, timm default, DINOv2). Registers never get a
position and are dropped from ``encoded``/``pooled`` (Darcet et al. 2023); they stay readable in
``out["registers"]``.

``out`` holds ``stem`` ``[B, h, w, D]``, ``with_posemb``, ``encoder_input`` (after ``pre_norm``;
HF's ``hidden_states[0]``), ``block_00`` … (each ``[B, 1+R+N, D]``; ``block_k`` is HF's
``hidden_states[k + 1]``),
``encoded`` ``[B, 1+N, D]`` (after the final norm, CLS first when present), ``patch_tokens``
``[B, N, D]``, ``registers`` ``[B, R, D]`` when ``R > 0``, ``pooled``, and ``logits`` with a head.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from vitmm.models import common, layers, packing, vit_options
from vitmm.models import posemb as pe
from vitmm.models.patch_embed import ConvStem, PatchEmbed, check_images, fitted_size, grid_size, to_pair
from vitmm.models.transformer import REMAT_NONE, Encoder, MAPHead

# Width, depth, MLP width, heads. Reference: Zhai et al. 2021 ("Scaling Vision Transformers"),
# Table 2, as in big_vision's ``decode_variant``.
VARIANTS: dict[str, tuple[int, int, int, int]] = {
    "mu": (32, 1, 128, 2),
    "Ti": (192, 12, 768, 3),
    "S": (384, 12, 1536, 6),
    "M": (512, 12, 2048, 8),
    "B": (768, 12, 3072, 12),
    "L": (1024, 24, 4096, 16),
    "So400m": (1152, 27, 4304, 16),
    "H": (1280, 32, 5120, 16),
    "g": (1408, 40, 6144, 16),
    "G": (1664, 48, 8192, 16),
}


@dataclasses.dataclass(frozen=True)
class Arch:
    width: int
    depth: int
    mlp_dim: int
    num_heads: int
    patch_size: tuple[int, int]


def decode_variant(variant: str) -> Arch:
    """``"B/16"`` → ``Arch(768, 12, 3072, 12, (16, 16))``; ``"B/16x8"`` gives a non-square patch."""
    match = re.fullmatch(r"([A-Za-z0-9]+)/(\d+)(?:x(\d+))?", variant)
    if not match or match.group(1) not in VARIANTS:
        raise ValueError(
            f"Unknown ViT variant {variant!r}; expected NAME/PATCH (e.g. 'B/16', 'L/14', 'S/16x8') "
            f"with NAME in {tuple(VARIANTS)}."
        )
    name, ph, pw = match.group(1), int(match.group(2)), match.group(3)
    return Arch(*VARIANTS[name], patch_size=(ph, int(pw) if pw else ph))


class ViT(nn.Module):
    """Vision Transformer. Explicit ``width``/``depth``/``mlp_dim``/``num_heads``/``patch_size``
    override the values that ``variant`` gives; without a variant all five are required.

    Front end: ``stem`` ``"patch"`` (linear patch embedding, ``embed_impl`` ``"conv"`` or its
    equal ``"unfold"``; ``stride``/``padding`` for overlapping patches) or ``"conv"``
    (progressive conv stem with ``stem_channels``); ``stem_norm`` adds a LayerNorm after it;
    ``embed_bias=False`` drops the patch projection's bias (OpenAI CLIP; with the conv stem, its
    1×1 projection's);
    ``size_policy`` ``"strict"`` (raise on images the patches do not tile) or ``"pad"``.

    Positions: ``posemb`` in ``learn | sincos2d | rope2d | none``; ``posemb_layout`` in
    ``patches | with_cls``; ``sincos_convention`` ``big_vision | mae``; ``rope_theta``;
    ``dynamic_img_size`` resamples a learned table on the fly when the image gives a different
    grid than the table was made for (otherwise that is an error; see ``resize_posemb`` to
    resample parameters once when loading at a new resolution); ``posemb_resample`` is how
    (``posemb.RESAMPLE_METHODS``: converters set their source's, vitmm's own default is ``"bicubic_aa"``);
    ``posemb_grid`` is the learned table's grid (None: that of the images the model is
    initialised with; initialising from a packed batch needs it).

    ``patch_keep < 1`` (FLIP, Li et al. 2023): in training, each image keeps a random
    ``round(patch_keep · N)`` of its N patch tokens (positions already added; in raster order),
    drawn from the ``dropout`` RNG; evaluation sees every patch. (Packed rows drop patches before
    packing instead, in ``data.packing.packed_iterator``, so a row holds more images.)

    Packed input (``models.packing.Packed``, NaViT): images of their own sizes in fixed-length
    rows; attention stays within each image, positions are each image's own (a learned table
    resampled to every image's grid, as ``dynamic_img_size`` would), pooling is per image:
    ``pooled`` is ``[B, K, D]`` (K image slots per row), ``out["encoded"]`` the whole rows
    ``[B, L, D]``. Each image gets its unpacked forward's numbers (tested). Needs the
    non-overlapping patch stem.

    Tokens and pooling: ``class_token``; ``num_registers``; ``pool`` in ``tok | gap | map | none``
    (``gap`` and ``map`` use the patch tokens only); ``pre_norm`` is CLIP's LayerNorm on the
    whole sequence before the encoder; ``fc_norm`` moves the final LayerNorm from the tokens to
    the pooled vector (timm's ``fc_norm``, MAE fine-tuning; ``encoded``/``patch_tokens`` are then
    the last block's raw outputs); ``final_norm=False`` has no final LayerNorm at all (Qwen2-VL's
    ViT, whose patch merger normalises); ``num_classes > 0`` adds a (zero-initialised) linear head.

    Encoder: ``dropout``, ``drop_path_rate``, ``layerscale``, ``qk_norm``, ``act``, ``norm_eps``,
    ``scan``, ``remat_policy``, ``dtype_mm`` (compute dtype; parameters stay float32),
    ``dtype_residual`` (dtype of the residual stream between blocks; None: float32, whatever
    ``posemb``: the stem's output is cast to float32 before positions are added).
    """

    variant: str | None = None
    width: int | None = None
    depth: int | None = None
    mlp_dim: int | None = None
    num_heads: int | None = None
    patch_size: int | Sequence[int] | None = None
    # Front end.
    stem: str = "patch"
    stem_channels: Sequence[int] | None = None
    embed_impl: str = "conv"
    stride: int | Sequence[int] | None = None
    padding: int | Sequence[int] = 0
    size_policy: str = "strict"
    stem_norm: bool = False
    embed_bias: bool = True
    # Positions.
    posemb: str = "learn"
    posemb_layout: str = "patches"
    sincos_convention: str = "big_vision"
    rope_theta: float = 100.0
    dynamic_img_size: bool = False
    posemb_resample: str = "bicubic_aa"
    posemb_grid: Sequence[int] | None = None
    patch_keep: float = 1.0
    # Tokens and pooling.
    class_token: bool = True
    num_registers: int = 0
    pool: str = "tok"
    pre_norm: bool = False
    fc_norm: bool = False
    final_norm: bool = True
    num_classes: int = 0
    # Encoder.
    dropout: float = 0.0
    drop_path_rate: float = 0.0
    layerscale: float | None = None
    qk_norm: bool = False
    act: str = "gelu"
    norm_eps: float = 1e-6
    scan: bool = False
    remat_policy: str = REMAT_NONE
    dtype_mm: str = "float32"
    dtype_residual: str | None = None
    attn_impl: str | None = None

    # ------------------------------------------------------------------------------------------
    def arch(self) -> Arch:
        """The resolved architecture (variant plus explicit overrides)."""
        base = decode_variant(self.variant) if self.variant else None
        values = {}
        for field in ("width", "depth", "mlp_dim", "num_heads", "patch_size"):
            value = getattr(self, field)
            if value is None:
                if base is None:
                    raise ValueError(f"ViT needs a variant (e.g. 'B/16') or an explicit {field}.")
                value = getattr(base, field)
            values[field] = to_pair(value, "patch_size") if field == "patch_size" else value
        return Arch(**values)

    def grid(self, image_hw: Sequence[int]) -> tuple[int, int]:
        """Token grid ``(h, w)`` this model makes from an ``(H, W)`` image (raises if it cannot)."""
        arch = self.arch()
        patch = arch.patch_size
        stride, padding = (patch, (0, 0)) if self.stem == "conv" else \
            (to_pair(self.stride or patch, "stride"), to_pair(self.padding, "padding"))
        if self.size_policy == "pad":  # as the stem pads the bottom/right edge
            image_hw = fitted_size(image_hw, patch, stride, padding)
        return grid_size(image_hw, patch, stride, padding)

    @property
    def num_prefix_tokens(self) -> int:
        return int(self.class_token) + self.num_registers

    # ------------------------------------------------------------------------------------------
    def _stem(self, images: jnp.ndarray, arch: Arch) -> jnp.ndarray:
        if self.stem == "conv":
            return ConvStem(arch.width, arch.patch_size, self.stem_channels, self.size_policy,
                            self.dtype_mm, self.embed_bias, name="embedding")(images)
        return PatchEmbed(arch.width, arch.patch_size, self.stride, self.padding, self.embed_impl,
                          self.size_policy, self.dtype_mm, self.embed_bias, name="embedding")(images)

    def _learned_table(self, grid: tuple[int, int] | None, width: int) -> jnp.ndarray:
        """The learned ``[1, h, w, D]`` table, resampled to ``grid`` when allowed (None: as stored)."""
        shape = (1, *(self.posemb_grid or grid or ()), width)
        if self.has_variable("params", "pos_embedding"):
            shape = self.get_variable("params", "pos_embedding").shape
        elif len(shape) != 4:
            raise ValueError("Initialising a learned position table from a packed batch needs its grid: "
                             "set posemb_grid=(h, w) or initialise with an image batch.")
        table = self.param("pos_embedding", common.trunc_normal(0.02), shape, jnp.float32)
        if grid is not None and table.shape[1:3] != grid:
            if not self.dynamic_img_size:
                raise ValueError(
                    f"The learned position table is for a {table.shape[1]}x{table.shape[2]} grid "
                    f"but this image gives {grid[0]}x{grid[1]} patches. Resample the parameters "
                    "once with vitmm.models.vit_tools.resize_posemb(params, new_grid, "
                    f"method={self.posemb_resample!r}) or build the model with dynamic_img_size=True."
                )
            table = pe.resample_grid(table, grid, self.posemb_resample)
        return table

    def _cls(self, d: int):
        """The CLS parameter (made before the position table: the parameters' RNG follows their order)."""
        return self.param("cls", common.trunc_normal(0.02), (1, 1, d), jnp.float32) if self.class_token else None

    def _prefix(self, cls, d: int) -> list[jnp.ndarray]:
        """``[1, 1, D]`` CLS (with its position under ``with_cls``) and ``[1, R, D]`` registers."""
        prefix = []
        if cls is not None:
            if self.posemb == "learn" and self.posemb_layout == "with_cls":
                cls = cls + self.param("cls_pos_embedding", common.trunc_normal(0.02), (1, 1, d))
            prefix.append(cls)
        if self.num_registers:
            prefix.append(self.param("registers", common.trunc_normal(0.02), (1, self.num_registers, d)))
        return prefix

    def _encode(self, x, arch: Arch, out: dict, train: bool, rope=None, mask=None):
        out["with_posemb"] = x
        if self.pre_norm:
            x = nn.LayerNorm(epsilon=self.norm_eps, name="pre_norm")(x)
        out["encoder_input"] = x
        x, blocks = Encoder(
            depth=arch.depth, num_heads=arch.num_heads, mlp_dim=arch.mlp_dim, dropout=self.dropout,
            drop_path_rate=self.drop_path_rate, layerscale=self.layerscale, qk_norm=self.qk_norm,
            act=self.act, norm_eps=self.norm_eps, scan=self.scan, remat_policy=self.remat_policy,
            dtype_mm=self.dtype_mm, attn_impl=self.attn_impl, final_norm=self.final_norm and not self.fc_norm,
            dtype_residual=self.dtype_residual, name="encoder",
        )(x, rope=rope, mask=mask, deterministic=not train)
        out.update(blocks)
        return x

    def _map_head(self, arch: Arch):
        return MAPHead(arch.num_heads, arch.mlp_dim, self.act, self.norm_eps, self.dtype_mm, self.attn_impl,
                       name="map_head")

    def _finish(self, pooled, out: dict):
        if self.fc_norm:
            pooled = nn.LayerNorm(epsilon=self.norm_eps, name="fc_norm")(pooled)
        out["pooled"] = pooled
        if self.num_classes:
            logits = layers.Dense(self.num_classes, kernel_init=nn.initializers.zeros, name="head")(pooled)
            out["logits"] = logits
            return logits, out
        return pooled, out

    @nn.compact
    def __call__(self, images, *, train: bool = False):
        arch = self.arch()
        vit_options.check(self, arch)
        if isinstance(images, packing.Packed):
            return self._packed(images, arch, train)
        check_images(images)
        out = {}
        x = self._stem(images, arch)
        b, h, w, d = x.shape
        if self.stem_norm:
            x = nn.LayerNorm(epsilon=self.norm_eps, name="stem_norm")(x)
        x = x.astype(jnp.float32)  # the stem computes in dtype_mm; the residual stream starts float32 whatever posemb
        out["stem"] = x
        x = x.reshape(b, h * w, d)

        cls, rope = self._cls(d), None
        if self.posemb == "learn":
            x = x + self._learned_table((h, w), d).reshape(1, h * w, d)
        elif self.posemb == "sincos2d":
            x = x + pe.sincos_2d(h, w, d, convention=self.sincos_convention)[None]
        elif self.posemb == "rope2d":
            rope = pe.rope_2d_angles(h, w, d // arch.num_heads, self.rope_theta, self.num_prefix_tokens)
        if train and self.patch_keep < 1:
            x, rope = self._drop_patches(x, rope)
        prefix = [jnp.broadcast_to(p, (b, *p.shape[1:])).astype(x.dtype) for p in self._prefix(cls, d)]
        x = self._encode(jnp.concatenate([*prefix, x], axis=1), arch, out, train, rope=rope)

        n_cls = int(self.class_token)
        patches = x[:, self.num_prefix_tokens:]
        if self.num_registers:
            out["registers"] = x[:, n_cls:self.num_prefix_tokens]
        out["patch_tokens"] = patches
        out["encoded"] = jnp.concatenate([x[:, :n_cls], patches], axis=1)

        if self.pool == "tok":
            pooled = x[:, 0]
        elif self.pool == "gap":
            pooled = patches.mean(axis=1)
        elif self.pool == "map":
            pooled = self._map_head(arch)(patches)
        else:
            pooled = out["encoded"]
        return self._finish(pooled, out)

    def _drop_patches(self, x, rope):
        """FLIP's masking: a random ``patch_keep`` share of each image's patches, in raster order."""
        b, n, _ = x.shape
        keep = max(1, round(self.patch_keep * n))
        noise = jax.random.uniform(self.make_rng("dropout"), (b, n))
        kept = jnp.sort(jnp.argsort(noise, axis=1)[:, :keep], axis=1)
        x = jnp.take_along_axis(x, kept[..., None], axis=1)
        if rope is not None:  # [prefix + N, hd/2] → each image's own [B, prefix + keep, hd/2]
            p = self.num_prefix_tokens
            patch_angles = jnp.take(rope[p:], kept, axis=0)
            rope = jnp.concatenate([jnp.broadcast_to(rope[None, :p], (b, p, rope.shape[-1])), patch_angles], axis=1)
        return x, rope

    def _packed(self, batch: packing.Packed, arch: Arch, train: bool):
        """The forward of a packed batch (see the class docstring)."""
        if self.stem != "patch" or to_pair(self.stride or arch.patch_size) != arch.patch_size or \
                to_pair(self.padding) != (0, 0):
            raise ValueError("Packed sequences need stem='patch' with stride equal to the patch and no padding.")
        seg, kinds = batch.segment_ids, batch.kinds
        b, length = seg.shape
        if not isinstance(kinds, jax.core.Tracer):  # concrete input: its prefix tokens must be this model's
            present = set(np.unique(np.asarray(kinds)[np.asarray(seg) > 0]).tolist()) - {packing.PATCH}
            expected = {packing.FIRST_REGISTER + r for r in range(self.num_registers)}
            expected |= {packing.CLS} if self.class_token else set()
            if not present <= expected:
                raise ValueError(f"The packed batch has token kinds {sorted(present)} but this model has "
                                 f"class_token={self.class_token}, num_registers={self.num_registers}; pack with "
                                 "class_token=model.class_token, num_registers=model.num_registers.")
        is_patch = (kinds == packing.PATCH) & (seg > 0)
        out = {}
        x = PatchEmbed(arch.width, arch.patch_size, impl="unfold", dtype_mm=self.dtype_mm,
                       use_bias=self.embed_bias, name="embedding")(batch.patches, flat=True)
        d = x.shape[-1]
        if self.stem_norm:
            x = nn.LayerNorm(epsilon=self.norm_eps, name="stem_norm")(x)
        x = x.astype(jnp.float32)  # as in __call__: a float32 stream whatever posemb
        out["stem"] = x
        where_patch = lambda v: jnp.where(is_patch[..., None], v, 0)  # noqa: E731
        grids = jnp.take_along_axis(batch.grids, jnp.maximum(seg - 1, 0)[..., None], axis=1)  # [B, L, 2]
        cls, rope = self._cls(d), None
        if self.posemb == "learn":
            table = self._learned_table(None, d)[0]
            x = x + where_patch(pe.resample_grid_at(table, grids, batch.positions, self.posemb_resample))
        elif self.posemb == "sincos2d":
            x = x + where_patch(pe.sincos_2d_at(batch.positions, d, length, convention=self.sincos_convention))
        elif self.posemb == "rope2d":
            rope = where_patch(pe.rope_2d_angles_at(batch.positions, d // arch.num_heads, length, self.rope_theta))
        prefix = self._prefix(cls, d)
        if prefix:  # row k of the table is the token of kind k (kind 0, a patch, never reads it)
            table = jnp.concatenate([jnp.zeros((1, 1, d)), *([] if self.class_token else [jnp.zeros((1, 1, d))]),
                                     *prefix], axis=1)[0]
            x = jnp.where(is_patch[..., None] | (seg[..., None] == 0), x, table[kinds].astype(x.dtype))
        mask = (seg[:, :, None] == seg[:, None, :])[:, None]  # block-diagonal: each image (and the padding) alone
        x = self._encode(x, arch, out, train, rope=rope, mask=mask)
        out["encoded"] = x
        out["patch_mask"] = is_patch

        members = seg[:, None, :] == jnp.arange(1, batch.max_images + 1)[None, :, None]  # [B, K, L]
        patch_of = members & is_patch[:, None]
        if self.pool == "tok":
            first = jnp.argmax(members & (kinds == packing.CLS)[:, None], axis=-1)  # [B, K]
            pooled = jnp.take_along_axis(x, first[..., None], axis=1)
        elif self.pool == "gap":
            sums = jnp.einsum("bkl,bld->bkd", patch_of.astype(x.dtype), x, precision=jax.lax.Precision.HIGHEST)
            pooled = sums / jnp.maximum(patch_of.sum(-1, keepdims=True), 1).astype(x.dtype)
        elif self.pool == "map":
            pooled = self._map_head(arch)(x, mask=patch_of[:, None], num_queries=batch.max_images)
        else:
            pooled = x
        return self._finish(pooled, out)
