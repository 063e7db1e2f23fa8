"""Rotary positions (RoPE) of the LMs: frequencies (with Llama 3's, linear and per-frequency
rescaling), angles for 1D positions, Qwen2-VL's multimodal RoPE (M-RoPE: temporal, height and
width bands; its 3D position ids) and the half-split rotation Hugging Face applies."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None = None) -> np.ndarray:
    """``[head_dim/2]`` RoPE frequencies ``θ^(-2k/d)`` (float32 by Hugging Face's formula; numpy's
    float32 power differs from torch's by 1 ulp on some frequencies, so angles agree to ~1e-7
    relative, not bit for bit),
    with Llama 3's rescaling when ``scaling["rope_type"] == "llama3"``: wavelengths longer than
    ``original_max_position_embeddings / low_freq_factor`` slow down by ``factor``, shorter than
    ``… / high_freq_factor`` stay, and the band between is interpolated."""
    exponents = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    inv = (np.float32(1.0) / (np.float32(theta) ** exponents)).astype(np.float32)
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))  # "type": older configs
    if kind == "default":
        return inv
    if kind == "linear":  # positions divided by the factor (Gemma 3's global layers)
        return (inv / np.float32(scaling["factor"])).astype(np.float32)
    if kind == "factors":  # each frequency divided by its own factor (llama.cpp's rope_freqs: Llama 3's in GGUF)
        return (inv / np.asarray(scaling["factors"], np.float32)).astype(np.float32)
    if kind != "llama3":
        raise ValueError(f"rope_scaling type {kind!r} is not supported; vitmm has 'default', 'linear', 'factors' and "
                         "'llama3'.")
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > context / low, inv / factor, inv)
    smooth = (context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < context / high) & ~(wavelen > context / low)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_angles(positions: jnp.ndarray, head_dim: int, theta: float = 10_000.0, scaling: dict | None = None):
    """Rotation angles ``[..., head_dim/2]`` for integer positions ``[...]``."""
    inv = jnp.asarray(inverse_frequencies(head_dim, theta, scaling))
    return positions[..., None].astype(jnp.float32) * inv


def mrope_angles(positions: jnp.ndarray, head_dim: int, section, theta: float = 10_000.0,
                 scaling: dict | None = None) -> jnp.ndarray:
    """Qwen2-VL's multimodal RoPE: ``positions [3, B, T]`` (temporal, height, width; a plain
    ``[B, T]`` means the three are equal, as for text) → angles ``[B, T, head_dim/2]`` whose first
    ``section[0]`` frequencies turn with the temporal position, the next ``section[1]`` with the
    height and the last ``section[2]`` with the width (``sum(section) = head_dim/2``). The
    frequencies are the LM's own (``scaling`` as ``rope_angles``), so text positions turn as
    its 1D RoPE does."""
    if sum(section) != head_dim // 2 or len(section) != 3:
        raise ValueError(f"mrope_section {tuple(section)} must be three counts summing to head_dim/2 "
                         f"= {head_dim // 2}.")
    positions = jnp.broadcast_to(positions, (3, *positions.shape[-2:])) if positions.ndim == 2 else positions
    inv = jnp.asarray(inverse_frequencies(head_dim, theta, scaling))
    bounds = np.cumsum([0, *section])
    return jnp.concatenate([positions[c][..., None].astype(jnp.float32) * inv[bounds[c]:bounds[c + 1]]
                            for c in range(3)], axis=-1)


def mrope_split(head_dim: int) -> tuple[int, int, int]:
    """An ``mrope_section`` in Qwen2-VL's proportions for any head size: of the ``head_dim/2``
    frequency bands, a quarter turn with the temporal position and the rest evenly with height and
    width (``(16, 24, 24)`` at head_dim 128, Qwen2-VL's own; ``(4, 6, 6)`` at 32)."""
    half = head_dim // 2
    if half < 3:
        raise ValueError(f"mrope needs head_dim >= 6 (three frequency bands), got {head_dim}.")
    side = max(1, (half - half // 4) // 2)
    return half - 2 * side, side, side


def mrope_positions(token_types: np.ndarray, grids, pad_mask: np.ndarray | None = None):
    """Qwen2-VL's 3D position ids (``get_rope_index``) for batches of text and images:
    ``(positions [3, B, T], deltas [B])``.

    ``token_types [B, T]``: 0 for text, 1 for an image's tokens; ``grids``: each image's
    ``(t, h, w)`` in LM tokens (after the patch merger), in the order the images appear, row after
    row. A text run continues from the current position ``p`` with ``p, p+1, …`` in all three
    components; an image's token at ``(i, j)`` of frame ``τ`` gets ``(p + τ, p + i, p + j)``, and
    the text after it resumes at ``p + max(t, h, w)`` (Qwen2-VL's original code and vLLM's: the
    largest position + 1; transformers 5.x resumes at ``p + max(h, w)``, the same for images).
    Padding (``pad_mask`` False) gets 0. ``deltas`` is the largest position + 1 minus the real
    length: decoding continues at sequence index + delta.
    """
    token_types = np.asarray(token_types)
    b, length = token_types.shape
    valid = np.ones_like(token_types, bool) if pad_mask is None else np.asarray(pad_mask, bool)
    positions = np.zeros((3, b, length), np.int32)
    deltas = np.zeros(b, np.int32)
    images = iter([tuple(int(v) for v in g) for g in grids])
    for row in range(b):
        types = token_types[row][valid[row]]
        out, current, start = [], 0, 0
        while start < len(types):
            end = start
            while end < len(types) and types[end] == types[start]:
                end += 1
            if types[start] == 0:
                out.append(np.broadcast_to(current + np.arange(end - start), (3, end - start)))
                current += end - start
            else:
                t, h, w = next(images)
                if end - start != t * h * w:
                    raise ValueError(f"Row {row} has an image run of {end - start} tokens where its grid "
                                     f"{(t, h, w)} gives {t * h * w}.")
                grid_t, grid_h, grid_w = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
                out.append(current + np.stack([grid_t, grid_h, grid_w]).reshape(3, -1))
                current += max(t, h, w)
            start = end
        row_positions = np.concatenate(out, axis=1) if out else np.zeros((3, 0), np.int32)
        positions[:, row, valid[row]] = row_positions
        deltas[row] = (row_positions.max() + 1 if row_positions.size else 0) - len(types)
    return positions, deltas


def rotate(x: jnp.ndarray, angles: jnp.ndarray) -> jnp.ndarray:
    """``x: [B, T, heads, hd]`` rotated by ``angles: [B or 1, T, hd/2]`` (channel k pairs with
    k + hd/2, Hugging Face's ``rotate_half``)."""
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    cos, sin = jnp.concatenate([cos, cos], -1).astype(x.dtype), jnp.concatenate([sin, sin], -1).astype(x.dtype)
    x1, x2 = jnp.split(x, 2, axis=-1)
    return x * cos + jnp.concatenate([-x2, x1], axis=-1) * sin
