"""Position embeddings for 2D token grids: fixed sin-cos, learned-table resampling, axial 2D RoPE.

All grids are in raster order: token ``i`` of an ``(h, w)`` grid sits at row ``i // w`` and
column ``i % w``. Names follow the axis they encode (``rows``/``cols``), never the other one
(MAE's ``emb_h`` actually encodes columns; see mae#18).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

SINCOS_CONVENTIONS = ("big_vision", "mae")


def sincos_2d(
    grid_h: int,
    grid_w: int,
    dim: int,
    temperature: float = 10_000.0,
    *,
    convention: str = "big_vision",
) -> jnp.ndarray:
    """Fixed 2D sin-cos position table for an ``(grid_h, grid_w)`` grid: ``[grid_h * grid_w, dim]``.

    Half of the channels encode the column (x) and half the row (y); each half is
    ``[sin, cos]`` over ``dim // 4`` frequencies, so one row of the table is
    ``[sin(x·ω), cos(x·ω), sin(y·ω), cos(y·ω)]`` with ``ω_k = temperature ** -(k / denom)``.

    ``convention`` picks the frequency denominator, the only way the two common tables differ:
      * ``"big_vision"`` (default; MoCo v3, big_vision ``posemb_sincos_2d``): ``denom = dim/4 - 1``,
        so the slowest frequency is exactly ``1 / temperature``.
      * ``"mae"`` (MAE ``get_2d_sincos_pos_embed``, also used by many PyTorch ports):
        ``denom = dim/4``, the 1D transformer convention ``1 / temperature ** (2k / (dim/2))``.
    Both put x before y and sin before cos, so a table made with the matching convention
    loads checkpoints from either family unchanged.
    """
    if dim % 4 != 0:
        raise ValueError(
            f"sincos_2d needs dim divisible by 4 (sin/cos × rows/cols), got dim={dim}; "
            "pick a width that is a multiple of 4 or use posemb='learn'."
        )
    if convention not in SINCOS_CONVENTIONS:
        raise ValueError(f"Unknown sin-cos convention {convention!r}; choose one of {SINCOS_CONVENTIONS}.")
    quarter = dim // 4
    denom = quarter - 1 if convention == "big_vision" else quarter
    denom = max(denom, 1)  # dim == 4 under big_vision: a single frequency of 1.
    omega = 1.0 / (temperature ** (np.arange(quarter, dtype=np.float64) / denom))
    rows, cols = np.mgrid[:grid_h, :grid_w]
    x = cols.reshape(-1, 1).astype(np.float64) * omega[None]
    y = rows.reshape(-1, 1).astype(np.float64) * omega[None]
    table = np.concatenate([np.sin(x), np.cos(x), np.sin(y), np.cos(y)], axis=1)
    return jnp.asarray(table, dtype=jnp.float32)


# How each source resamples a position table (``resample_grid``'s ``method``):
#   * ``"bicubic_aa"`` (vitmm's default): bicubic (Keys a = -0.5) with anti-aliasing when
#     shrinking (the kernel widened by the scale, weights renormalised at the edges), computed by
#     ``jax.image.resize``; the same function as torch's ``F.interpolate(mode="bicubic",
#     antialias=True)`` (tested): timm's ``resample_abs_pos_embed``, open_clip's
#     ``resize_pos_embed``, transformers' DINOv2-with-registers.
#   * ``"torch_bicubic"``: ``F.interpolate(mode="bicubic", align_corners=False)`` without
#     anti-aliasing (a = -0.75, clamped edge taps): transformers' ViT/CLIP/SigLIP/DINOv2
#     ``interpolate_pos_encoding``, Qwen-VL's ``get_abs_pos``.
#   * ``"big_vision"``: ``scipy.ndimage.zoom(order=1)`` per axis (linear, corners aligned):
#     big_vision's ``resample_posemb``.
RESAMPLE_METHODS = ("bicubic_aa", "torch_bicubic", "big_vision")


def _cubic(x: np.ndarray, a: float) -> np.ndarray:
    """Keys' cubic convolution kernel with parameter ``a`` at distances ``x`` (in ``x``'s dtype)."""
    x = np.abs(x)
    a, one, two = x.dtype.type(a), x.dtype.type(1), x.dtype.type(2)
    near = ((a + 2) * x - (a + 3)) * x * x + one
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return np.where(x < one, near, np.where(x < two, far, x.dtype.type(0)))


def resample_weights(size: int, new_size: int, method: str) -> np.ndarray:
    """The ``[new_size, size]`` matrix that resamples one axis the way ``method`` does.

    ``torch_bicubic`` follows PyTorch's CPU kernel step by step in float32 (the scale, the source
    coordinates and the kernel taps are rounded where torch rounds them), so the weights are
    torch's own. (``bicubic_aa`` is ``jax.image.resize``'s and has no matrix here.)
    """
    w = np.zeros((new_size, size), np.float32)
    rows = np.arange(new_size)
    f32 = np.float32
    if method == "torch_bicubic":  # upsample_bicubic2d: half-pixel source index, 4 clamped taps
        scale = f32(size) / f32(new_size)
        src = scale * (rows.astype(f32) + f32(0.5)) - f32(0.5)
        base = np.floor(src)
        t = src - base
        taps = (_cubic(t + f32(1), -0.75), _cubic(t, -0.75), _cubic(f32(1) - t, -0.75),
                _cubic(f32(1) - t + f32(1), -0.75))
        for j, weight in enumerate(taps):
            np.add.at(w, (rows, np.clip(base.astype(int) - 1 + j, 0, size - 1)), weight)
    elif method == "big_vision":  # scipy.ndimage.zoom(order=1): corners aligned
        src = rows * ((size - 1) / (new_size - 1)) if new_size > 1 else np.zeros(1)
        base = np.clip(np.floor(src).astype(int), 0, size - 1)
        frac = src - base
        np.add.at(w, (rows, base), 1 - frac)
        np.add.at(w, (rows, np.minimum(base + 1, size - 1)), frac)
    else:
        raise ValueError(f"Unknown resampling method {method!r}; choose one of {RESAMPLE_METHODS}.")
    return w


def resample_grid(table: jnp.ndarray, new_grid: tuple[int, int], method: str = "bicubic_aa") -> jnp.ndarray:
    """Resamples a grid of position vectors ``[..., h, w, D]`` to ``[..., new_h, new_w, D]``.

    ``method`` (``RESAMPLE_METHODS``) reproduces one source's resampling to float32 rounding, so
    a converted checkpoint at a new resolution computes what its original computes; works for
    non-square grids in both directions. Every method's weights sum to one along each axis, so
    a constant field stays constant (tested).
    """
    *lead, h, w, d = table.shape
    new_h, new_w = new_grid
    if (h, w) == (new_h, new_w):
        return table
    if method not in RESAMPLE_METHODS:
        raise ValueError(f"Unknown resampling method {method!r}; choose one of {RESAMPLE_METHODS}.")
    if method == "bicubic_aa":
        out = jax.image.resize(table.astype(jnp.float32), (*lead, new_h, new_w, d), method="bicubic",
                               antialias=True)
        return out.astype(table.dtype)
    rows = jnp.asarray(resample_weights(h, new_h, method), jnp.float32)
    cols = jnp.asarray(resample_weights(w, new_w, method), jnp.float32)
    hp = jax.lax.Precision.HIGHEST
    out = jnp.einsum("ph,...hwd->...pwd", rows, table.astype(jnp.float32), precision=hp)
    out = jnp.einsum("qw,...pwd->...pqd", cols, out, precision=hp)
    return out.astype(table.dtype)


def resample_flat_posemb(
    posemb: jnp.ndarray,
    old_grid: tuple[int, int],
    new_grid: tuple[int, int],
    num_prefix_tokens: int = 0,
    method: str = "bicubic_aa",
) -> jnp.ndarray:
    """Resamples a flat ``[1, prefix + h*w, D]`` table (timm/CLIP/big_vision checkpoint layout).

    The first ``num_prefix_tokens`` entries (CLS position in CLIP/timm tables) are kept as they
    are; the rest are treated as an ``old_grid`` in raster order.
    """
    n_old = old_grid[0] * old_grid[1]
    if posemb.shape[1] != num_prefix_tokens + n_old:
        raise ValueError(
            f"Position table has {posemb.shape[1]} entries but old_grid={old_grid} with "
            f"num_prefix_tokens={num_prefix_tokens} needs {num_prefix_tokens + n_old}."
        )
    prefix, grid = posemb[:, :num_prefix_tokens], posemb[:, num_prefix_tokens:]
    grid = grid.reshape(posemb.shape[0], *old_grid, posemb.shape[-1])
    grid = resample_grid(grid, new_grid, method)
    grid = grid.reshape(posemb.shape[0], new_grid[0] * new_grid[1], posemb.shape[-1])
    return jnp.concatenate([prefix, grid], axis=1)


# ----------------------------------------------------------------------------------------------
# Axial 2D rotary embedding.
# ----------------------------------------------------------------------------------------------
def rope_2d_angles(
    grid_h: int, grid_w: int, head_dim: int, theta: float = 100.0, num_prefix_tokens: int = 0
) -> jnp.ndarray:
    """Rotation angles ``[num_prefix + h*w, head_dim // 2]`` for axial 2D RoPE.

    Axial layout (RoPE-ViT "axial", Qwen2-VL vision): the first ``head_dim // 4`` rotation pairs
    turn with the column index, the last ``head_dim // 4`` with the row index, each over the
    frequencies ``theta ** -(4k / head_dim)``. RoPE-ViT uses ``theta = 100`` for axial RoPE.
    Prefix tokens (CLS, registers) get angle 0, i.e. no rotation, so their attention is
    position-free as in RoPE-ViT.
    """
    if head_dim % 4 != 0:
        raise ValueError(
            f"rope2d needs a head dim divisible by 4 (pairs × rows/cols), got head_dim={head_dim}."
        )
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 4, dtype=np.float64)[: head_dim // 4] / head_dim))
    rows, cols = np.mgrid[:grid_h, :grid_w]
    ang_x = cols.reshape(-1, 1) * freqs[None]
    ang_y = rows.reshape(-1, 1) * freqs[None]
    angles = np.concatenate([ang_x, ang_y], axis=1)
    angles = np.concatenate([np.zeros((num_prefix_tokens, head_dim // 2)), angles], axis=0)
    return jnp.asarray(angles, jnp.float32)


def apply_rope(x: jnp.ndarray, angles: jnp.ndarray, seq_axis: int = 1) -> jnp.ndarray:
    """Rotates ``x: [B, T, heads, head_dim]`` (``seq_axis=2``: ``[B, heads, T, head_dim]``) by
    ``angles: [T, head_dim // 2]``.

    Uses the half-split ("rotate_half") pairing: channel ``k`` pairs with ``k + head_dim/2``,
    the layout of Hugging Face Llama/Qwen2-VL, so their weights load without permutation.
    """
    if angles.shape[0] != x.shape[seq_axis] or 2 * angles.shape[1] != x.shape[-1]:
        raise ValueError(f"RoPE angles {angles.shape} do not fit queries/keys of shape {x.shape}.")
    shape = [1] * x.ndim  # angles broadcast over every axis but the sequence and the channels
    shape[seq_axis], shape[-1] = angles.shape
    cos = jnp.cos(angles).reshape(shape).astype(x.dtype)
    sin = jnp.sin(angles).reshape(shape).astype(x.dtype)
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

