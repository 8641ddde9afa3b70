"""The small modules every block uses: Linear ([out, in] like the release), RMSNorm, Embed.

Numerics (spec §2.1): matmuls take compute-dtype inputs and accumulate in float32; norms run in float32
and return the compute dtype. In float32 mode matmuls use HIGHEST precision so GPUs do not drop to TF32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def matmul_precision(dtype: jnp.dtype) -> jax.lax.Precision:
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


def dense(x: jax.Array, w_OI: jax.Array, out_dtype: jnp.dtype | None = None) -> jax.Array:
    """x [..., I] @ w [O, I]^T -> [..., O], float32 accumulation."""
    y = jnp.einsum("...i,oi->...o", x.astype(w_OI.dtype), w_OI, preferred_element_type=jnp.float32,
                   precision=matmul_precision(w_OI.dtype))
    return y.astype(out_dtype or w_OI.dtype)


def rms_norm(x: jax.Array, weight: jax.Array | None, eps: float, out_dtype: jnp.dtype | None = None) -> jax.Array:
    """x * rsqrt(mean(x^2) + eps) [* weight], in float32."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if weight is not None:
        y = y * weight.astype(jnp.float32)
    return y.astype(out_dtype or x.dtype)


class Linear(nnx.Module):
    """Bias-free linear layer; `weight` is [out_features, in_features] as stored in the checkpoint."""

    def __init__(self, in_features: int, out_features: int, *, dtype: jnp.dtype):
        self.weight = nnx.Param(jnp.zeros((out_features, in_features), dtype))

    def __call__(self, x: jax.Array, out_dtype: jnp.dtype | None = None) -> jax.Array:
        return dense(x, self.weight[...], out_dtype)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, dtype: jnp.dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array, out_dtype: jnp.dtype | None = None) -> jax.Array:
        return rms_norm(x, self.weight[...], self.eps, out_dtype)


class Embed(nnx.Module):
    def __init__(self, vocab: int, dim: int, *, dtype: jnp.dtype):
        self.weight = nnx.Param(jnp.zeros((vocab, dim), dtype))

    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.weight[...], ids, axis=0)
