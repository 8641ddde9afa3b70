"""Manifold-constrained hyper-connections (mHC, spec §2.3): n residual streams per token.

Per sublayer, `HyperConnection` computes from its input streams R [T, n, D] three mixes: `pre` [T, n]
(collapse weights), `post` [T, n] (how the sublayer output is written back) and a doubly-stochastic
`comb` [T, n, n] (Sinkhorn) mixing the streams. V4 collapses a sublayer's input with its own `pre`; V4.1
("delayed pre") with the previous sublayer's, which the model threads through (`model.py`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41.layers.basic import matmul_precision
from pallas_kernels.mhc import stream_mix


class HcMix(NamedTuple):
    pre: jax.Array  # [T, n] float32
    post: jax.Array  # [T, n] float32
    comb: jax.Array  # [T, n, n] float32, comb[i, j]: weight of input stream i in output stream j


class HyperConnection(nnx.Module):
    """Release tensors hc_{attn,ffn}_{fn [(2+n)n, nD], base [(2+n)n], scale [3]} (float32)."""

    def __init__(self, n: int, dim: int, *, sinkhorn_iters: int, hc_eps: float, rms_eps: float):
        k = (2 + n) * n
        self.fn = nnx.Param(jnp.zeros((k, n * dim), jnp.float32))
        self.base = nnx.Param(jnp.zeros((k,), jnp.float32))
        self.scale = nnx.Param(jnp.ones((3,), jnp.float32))
        self.n, self.sinkhorn_iters, self.hc_eps, self.rms_eps = n, sinkhorn_iters, hc_eps, rms_eps

    def __call__(self, R_TnD: jax.Array) -> HcMix:
        n = self.n
        r = R_TnD.reshape(R_TnD.shape[0], -1).astype(jnp.float32)
        # The unweighted RMS of the flattened streams is folded in after the GEMM (same value).
        m = jnp.einsum("tk,ck->tc", r, self.fn[...], precision=matmul_precision(jnp.float32))
        m = m * jax.lax.rsqrt(jnp.mean(r * r, axis=-1, keepdims=True) + self.rms_eps)
        base, scale = self.base[...], self.scale[...]
        pre = jax.nn.sigmoid(m[:, :n] * scale[0] + base[:n]) + self.hc_eps
        post = jax.nn.sigmoid(m[:, n:2 * n] * scale[1] + base[n:2 * n]) * 2.0
        logits = m[:, 2 * n:].reshape(-1, n, n) * scale[2] + base[2 * n:].reshape(n, n)
        comb = sinkhorn(jax.nn.softmax(logits, axis=-1) + self.hc_eps, self.sinkhorn_iters, self.hc_eps)
        return HcMix(pre, post, comb)


def sinkhorn(c_Tnn: jax.Array, iters: int, eps: float) -> jax.Array:
    """Column-normalize once, then (iters - 1) x (row, column) normalizations, as the reference.

    Token-last ([n, n, T]: the sums vectorise over tokens) in a `fori_loop`: unrolled, the 39 normalizations
    of a [T, 4, 4] matrix are ~120 tiny XLA ops per mix, two mixes per layer - most of a served program's
    instructions and compile time, and an order of magnitude slower on XLA:CPU than the loop
    (docs/design/measurements.md)."""
    c = jnp.transpose(c_Tnn, (1, 2, 0))
    c = c / (jnp.sum(c, axis=0, keepdims=True) + eps)

    def row_then_column(_, c):
        c = c / (jnp.sum(c, axis=1, keepdims=True) + eps)
        return c / (jnp.sum(c, axis=0, keepdims=True) + eps)

    return jnp.transpose(jax.lax.fori_loop(0, iters - 1, row_then_column, c), (2, 0, 1))


def hc_post(R_TnD: jax.Array, mix: HcMix, y_TD: jax.Array) -> jax.Array:
    """R'_j = post_j * y + sum_i comb[i, j] R_i, float32 math, stored in R's dtype (`pallas_kernels.mhc.stream_mix`,
    whose order of terms the fused kernel shares)."""
    return stream_mix(R_TnD, y_TD, mix.post, mix.comb)


def hc_collapse(R_TnD: jax.Array, pre_Tn: jax.Array) -> jax.Array:
    """u = sum_i pre_i R_i (float32 accumulate), rounded to R's dtype before the following RMSNorm."""
    return jnp.sum(pre_Tn[..., None] * R_TnD.astype(jnp.float32), axis=1).astype(R_TnD.dtype)


class HcHead(nnx.Module):
    """V4 only: learned final collapse hc_head_{fn [n, nD], base [n], scale [1]}."""

    def __init__(self, n: int, dim: int, *, hc_eps: float, rms_eps: float):
        self.fn = nnx.Param(jnp.zeros((n, n * dim), jnp.float32))
        self.base = nnx.Param(jnp.zeros((n,), jnp.float32))
        self.scale = nnx.Param(jnp.ones((1,), jnp.float32))
        self.hc_eps, self.rms_eps = hc_eps, rms_eps

    def __call__(self, R_TnD: jax.Array) -> jax.Array:
        r = R_TnD.reshape(R_TnD.shape[0], -1).astype(jnp.float32)
        r = r * jax.lax.rsqrt(jnp.mean(r * r, axis=-1, keepdims=True) + self.rms_eps)
        m = jnp.einsum("tk,ck->tc", r, self.fn[...], precision=matmul_precision(jnp.float32))
        pre = jax.nn.sigmoid(m * self.scale[...][0] + self.base[...]) + self.hc_eps
        return hc_collapse(R_TnD, pre)
