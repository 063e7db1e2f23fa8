"""What every connector shares: the call contract, budget arithmetic and small layers.

Contract: ``connector(x, grid)`` with patch tokens ``x: [B, N, C]`` in raster order over
``grid = (h, w)`` (``N = h·w``, no CLS) returns ``[B, M, D]`` visual tokens for the language
model, where ``M = num_visual_tokens(config, grid)`` (``budget.py``).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from vitmm.models import common, layers


def check_tokens(x: jnp.ndarray, grid: tuple[int, int]) -> None:
    if x.ndim != 3 or x.shape[1] != grid[0] * grid[1]:
        raise ValueError(f"Connectors take patch tokens [B, h*w, C] for grid {grid}, got shape "
                         f"{tuple(x.shape)}; drop CLS/registers first (out['patch_tokens']).")


def space_to_depth(x: jnp.ndarray, grid: tuple[int, int], k: int) -> jnp.ndarray:
    """``[B, h·w, C] → [B, (h/k)·(w/k), k·k·C]``: each k×k block of neighbours concatenated
    (row-major within the block), blocks in raster order — Qwen2-VL's merge and InternVL's
    pixel shuffle (the correct 'v2' orientation)."""
    b, _, c = x.shape
    h, w = grid
    x = x.reshape(b, h // k, k, w // k, k, c).transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(b, (h // k) * (w // k), k * k * c)


def adaptive_avg_pool(x: jnp.ndarray, grid: tuple[int, int], out: tuple[int, int]) -> jnp.ndarray:
    """PyTorch's ``AdaptiveAvgPool2d`` on ``[B, h·w, C]``: cell ``i`` averages rows
    ``floor(i·h/out) .. ceil((i+1)·h/out)`` (cells may overlap when ``out`` does not divide)."""
    b, _, c = x.shape
    h, w = grid
    img = x.reshape(b, h, w, c)
    rows = []
    for i in range(out[0]):
        r0, r1 = (i * h) // out[0], -((-(i + 1) * h) // out[0])
        cols = []
        for j in range(out[1]):
            c0, c1 = (j * w) // out[1], -((-(j + 1) * w) // out[1])
            cols.append(img[:, r0:r1, c0:c1].mean(axis=(1, 2)))
        rows.append(jnp.stack(cols, axis=1))
    return jnp.stack(rows, axis=1).reshape(b, out[0] * out[1], c)


class MLP(nn.Module):
    """``Dense(hidden) → act → Dense(hidden) … → Dense(out)`` with ``depth`` Dense layers
    (LLaVA ``mlp{depth}x_gelu`` uses hidden = out)."""

    out_dim: int
    depth: int = 2
    hidden: int | None = None
    act: str = "gelu"
    use_bias: bool = True

    @nn.compact
    def __call__(self, x):
        act = common.activation(self.act)
        for i in range(self.depth):
            last = i == self.depth - 1
            x = layers.Dense(self.out_dim if last else (self.hidden or self.out_dim), use_bias=self.use_bias,
                             kernel_init=common.trunc_normal(0.02), name=f"fc{i + 1}")(x)
            if not last:
                x = act(x)
        return x


def mha(q_in, k_in, v_in, num_heads: int, name: str, use_bias: bool = True, head_dim: int | None = None):
    """Multi-head attention with separate query, key and value inputs (as
    ``torch.nn.MultiheadAttention``): positions can go into q and k but not v. The heads share the
    query's width, or are ``head_dim`` wide each (OpenFlamingo: 8 × 64 at any width)."""
    d = q_in.shape[-1]
    if head_dim is None and d % num_heads:
        raise ValueError(f"Width {d} is not divisible by {num_heads} heads.")
    hd = head_dim or d // num_heads
    proj = lambda x, n: layers.Dense(num_heads * hd, use_bias=use_bias, kernel_init=common.trunc_normal(0.02),  # noqa: E731
                                     name=f"{name}_{n}")(x).reshape(*x.shape[:2], num_heads, hd)
    out = jax.nn.dot_product_attention(proj(q_in, "q"), proj(k_in, "k"), proj(v_in, "v"))
    return layers.Dense(d, use_bias=use_bias, kernel_init=common.trunc_normal(0.02),
                        name=f"{name}_out")(out.reshape(*out.shape[:2], num_heads * hd))


def _shifted_sum(x, kernel, before: int, after: int):
    """``Σ_ij pad(x)[:, i:i+h, j:j+w] · kernel[i, j]``: a depthwise correlation, ``kernel [k, k, C]``,
    ``before``/``after`` rows and columns of zeros around ``x [B, h, w, C]``."""
    k, (_, h, w, _) = kernel.shape[0], x.shape
    xp = jnp.pad(x, ((0, 0), (before, after), (before, after), (0, 0)))
    return sum(xp[:, i:i + h, j:j + w, :] * kernel[i, j] for i in range(k) for j in range(k))


def _same_depthwise(x, kernel):
    k = kernel.shape[0]
    return _shifted_sum(x, kernel, (k - 1) // 2, k // 2)


@jax.custom_vjp
def depthwise_conv(x, kernel):
    """Depthwise k×k convolution with SAME padding (an even kernel's extra row/column after),
    ``x [B, h, w, C]``, ``kernel [k, k, C]``, its gradient written out for XLA:CPU: the kernel's as
    one matrix-vector product per tap, where autodiff's per-channel sums over the batch and positions
    (column reductions) ran the C-Abstractor's gradient ~1.6× slower, and the input's as the
    correlation with the flipped kernel. A written JVP (``layers.dense``'s way, which keeps forward
    mode) transposed to a slower input gradient: its step was ~1.3× this one's. So forward mode
    (``jax.jvp``, forward-over-reverse Hessian products) does not go through it; ``DepthwiseConv``
    uses it on CPU only, reverse mode of any order works."""
    return _same_depthwise(x, kernel)


def _depthwise_conv_fwd(x, kernel):
    return depthwise_conv(x, kernel), (x, kernel)


def _depthwise_conv_bwd(saved, g):
    x, kernel = saved
    k, (b, h, w, c) = kernel.shape[0], x.shape
    before, after = (k - 1) // 2, k // 2
    dx = _shifted_sum(g, kernel[::-1, ::-1], after, before)  # the transpose: the flipped kernel, padding swapped
    xp = jnp.pad(x, ((0, 0), (before, after), (before, after), (0, 0)))
    ones = jnp.ones((b * h * w,), g.dtype)

    def tap(i, j):  # one product at a time: no k²-times-the-activation array
        product = (xp[:, i:i + h, j:j + w, :] * g).reshape(b * h * w, c)
        return jnp.dot(ones, product, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)

    dkernel = jnp.stack([jnp.stack([tap(i, j) for j in range(k)]) for i in range(k)])
    return dx.astype(x.dtype), dkernel.astype(kernel.dtype)


depthwise_conv.defvjp(_depthwise_conv_fwd, _depthwise_conv_bwd)


class DepthwiseConv(nn.Module):
    """``nn.Conv(C, (k, k), padding="SAME", feature_group_count=C)`` with the same parameters
    (``kernel [k, k, 1, C]``, ``bias [C]``), computed as k² shifted multiply-adds, which XLA:CPU
    runs (with their gradients, ``depthwise_conv`` on CPU) much faster than a grouped convolution;
    equality, gradients included, is tested in the connector tests."""

    features: int
    kernel_size: int = 3
    use_bias: bool = True

    @nn.compact
    def __call__(self, x):  # x: [B, h, w, C]
        k = self.kernel_size
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (k, k, 1, self.features), jnp.float32)
        out = (depthwise_conv if layers.platform() == "cpu" else _same_depthwise)(x, kernel[:, :, 0])
        if self.use_bias:
            out = out + self.param("bias", nn.initializers.zeros, (self.features,), jnp.float32)
        return out
