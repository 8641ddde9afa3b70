"""The small modules every block uses: Linear ([out, in] like the release), RMSNorm, Embed.

Numerics (spec §2.1): matmuls take compute-dtype inputs and accumulate in float32; norms run in float32
and return the compute dtype. In float32 mode matmuls use HIGHEST precision so GPUs do not drop to TF32.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels import fp8_linear
from pallas_kernels.kernel_config import KernelConfig
from pallas_kernels.tile_table import KernelShape


def matmul_precision(dtype: jnp.dtype) -> jax.lax.Precision:
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


def dense(x: jax.Array, w_OI: jax.Array, out_dtype: jnp.dtype | None = None) -> jax.Array:
    """x [..., I] @ w [O, I]^T -> [..., O], float32 accumulation."""
    y = jnp.einsum("...i,oi->...o", x.astype(w_OI.dtype), w_OI, preferred_element_type=jnp.float32,
                   precision=matmul_precision(w_OI.dtype))
    return y.astype(out_dtype or w_OI.dtype)


def with_kernels(module: nnx.Module, kernels: KernelConfig) -> nnx.Module:
    """`module` whose fused ops run the kernels of `kernels`: a new module graph over the same parameters (the
    same variables and arrays: nothing is copied), every module declaring `kernels` (Router, Experts, Linear,
    Block) holding this config; `module` itself is left as it is."""
    if not isinstance(kernels, KernelConfig):
        raise TypeError(f"kernels must be a KernelConfig, got {type(kernels).__name__}")
    new = nnx.merge(*nnx.split(module))
    for _, m in nnx.iter_modules(new):
        if "kernels" in vars(m):
            m.kernels = kernels  # a module of the new graph, which no one else holds yet
    return new


def rms_norm(x: jax.Array, weight: jax.Array | None, eps: float, out_dtype: jnp.dtype | None = None) -> jax.Array:
    """x * rsqrt(mean(x^2) + eps) [* weight], in float32."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if weight is not None:
        y = y * weight.astype(jnp.float32)
    return y.astype(out_dtype or x.dtype)


class Linear(nnx.Module):
    """Bias-free linear layer; `weight` is [out_features, in_features] as stored in the checkpoint.

    `store_fp8(block)` keeps the weight in the release's FP8 format on the device: `weight` e4m3 [O, I] and
    `scale` UE8M0 exponent bytes [ceil(O/b0), ceil(I/b1)]; each call decodes what it reads to `dtype` (the
    compute dtype) through `pallas_kernels.fp8_linear` with the implementation of `kernels` (static; given by
    `with_kernels`).
    """

    def __init__(self, in_features: int, out_features: int, *, dtype: jnp.dtype):
        self.dtype = jnp.dtype(dtype)
        self.kernels = KernelConfig()
        self.weight = nnx.Param(jnp.zeros((out_features, in_features), dtype))
        self.scale: nnx.Param | None = nnx.data(None)
        self.block: tuple[int, int] | None = None

    def store_fp8(self, block: tuple[int, int]) -> None:
        O, I = self.weight[...].shape
        self.block = (int(block[0]), int(block[1]))
        self.weight = nnx.Param(jnp.zeros((O, I), jnp.float8_e4m3fn))
        self.scale = nnx.Param(jnp.zeros((-(-O // self.block[0]), -(-I // self.block[1])), jnp.uint8))

    @property
    def kernel_impl(self) -> str:
        return self.kernels.impl

    def matrix(self) -> jax.Array:
        """The weight [O, I] in the compute dtype."""
        if self.scale is None:
            return self.weight[...]
        return fp8_linear.decode(self.weight[...], self.scale[...], self.block, self.dtype)

    def __call__(self, x: jax.Array, out_dtype: jnp.dtype | None = None) -> jax.Array:
        if self.scale is None:
            return dense(x, self.weight[...], out_dtype)
        w = self.weight[...]
        call = KernelShape("fp8_linear", math.prod(x.shape[:-1]), w.shape, f"fp8 {self.block[0]}x{self.block[1]}",
                           self.dtype.name)
        return fp8_linear.fp8_linear(x, w, self.scale[...], block=self.block, dtype=self.dtype,
                                     out_dtype=out_dtype or self.dtype, impl=self.kernel_impl,
                                     choice=self.kernels.choice(call))


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
