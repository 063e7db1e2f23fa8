"""``Dense`` and ``LayerNorm``: flax's layers, with derivatives written for XLA:CPU's reverse mode.

Same fields, parameters (``kernel``, ``bias``), shapes and forward arithmetic as
``flax.linen.Dense``, so checkpoints, converters and parameter rules see no difference; every
dense layer in ``vitmm.models`` is this one. What changes is the program reverse mode hands XLA
on CPU:

- The bias gradient ``Σ_tokens g`` is a matrix-vector product with a vector of ones: XLA:CPU
  lowers a column sum to a tree of ``reduce-window``s, an order of magnitude slower than the dot.
- The kernel gradient is ``x2dᵀ·g2d`` on the tokens flattened to 2-D, both operands contracting
  their leading axis; autodiff of the 3-D ``dot_general`` let XLA store the output gradient
  transposed for it, a copy per layer that also pulled the GELU's derivative into a transposing
  loop.

The rule is a JVP (``jax.custom_jvp``) whose tangent is linear in ``(dx, dkernel, dbias)`` and
written so that JAX's transpose of it gives exactly those products: forward mode, ``jax.grad`` of
``jax.grad`` and everything else keep working. On other backends and with a custom
``dot_general`` or ``precision`` it is flax's ``Dense`` unchanged. Measurements:
``results/benchmark/README.md`` ("Design choices").
"""

from __future__ import annotations

import contextlib
import contextvars

import flax.linen as nn
import jax
import jax.numpy as jnp

_TARGET = contextvars.ContextVar("vitmm_target_platform", default=None)


def platform() -> str:
    """The platform the models are traced for: JAX's default backend, or the one a compile for
    another machine names (``compiling_for``; e.g. ``--dry_run --dry_run_target=h100`` on a CPU)."""
    return _TARGET.get() or jax.default_backend()


@contextlib.contextmanager
def compiling_for(name: str):
    """Trace the models as for ``name`` (``"gpu"``, ``"cpu"``) inside the block."""
    token = _TARGET.set(name)
    try:
        yield
    finally:
        _TARGET.reset(token)


def _ones_outer(tokens: int, v: jnp.ndarray) -> jnp.ndarray:
    """``[tokens, F]`` rows of ``v``, written as an outer product: its transpose is ``1ᵀ·g``, a
    matrix-vector product, where a broadcast's transpose would be a reduction."""
    return jax.lax.dot_general(jnp.ones((tokens, 1), v.dtype), v[None, :], (((1,), (0,)), ((), ())))


def _last_axis_matmul(x: jnp.ndarray, kernel: jnp.ndarray) -> jnp.ndarray:
    return jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))


@jax.custom_jvp
def dense(x: jnp.ndarray, kernel: jnp.ndarray, bias: jnp.ndarray | None = None) -> jnp.ndarray:
    """``x @ kernel (+ bias)`` over the last axis of ``x: [..., D]``; ``kernel: [D, F]``, ``bias: [F]``."""
    out = _last_axis_matmul(x, kernel)
    return out if bias is None else out + bias


@dense.defjvp
def _dense_jvp(primals, tangents):
    x, kernel, bias = primals
    dx, dkernel, dbias = tangents
    out = dense(x, kernel, bias)
    x2 = x.reshape(-1, x.shape[-1])
    d_params = x2 @ dkernel
    if bias is not None:
        d_params = d_params + _ones_outer(x2.shape[0], dbias)
    return out, _last_axis_matmul(dx, kernel) + d_params.reshape(out.shape)


class Dense(nn.Dense):
    """``flax.linen.Dense`` whose reverse mode gives XLA:CPU plain GEMMs (module docstring)."""

    @nn.compact
    def __call__(self, inputs: jnp.ndarray) -> jnp.ndarray:
        if (platform() != "cpu" or self.dot_general is not None or self.dot_general_cls is not None
                or self.precision is not None):
            return super().__call__(inputs)
        kernel = self.param("kernel", self.kernel_init, (inputs.shape[-1], self.features), self.param_dtype)
        bias = self.param("bias", self.bias_init, (self.features,), self.param_dtype) if self.use_bias else None
        inputs, kernel, bias = self.promote_dtype(inputs, kernel, bias, dtype=self.dtype)
        return dense(inputs, kernel, bias)



@jax.custom_jvp
def scale_shift(y: jnp.ndarray, mul: jnp.ndarray, scale: jnp.ndarray, bias: jnp.ndarray) -> jnp.ndarray:
    """LayerNorm's last step as flax computes it, ``y · (mul · scale) + bias``: ``y = x − mean``,
    ``mul = rsqrt(var + eps)`` ``[..., 1]``, ``scale``/``bias`` ``[C]``."""
    return y * (mul * scale) + bias


@scale_shift.defjvp
def _scale_shift_jvp(primals, tangents):
    y, mul, scale, bias = primals
    dy, dmul, dscale, dbias = tangents
    rows = y.size // y.shape[-1]
    spread = lambda v: _ones_outer(rows, v).reshape(y.shape)  # noqa: E731 - transposes to 1ᵀ·g, a product
    return scale_shift(y, mul, scale, bias), dy * (mul * scale) + y * (dmul * scale) + y * (mul * spread(dscale)) \
        + spread(dbias)


class LayerNorm(nn.LayerNorm):
    """``flax.linen.LayerNorm`` (same fields, parameters and forward arithmetic, bit for bit) whose
    scale and bias gradients XLA:CPU computes as matrix-vector products (``scale_shift``'s JVP)
    instead of sums over every leading axis. Measured where it matters (``results/benchmark/README.md``):
    the C-Abstractor's LayerNorms over ``[B, h, w, C]`` maps, its gradient 1.5× faster; on a ViT's
    ``[B, N, C]`` tokens it changed nothing, so the ViT keeps flax's. Other backends, masks, other
    axes or a missing scale/bias: flax's ``LayerNorm`` unchanged."""

    @nn.compact
    def __call__(self, x, *, mask=None):
        if (platform() != "cpu" or mask is not None or self.axis_name is not None or not self.use_scale
                or not self.use_bias or self.reduction_axes not in (-1, (-1,)) or self.feature_axes not in (-1, (-1,))):
            return super().__call__(x, mask=mask)
        from flax.linen import dtypes
        from flax.linen.normalization import _compute_stats

        mean, var = _compute_stats(x, self.reduction_axes, self.dtype, None, None,
                                   use_fast_variance=self.use_fast_variance,
                                   force_float32_reductions=self.force_float32_reductions)
        scale = self.param("scale", self.scale_init, (x.shape[-1],), self.param_dtype)
        bias = self.param("bias", self.bias_init, (x.shape[-1],), self.param_dtype)
        if not self.force_float32_reductions:
            scale, bias = jnp.asarray(scale, self.param_dtype), jnp.asarray(bias, self.param_dtype)
        y = scale_shift(x - mean[..., None], jax.lax.rsqrt(var[..., None] + self.epsilon), scale, bias)
        return jnp.asarray(y, dtypes.canonicalize_dtype(x, scale, bias, dtype=self.dtype))
