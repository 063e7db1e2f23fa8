"""Patch embedding: images ``[B, H, W, C]`` to a grid of tokens ``[B, h, w, D]``.

Two implementations share one set of parameters (``kernel: [ph, pw, C, D]``, ``bias: [D]``):
  * ``"conv"``: a strided convolution (what every production ViT runs);
  * ``"unfold"``: cut the image into patches flattened in ``(row, col, channel)`` order, then one
    matmul. It is the definition the convolution must equal (tested to 1e-5 in float32).

Overlapping patches (``stride < patch``, with zero ``padding``) and non-square patches and images
are supported by both. ``ConvStem`` is the progressive alternative of Xiao et al. 2021
("Early convolutions help transformers see better").
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from vitmm.models import common

SIZE_POLICIES = ("strict", "pad")


def to_pair(value: int | Sequence[int], name: str = "value") -> tuple[int, int]:
    if isinstance(value, int):
        return (value, value)
    pair = tuple(int(v) for v in value)
    if len(pair) != 2:
        raise ValueError(f"{name} must be an int or a pair (h, w), got {value!r}.")
    return pair  # type: ignore[return-value]


def check_images(images: jnp.ndarray, in_channels: int | None = None) -> None:
    """Raises a ``ValueError`` for anything that is not a batch of channels-last images."""
    if images.ndim != 4:
        raise ValueError(
            f"Expected images of shape [B, H, W, C] (channels last), got shape {tuple(images.shape)} "
            f"(rank {images.ndim}). Add a batch axis with images[None] or move channels last."
        )
    if in_channels is not None and images.shape[-1] != in_channels:
        raise ValueError(
            f"Images have {images.shape[-1]} channels (shape {tuple(images.shape)}) but the patch "
            f"embedding was built for {in_channels}. Convert the images (e.g. grayscale→RGB) or "
            "initialise the model with images of the right channel count."
        )


def grid_size(
    image_hw: Sequence[int],
    patch_size: int | Sequence[int],
    stride: int | Sequence[int] | None = None,
    padding: int | Sequence[int] = 0,
) -> tuple[int, int]:
    """Token grid ``(h, w)`` for an image; raises if patches would not tile the image exactly.

    With ``stride == patch`` and no padding this is ``(H / ph, W / pw)``. Nothing is ever cropped:
    a size that does not fit raises a ``ValueError`` naming both sizes and the ways out.
    """
    ph, pw = to_pair(patch_size, "patch_size")
    sh, sw = to_pair(stride if stride is not None else (ph, pw), "stride")
    pad_h, pad_w = to_pair(padding, "padding")
    out = []
    axes = (("height", image_hw[0], ph, sh, pad_h), ("width", image_hw[1], pw, sw, pad_w))
    for axis, size, p, s, pad in axes:
        span = size + 2 * pad - p
        if span < 0 or span % s != 0:
            if s == p and pad == 0:
                detail = f"image {axis} {size} is not a multiple of the patch {axis} {p}"
                fix_size = -(-size // p) * p
            else:
                detail = (f"image {axis} {size} (+2×{pad} padding) minus patch {p} is not a multiple "
                          f"of stride {s}")
                fix_size = size + (-span) % s if span >= 0 else p - 2 * pad
            raise ValueError(
                f"Patch embedding cannot tile the image: {detail}. Resize the image to "
                f"{axis} {fix_size} (or another size that fits), or build the model with "
                "size_policy='pad' to zero-pad the bottom/right edge; pixels are never cropped "
                "silently."
            )
        out.append(span // s + 1)
    return out[0], out[1]


def fitted_size(
    image_hw: Sequence[int], patch_size: tuple[int, int], stride: tuple[int, int], padding: tuple[int, int]
) -> tuple[int, int]:
    """``(H, W)`` after ``pad_to_fit``: the smallest size at least ``image_hw`` that ``grid_size`` accepts."""
    out = []
    for size, p, s, pad in zip(image_hw, patch_size, stride, padding, strict=True):
        span = size + 2 * pad - p
        out.append(size + ((-span) % s if span >= 0 else p - 2 * pad - size))
    return out[0], out[1]


def pad_to_fit(
    images: jnp.ndarray, patch_size: tuple[int, int], stride: tuple[int, int], padding: tuple[int, int]
) -> jnp.ndarray:
    """Zero-pads the bottom/right edge so that ``grid_size`` accepts the image."""
    h, w = fitted_size(images.shape[1:3], patch_size, stride, padding)
    return jnp.pad(images, ((0, 0), (0, h - images.shape[1]), (0, w - images.shape[2]), (0, 0)))


def unfold_patches(
    images: jnp.ndarray,
    patch_size: int | Sequence[int],
    stride: int | Sequence[int] | None = None,
    padding: int | Sequence[int] = 0,
) -> jnp.ndarray:
    """Cuts ``images: [B, H, W, C]`` into patches ``[B, h, w, ph * pw * C]``.

    Patches are in raster order over the grid; each is flattened row by row, then column, then
    channel, i.e. the memory order of a ``[ph, pw, C]`` slice (the order of a conv kernel
    ``[ph, pw, C, D]``). For a single-channel 32×32 ``arange`` image and 4×4 patches the first
    patch is ``0, 1, 2, 3, 32, 33, 34, 35, 64, ...``.
    """
    check_images(images)
    ph, pw = to_pair(patch_size, "patch_size")
    sh, sw = to_pair(stride if stride is not None else (ph, pw), "stride")
    pad_h, pad_w = to_pair(padding, "padding")
    b, _, _, c = images.shape
    gh, gw = grid_size(images.shape[1:3], (ph, pw), (sh, sw), (pad_h, pad_w))
    if (sh, sw) == (ph, pw) and (pad_h, pad_w) == (0, 0):
        x = images.reshape(b, gh, ph, gw, pw, c)
        return x.transpose(0, 1, 3, 2, 4, 5).reshape(b, gh, gw, ph * pw * c)
    x = jnp.pad(images, ((0, 0), (pad_h, pad_h), (pad_w, pad_w), (0, 0)))
    # Overlapping patches: one strided slice per offset inside the patch.
    pieces = [
        x[:, i : i + sh * (gh - 1) + 1 : sh, j : j + sw * (gw - 1) + 1 : sw, :]
        for i in range(ph)
        for j in range(pw)
    ]
    return jnp.stack(pieces, axis=3).reshape(b, gh, gw, ph * pw * c)


class PatchEmbed(nn.Module):
    """Linear patch embedding ``[B, H, W, C] -> [B, h, w, width]``.

    Attributes:
      width: output channels D.
      patch_size: ``(ph, pw)`` or an int.
      stride: defaults to the patch size (non-overlapping); smaller means overlapping patches.
      padding: zero padding ``(pad_h, pad_w)`` on each side, for overlapping patches.
      impl: ``"conv"`` or ``"unfold"``; the same parameters give the same numbers.
      size_policy: ``"strict"`` raises on an image the patches do not tile; ``"pad"`` zero-pads
        the bottom/right edge up to the next size that fits.
      dtype_mm: compute dtype of the projection (parameters stay float32).
      use_bias: OpenAI CLIP's patch projection has none.
    """

    width: int
    patch_size: int | Sequence[int] = 16
    stride: int | Sequence[int] | None = None
    padding: int | Sequence[int] = 0
    impl: str = "conv"
    size_policy: str = "strict"
    dtype_mm: str | jnp.dtype = "float32"
    use_bias: bool = True

    @nn.compact
    def __call__(self, images: jnp.ndarray, *, flat: bool = False) -> jnp.ndarray:
        """``images [B, H, W, C]`` → ``[B, h, w, D]``; with ``flat``, patches already cut
        (``[..., ph·pw·C]`` in ``unfold_patches``' order, e.g. a packed sequence) → ``[..., D]``."""
        patch = to_pair(self.patch_size, "patch_size")
        stride = to_pair(self.stride if self.stride is not None else patch, "stride")
        padding = to_pair(self.padding, "padding")
        common.check_choice("impl", self.impl, ("conv", "unfold"))
        common.check_choice("size_policy", self.size_policy, SIZE_POLICIES)
        if flat:
            return self._project(images, patch)
        check_images(images)
        if self.size_policy == "pad":
            images = pad_to_fit(images, patch, stride, padding)
        grid_size(images.shape[1:3], patch, stride, padding)  # raises with a clear message
        if self.has_variable("params", "kernel"):
            check_images(images, self.get_variable("params", "kernel").shape[2])
        if self.impl == "unfold":
            return self._project(unfold_patches(images, patch, stride, padding), patch)
        channels = images.shape[-1]
        kernel = self.param(
            "kernel", common.trunc_normal(0.02), (*patch, channels, self.width), jnp.float32
        )
        dtype = jnp.dtype(self.dtype_mm)
        x = jax.lax.conv_general_dilated(
            images.astype(dtype),
            kernel.astype(dtype),
            window_strides=stride,
            padding=[(padding[0], padding[0]), (padding[1], padding[1])],
            dimension_numbers=("NHWC", "HWIO", "NHWC"),
        )
        if self.use_bias:
            x = x + self.param("bias", nn.initializers.zeros, (self.width,), jnp.float32).astype(dtype)
        return x

    def _project(self, patches: jnp.ndarray, patch: tuple[int, int]) -> jnp.ndarray:
        size = patches.shape[-1]
        if size % (patch[0] * patch[1]):
            raise ValueError(f"Flat patches of {size} values are not {patch[0]}x{patch[1]} patches of whole channels.")
        channels = size // (patch[0] * patch[1])
        if self.has_variable("params", "kernel") and self.get_variable("params", "kernel").shape[2] != channels:
            raise ValueError(f"Flat patches have {channels} channels but the patch embedding was built for "
                             f"{self.get_variable('params', 'kernel').shape[2]}.")
        kernel = self.param("kernel", common.trunc_normal(0.02), (*patch, channels, self.width), jnp.float32)
        dtype = jnp.dtype(self.dtype_mm)
        x = patches.astype(dtype) @ kernel.reshape(-1, self.width).astype(dtype)
        if self.use_bias:
            x = x + self.param("bias", nn.initializers.zeros, (self.width,), jnp.float32).astype(dtype)
        return x


class ConvStem(nn.Module):
    """Progressive convolutional stem: ``log2(p)`` stride-2 3×3 convs, then a 1×1 projection.

    Follows Xiao et al. 2021 with LayerNorm in place of BatchNorm, so that the stem carries no
    batch statistics and behaves the same in training, evaluation and across devices. The total
    stride equals the (square, power-of-two) patch size, so the token grid matches
    ``PatchEmbed``'s for the same patch size. ``use_bias=False`` drops the 1×1 projection's bias
    (as ``PatchEmbed``'s; the 3×3 convs keep theirs).
    """

    width: int
    patch_size: int | Sequence[int] = 16
    channels: Sequence[int] | None = None
    size_policy: str = "strict"
    dtype_mm: str | jnp.dtype = "float32"
    use_bias: bool = True

    @nn.compact
    def __call__(self, images: jnp.ndarray) -> jnp.ndarray:
        ph, pw = to_pair(self.patch_size, "patch_size")
        num_convs = ph.bit_length() - 1
        if ph != pw or ph != 2**num_convs or num_convs == 0:
            raise ValueError(
                f"ConvStem needs a square power-of-two patch size >= 2, got {(ph, pw)}; use "
                "stem='patch' for other patch shapes."
            )
        channels = tuple(self.channels) if self.channels else tuple(
            max(self.width // 2 ** (num_convs - i), 8) for i in range(num_convs)
        )
        if len(channels) != num_convs:
            raise ValueError(
                f"ConvStem for patch {ph} has {num_convs} stride-2 convs but got "
                f"{len(channels)} channel counts {channels}."
            )
        common.check_choice("size_policy", self.size_policy, SIZE_POLICIES)
        check_images(images)
        if self.size_policy == "pad":
            images = pad_to_fit(images, (ph, pw), (ph, pw), (0, 0))
        grid_size(images.shape[1:3], (ph, pw))
        built = self.variables.get("params", {}).get("conv_0")
        if built is not None:  # the friendly message, not flax's shape error from inside conv_0
            check_images(images, built["kernel"].shape[2])
        dtype = jnp.dtype(self.dtype_mm)
        x = images.astype(dtype)
        for i, ch in enumerate(channels):
            x = nn.Conv(ch, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)), dtype=dtype,
                        kernel_init=common.trunc_normal(0.02), name=f"conv_{i}")(x)
            x = nn.gelu(nn.LayerNorm(name=f"norm_{i}")(x))
        return nn.Conv(self.width, (1, 1), dtype=dtype, kernel_init=common.trunc_normal(0.02),
                       use_bias=self.use_bias, name="proj")(x)


def resize_kernel(kernel: jnp.ndarray, new_patch: int | Sequence[int], antialias: bool = False) -> jnp.ndarray:
    """FlexiViT's PI-resize (Beyer et al. 2023): a patch-embedding kernel ``[ph, pw, C, D]`` for
    patches of ``new_patch`` pixels.

    Resizing a patch (``jax.image.resize``, bilinear; without antialiasing, as big_vision's
    ``resample_patchemb`` calls ``tf.image.resize``, which matters when the patch shrinks) is
    linear, ``resize(x) = R x``; the new kernel
    ``ŵ = pinv(Rᵀ) w`` makes ``<resize(x), ŵ> = <x, w>``: a patch resized to the new size gives
    the token the old kernel gave the original patch. Exact when the patch grows (``Rᵀ`` has full
    row rank), the least-squares fit when it shrinks. The bias is unchanged.
    """
    import numpy as np

    ph, pw, c, d = kernel.shape
    nh, nw = to_pair(new_patch, "new_patch")
    basis = jnp.eye(ph * pw, dtype=jnp.float32).reshape(ph * pw, ph, pw)
    resized = jax.vmap(lambda e: jax.image.resize(e, (nh, nw), "bilinear", antialias=antialias))(basis)
    rt = np.asarray(resized, np.float64).reshape(ph * pw, nh * nw)  # row i: resize(e_i), i.e. Rᵀ
    w = np.asarray(kernel, np.float64).reshape(ph * pw, c * d)
    return jnp.asarray((np.linalg.pinv(rt) @ w).reshape(nh, nw, c, d), jnp.float32)
