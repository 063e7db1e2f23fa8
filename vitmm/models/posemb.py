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
      * ``"big_vision"`` (default; big_vision ``posemb_sincos_2d``): ``denom = dim/4 - 1``,
        so the slowest frequency is exactly ``1 / temperature``.
      * ``"mae"`` (MAE ``get_2d_sincos_pos_embed``, also used by many PyTorch ports):
        ``denom = dim/4``, the 1D transformer convention ``1 / temperature ** (2k / (dim/2))``.
    Both put x before y and sin before cos, so a table made with the matching convention
    loads checkpoints from either family unchanged. MoCo v3's table
    (``build_2d_sincos_position_embedding``) is neither: it has the ``"mae"`` denominator but
    builds its grid with ``meshgrid(grid_w, grid_h)`` ('ij'), so its first half follows the row
    (on a non-square grid the token order is transposed too); it matches this ``"mae"`` table
    with the two halves swapped, not as is.
    """
    if dim % 4 != 0:
        raise ValueError(
            f"sincos_2d needs dim divisible by 4 (sin/cos × rows/cols), got dim={dim}; "
            "pick a width that is a multiple of 4 or use posemb='learn'."
        )
    if convention not in SINCOS_CONVENTIONS:
        raise ValueError(f"Unknown sin-cos convention {convention!r}; choose one of {SINCOS_CONVENTIONS}.")
    axis = _sincos_1d(max(grid_h, grid_w), dim, temperature, convention)
    rows, cols = np.mgrid[:grid_h, :grid_w]
    return jnp.asarray(np.concatenate([axis[cols.reshape(-1)], axis[rows.reshape(-1)]], axis=1))


def _sincos_1d(length: int, dim: int, temperature: float, convention: str) -> np.ndarray:
    """``[length, dim // 2]`` float32: ``[sin(p·ω), cos(p·ω)]`` for positions ``p < length``,
    computed in float64 (half of a 2D table's row; ``sincos_2d`` puts the column's first)."""
    quarter = dim // 4
    denom = quarter - 1 if convention == "big_vision" else quarter
    denom = max(denom, 1)  # dim == 4 under big_vision: a single frequency of 1.
    omega = 1.0 / (temperature ** (np.arange(quarter, dtype=np.float64) / denom))
    p = np.arange(length, dtype=np.float64)[:, None] * omega[None]
    return np.concatenate([np.sin(p), np.cos(p)], axis=1).astype(np.float32)


def sincos_2d_at(positions: jnp.ndarray, dim: int, max_side: int, temperature: float = 10_000.0, *,
                 convention: str = "big_vision") -> jnp.ndarray:
    """``sincos_2d``'s rows at (traced) integer ``positions [..., 2]`` (row, col), each below
    ``max_side``: ``[..., dim]``, bit-equal to ``sincos_2d(h, w, dim)[row * w + col]``."""
    if dim % 4 != 0:
        raise ValueError(f"sincos_2d needs dim divisible by 4 (sin/cos × rows/cols), got dim={dim}.")
    if convention not in SINCOS_CONVENTIONS:
        raise ValueError(f"Unknown sin-cos convention {convention!r}; choose one of {SINCOS_CONVENTIONS}.")
    axis = jnp.asarray(_sincos_1d(max_side, dim, temperature, convention))
    return jnp.concatenate([axis[positions[..., 1]], axis[positions[..., 0]]], axis=-1)


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


def _fma(a, b, c) -> np.ndarray:
    """float32 ``a·b + c`` rounded once, as a fused multiply-add: the float32 product is exact in
    float64. PyTorch's CPU kernels are compiled with FMA contraction, so its bicubic weights are
    these (the max difference to torch drops from 1.3e-6 to 2e-7 of the table's largest value)."""
    f64 = np.float64
    return (np.asarray(a, f64) * np.asarray(b, f64) + np.asarray(c, f64)).astype(np.float32)


def _cubic_near(x):  # torch's cubic_convolution1 (|x| <= 1), a = -0.75, contracted as compiled
    return _fma(_fma(np.float32(1.25), x, np.float32(-2.25)) * x, x, np.float32(1))


def _cubic_far(x):  # cubic_convolution2 (1 < |x| < 2)
    a = np.float32(-0.75)
    return _fma(_fma(_fma(a, x, np.float32(3.75)), x, np.float32(-6)), x, np.float32(3))


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
        src = _fma(scale, rows.astype(f32) + f32(0.5), f32(-0.5))
        base = np.floor(src)
        t = src - base
        taps = (_cubic_far(t + f32(1)), _cubic_near(t), _cubic_near(f32(1) - t), _cubic_far(f32(1) - t + f32(1)))
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


def axis_weights_at(size: int, new_size: jnp.ndarray, index: jnp.ndarray, method: str = "bicubic_aa") -> jnp.ndarray:
    """Row ``index`` of the matrix that resamples an axis of ``size`` entries to ``new_size``,
    for (traced) integer arrays ``new_size`` and ``index`` of one shape: ``[..., size]`` float32.

    The per-token form of ``resample_grid`` for packed sequences, where every image has a grid of
    its own: ``bicubic_aa`` follows ``jax.image.resize``'s weights (Keys a = -0.5, the kernel
    widened by the scale when shrinking, rows renormalised), ``torch_bicubic`` and ``big_vision``
    ``resample_weights``'; equal to those matrices' rows to float32 rounding (tested; ≤ 1.1e-6
    for ``torch_bicubic``, whose matrix is FMA-contracted as torch's kernel is), and the identity
    when ``new_size == size``.
    """
    f32 = jnp.float32
    # a padding token's grid is (0, 0) (a packed row without an image): 1 keeps its weights, and their gradients, finite
    n, r = jnp.maximum(jnp.asarray(new_size).astype(f32), 1.0), jnp.asarray(index).astype(f32)
    taps = jnp.arange(size, dtype=f32)
    if method == "bicubic_aa":
        inv = f32(size) / n
        sample = (r + 0.5) * inv - 0.5
        x = jnp.abs(sample[..., None] - taps) / jnp.maximum(inv, 1.0)[..., None]
        near = ((1.5 * x - 2.5) * x) * x + 1.0
        w = jnp.where(x >= 2.0, 0.0, jnp.where(x >= 1.0, ((-0.5 * x + 2.5) * x - 4.0) * x + 2.0, near))
        return w / jnp.sum(w, axis=-1, keepdims=True)
    if method == "torch_bicubic":
        src = (f32(size) / n) * (r + 0.5) - 0.5
        base = jnp.floor(src)
        t = (src - base)[..., None]
        cubic = lambda d: jnp.where(d < 1.0, ((1.25 * d - 2.25) * d) * d + 1.0,  # noqa: E731 - a = -0.75
                                    jnp.where(d < 2.0, ((-0.75 * d + 3.75) * d - 6.0) * d + 3.0, 0.0))
        w = jnp.zeros((*r.shape, size), f32)
        for j, d in enumerate((t + 1.0, t, 1.0 - t, (1.0 - t) + 1.0)):
            at = jnp.clip(base[..., None] - 1 + j, 0, size - 1)
            w = w + jnp.where(taps == at, cubic(d), 0.0)
        return w
    if method == "big_vision":
        src = jnp.where(n > 1, r * ((size - 1) / jnp.maximum(n - 1, 1.0)), 0.0)
        base = jnp.clip(jnp.floor(src), 0, size - 1)
        frac = (src - base)[..., None]
        base = base[..., None]
        return jnp.where(taps == base, 1.0 - frac, 0.0) + jnp.where(taps == jnp.minimum(base + 1, size - 1), frac, 0.0)
    raise ValueError(f"Unknown resampling method {method!r}; choose one of {RESAMPLE_METHODS}.")


def resample_grid_at(table: jnp.ndarray, grids: jnp.ndarray, positions: jnp.ndarray,
                     method: str = "bicubic_aa") -> jnp.ndarray:
    """The ``[h, w, D]`` table resampled to each token's grid and read at its position:
    ``grids`` and ``positions`` are ``[..., 2]`` integer (rows, cols) arrays, the result
    ``[..., D]`` is what ``resample_grid(table, grid)[row, col]`` gives (tested)."""
    h, w, d = table.shape
    rows = axis_weights_at(h, grids[..., 0], positions[..., 0], method)
    cols = axis_weights_at(w, grids[..., 1], positions[..., 1], method)
    weights = (rows[..., :, None] * cols[..., None, :]).reshape(*rows.shape[:-1], h * w)
    return jnp.matmul(weights, table.reshape(h * w, d).astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST).astype(table.dtype)


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

    Axial layout (RoPE-ViT "axial"): the first ``head_dim // 4`` rotation pairs turn with the
    column index, the last ``head_dim // 4`` with the row index, each over the frequencies
    ``theta ** -(4k / head_dim)``. Qwen2-VL's vision tower puts the rows first: its import swaps
    the two quarters of each head's q/k channels (``interop.vlm.qwen2_vl.rope_order``). RoPE-ViT
    uses ``theta = 100`` for axial RoPE.
    Prefix tokens (CLS, registers) get angle 0, i.e. no rotation, so their attention is
    position-free as in RoPE-ViT.
    """
    if head_dim % 4 != 0:
        raise ValueError(
            f"rope2d needs a head dim divisible by 4 (pairs × rows/cols), got head_dim={head_dim}."
        )
    axis = _rope_1d(max(grid_h, grid_w), head_dim, theta)
    rows, cols = np.mgrid[:grid_h, :grid_w]
    angles = np.concatenate([axis[cols.reshape(-1)], axis[rows.reshape(-1)]], axis=1)
    return jnp.asarray(np.concatenate([np.zeros((num_prefix_tokens, head_dim // 2), np.float32), angles]))


def _rope_1d(length: int, head_dim: int, theta: float) -> np.ndarray:
    """``[length, head_dim // 4]`` float32 angles ``p · theta ** -(4k / head_dim)`` (float64 math)."""
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 4, dtype=np.float64)[: head_dim // 4] / head_dim))
    return (np.arange(length, dtype=np.float64)[:, None] * freqs[None]).astype(np.float32)


def rope_2d_angles_at(positions: jnp.ndarray, head_dim: int, max_side: int, theta: float = 100.0) -> jnp.ndarray:
    """``rope_2d_angles``' rows at (traced) integer ``positions [..., 2]`` (row, col), each below
    ``max_side``: ``[..., head_dim // 2]``, bit-equal to the grid's table."""
    if head_dim % 4 != 0:
        raise ValueError(f"rope2d needs a head dim divisible by 4 (pairs × rows/cols), got head_dim={head_dim}.")
    axis = jnp.asarray(_rope_1d(max_side, head_dim, theta))
    return jnp.concatenate([axis[positions[..., 1]], axis[positions[..., 0]]], axis=-1)


def apply_rope(x: jnp.ndarray, angles: jnp.ndarray, seq_axis: int = 1) -> jnp.ndarray:
    """Rotates ``x: [B, T, heads, head_dim]`` (``seq_axis=2``: ``[B, heads, T, head_dim]``) by
    ``angles: [T, head_dim // 2]``, or ``[B, T, head_dim // 2]`` for angles of each example's own
    (packed sequences).

    Uses the half-split ("rotate_half") pairing: channel ``k`` pairs with ``k + head_dim/2``,
    the layout of Hugging Face Llama/Qwen2-VL, so their weights load without permutation.
    """
    if (angles.shape[-2] != x.shape[seq_axis] or 2 * angles.shape[-1] != x.shape[-1]
            or angles.ndim not in (2, 3) or (angles.ndim == 3 and angles.shape[0] not in (1, x.shape[0]))):
        raise ValueError(f"RoPE angles {angles.shape} do not fit queries/keys of shape {x.shape}.")
    shape = [1] * x.ndim  # angles broadcast over every axis but (the batch,) the sequence and the channels
    shape[seq_axis], shape[-1] = angles.shape[-2:]
    if angles.ndim == 3:
        shape[0] = angles.shape[0]
    cos = jnp.cos(angles).reshape(shape).astype(x.dtype)
    sin = jnp.sin(angles).reshape(shape).astype(x.dtype)
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

