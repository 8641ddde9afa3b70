"""Small kernel-safe pieces shared by the fused ops (and the model, `dsv41.layers.attention`): full-width partial
RoPE, the FP8 output cast and the attention's sink softmax.

Pallas Triton values must have power-of-two sizes, so the partial RoPE (trailing d_r of d channels,
adjacent pairs) is applied to the whole d-wide row with cos = 1, sin = 0 on the unrotated channels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

E4M3_MAX = 448.0
FP8_OUT_BLOCK = 128  # channels per scale of the FP8 activations a block-scaled GEMM reads


def product_dtype(dtype) -> jnp.dtype:
    """The operand dtype of the fused ops' products for inputs of `dtype`: bfloat16 stays bfloat16 (what the GPU
    kernels feed the tensor cores and XLA:CPU runs on AMX where the CPU has it), anything else float32."""
    return jnp.dtype(jnp.bfloat16 if jnp.dtype(dtype) == jnp.bfloat16 else jnp.float32)


def product_precision(dtype) -> jax.lax.Precision | None:
    """float32 products at full precision (no TF32 / bf16 passes): the exactness tests compare them to 1e-5."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def full_width_angles(cos_Tr: jax.Array, sin_Tr: jax.Array, d: int) -> tuple[jax.Array, jax.Array]:
    """cos, sin [T, d_r/2] of the rotated pairs -> per-channel [T, d] (1 / 0 on the leading d - d_r)."""
    T, half = cos_Tr.shape
    one = jnp.ones((T, d - 2 * half), jnp.float32)
    cos = jnp.concatenate([one, jnp.repeat(cos_Tr.astype(jnp.float32), 2, axis=-1)], axis=-1)
    sin = jnp.concatenate([0 * one, jnp.repeat(sin_Tr.astype(jnp.float32), 2, axis=-1)], axis=-1)
    return cos, sin


def pair_swap(x: jax.Array) -> jax.Array:
    """(x0, x1, x2, x3, ..) -> (-x1, x0, -x3, x2, ..) over the last axis."""
    xr = x.reshape(*x.shape[:-1], x.shape[-1] // 2, 2)
    a, b = jax.lax.split(xr, (1, 1), axis=-1)
    return jnp.concatenate([-b, a], axis=-1).reshape(x.shape)


def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array, *, inverse: bool = False) -> jax.Array:
    """Interleaved RoPE with full-width angles (broadcasting against x); inverse rotates by -theta."""
    return x * cos + pair_swap(x) * (-sin if inverse else sin)


def rotate_tail(x: jax.Array, cos_Tr: jax.Array, sin_Tr: jax.Array, *, inverse: bool = False) -> jax.Array:
    """`rotate` of x [T, ..., d] by angles [T, d_r/2] on its last d_r channels; the leading d - d_r pass through
    unchanged (x * 1 + swap(x) * 0). One elementwise pass over all d channels: rotating the tail alone and
    concatenating it back costs XLA:CPU a separate copy of x, more than the extra multiplies."""
    T, half = cos_Tr.shape
    lead = x.shape[-1] - 2 * half

    def full(a, fill):  # [T, d_r/2] -> [T, 1.., d]: each angle on its channel pair, `fill` on the leading channels
        a = jnp.pad(jnp.repeat(a.astype(jnp.float32), 2, axis=-1), ((0, 0), (lead, 0)), constant_values=fill)
        return a.reshape(T, *(1,) * (x.ndim - 2), x.shape[-1])

    return rotate(x, full(cos_Tr, 1.0), full(sin_Tr, 0.0), inverse=inverse).astype(x.dtype)


def pow2_ceil(x: jax.Array) -> jax.Array:
    """2**ceil(log2(x)) for positive normal float32 x, from the bits."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    exp = ((bits >> 23) & 255) + ((bits & 0x7FFFFF) != 0).astype(jnp.int32)
    return jax.lax.bitcast_convert_type(exp << 23, jnp.float32)


def fp8_block_cast(x: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
    """x [..., C] -> (e4m3 [..., C], float32 UE8M0-valued scales [..., C / block]): s = 2**ceil(log2(
    max(amax, 1e-4) / 448)) per block, q = e4m3(clamp(x / s, +-448))."""
    z = x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // block, block)
    s = pow2_ceil(jnp.maximum(jnp.max(jnp.abs(z), axis=-1), 1e-4) * (1.0 / E4M3_MAX))
    q = jnp.clip(z / s[..., None], -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)
    return q.reshape(x.shape), s


def sink_softmax(logits: list[jax.Array], sink_H: jax.Array) -> tuple[list[jax.Array], jax.Array]:
    """Unnormalised probabilities of several key blocks [.., H, K_i] sharing one softmax whose denominator
    also holds exp(sink_h) (the sink adds no value), and that denominator [.., H, 1]."""
    sink = jnp.broadcast_to(sink_H.astype(jnp.float32)[:, None], (*logits[0].shape[:-1], 1))
    m = jnp.max(jnp.concatenate([*logits, sink], axis=-1), axis=-1, keepdims=True)
    probs = [jnp.exp(s - m) for s in logits]
    return probs, jnp.exp(sink - m) + sum(jnp.sum(p, axis=-1, keepdims=True) for p in probs)
