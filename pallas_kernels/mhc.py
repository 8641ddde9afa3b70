"""mHC post + delayed-pre collapse + RMSNorm of V4.1 (spec §2.3) in one pass over the streams.

After a sublayer produced y, the streams are updated and the next sublayer's input is built from them
with the pre-mix carried in from the previous sublayer (known before this sublayer's coefficients):
  R'_j = sum_i comb[i, j] R_i + post_j * y     (float32 math, stored in R's dtype)
  u    = sum_i pre_i R'_i                       (float32 accumulate, rounded to R's dtype)
  x    = u * rsqrt(mean(u^2) + eps) * w         (float32, returned in R's dtype)
Kernel: one program per block of tokens; pass 1 walks D in chunks writing R' and u and summing u^2,
pass 2 rescales u in place: the streams are read once and written once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.dispatch import interpret_default, resolve_impl


def _check(R, y, post, comb, pre, w):
    T, n, D = R.shape
    for name, a, shape in (("y_TD", y, (T, D)), ("post_Tn", post, (T, n)), ("comb_Tnn", comb, (T, n, n)),
                           ("pre_Tn", pre, (T, n)), ("norm_w_D", w, (D,))):
        if a.shape != shape:
            raise ValueError(f"{name}: expected {shape}, got {a.shape}")


def stream_mix(R_TnD, y_TD, post_Tn, comb_Tnn) -> jax.Array:
    """R'_j = post_j * y + sum_i comb[i, j] R_i, float32 terms added in that order (the kernel's), stored in R's
    dtype. Written as n multiply-adds that XLA fuses into one pass: the batched product 'tij,tid->tjd' (n x n per
    token) ran several times slower on XLA:CPU (docs/design/measurements.md)."""
    Rf = R_TnD.astype(jnp.float32)
    mixed = post_Tn.astype(jnp.float32)[..., None] * y_TD.astype(jnp.float32)[:, None, :]
    for i in range(R_TnD.shape[1]):
        mixed = mixed + comb_Tnn.astype(jnp.float32)[:, i, :, None] * Rf[:, i, None, :]
    return mixed.astype(R_TnD.dtype)


def reference(R_TnD, y_TD, post_Tn, comb_Tnn, pre_Tn, norm_w_D, *, eps: float):
    """The spec as the unfused model computes it (`stream_mix`, collapse sum over n, rsqrt norm), op for op, so a
    model switched to this implementation gives bit-identical outputs to the unfused one."""
    _check(R_TnD, y_TD, post_Tn, comb_Tnn, pre_Tn, norm_w_D)
    R_new = stream_mix(R_TnD, y_TD, post_Tn, comb_Tnn)
    u = jnp.sum(pre_Tn[..., None] * R_new.astype(jnp.float32), axis=1).astype(R_TnD.dtype)
    uf = u.astype(jnp.float32)
    x = uf * jax.lax.rsqrt(jnp.mean(uf * uf, axis=-1, keepdims=True) + eps) * norm_w_D.astype(jnp.float32)
    return R_new, x.astype(R_TnD.dtype)


def xla(R_TnD, y_TD, post_Tn, comb_Tnn, pre_Tn, norm_w_D, *, eps: float):
    """CPU path: the reference itself. Its multiply-adds and sums over n fuse into a few passes over the streams;
    the per-token n x n products as einsums (this path before) ran several times slower on XLA:CPU (`stream_mix`)."""
    return reference(R_TnD, y_TD, post_Tn, comb_Tnn, pre_Tn, norm_w_D, eps=eps)


def _mhc_kernel(R_ref, y_ref, post_ref, comb_ref, pre_ref, w_ref, Rn_ref, x_ref, *, n, D, block_d, eps):
    bt = R_ref.shape[0]

    def stream_pass(c, ss):
        cols = pl.ds(c * block_d, block_d)
        y = y_ref[:, cols].astype(jnp.float32)
        r = [R_ref[:, i, cols].astype(jnp.float32) for i in range(n)]
        u = jnp.zeros((bt, block_d), jnp.float32)
        for j in range(n):
            new = post_ref[:, j].astype(jnp.float32)[:, None] * y
            for i in range(n):
                new = new + comb_ref[:, i, j].astype(jnp.float32)[:, None] * r[i]
            new = new.astype(Rn_ref.dtype)
            Rn_ref[:, j, cols] = new
            u = u + pre_ref[:, j].astype(jnp.float32)[:, None] * new.astype(jnp.float32)
        u = u.astype(x_ref.dtype)
        x_ref[:, cols] = u
        uf = u.astype(jnp.float32)
        return ss + jnp.sum(uf * uf, axis=1)

    ss = jax.lax.fori_loop(0, D // block_d, stream_pass, jnp.zeros((bt,), jnp.float32))
    inv = jax.lax.rsqrt(ss / D + eps)

    def norm_pass(c, carry):
        cols = pl.ds(c * block_d, block_d)
        x = x_ref[:, cols].astype(jnp.float32) * inv[:, None] * w_ref[cols].astype(jnp.float32)[None, :]
        x_ref[:, cols] = x.astype(x_ref.dtype)
        return carry

    jax.lax.fori_loop(0, D // block_d, norm_pass, 0)


def pallas(R_TnD, y_TD, post_Tn, comb_Tnn, pre_Tn, norm_w_D, *, eps: float, block_t: int = 8, block_d: int = 512,
           num_warps: int = 4, num_stages: int = 2, interpret: bool | None = None):
    """Pallas Triton kernel over blocks of `block_t` tokens (padded up to a multiple)."""
    _check(R_TnD, y_TD, post_Tn, comb_Tnn, pre_Tn, norm_w_D)
    T, n, D = R_TnD.shape
    while D % block_d:
        block_d //= 2
    Tp = -(-T // block_t) * block_t
    pad = lambda a: jnp.pad(a, ((0, Tp - T),) + ((0, 0),) * (a.ndim - 1))
    tok = lambda *rest: pl.BlockSpec((block_t, *rest), lambda i: (i,) + (0,) * len(rest))
    R_new, x = pl.pallas_call(
        functools.partial(_mhc_kernel, n=n, D=D, block_d=block_d, eps=eps), grid=(Tp // block_t,),
        out_shape=[jax.ShapeDtypeStruct((Tp, n, D), R_TnD.dtype), jax.ShapeDtypeStruct((Tp, D), R_TnD.dtype)],
        in_specs=[tok(n, D), tok(D), tok(n), tok(n, n), tok(n), pl.BlockSpec((D,), lambda i: (0,))],
        out_specs=[tok(n, D), tok(D)], interpret=interpret_default() if interpret is None else interpret,
        name="mhc_post_pre", compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
    )(pad(R_TnD), pad(y_TD), pad(post_Tn.astype(jnp.float32)), pad(comb_Tnn.astype(jnp.float32)),
      pad(pre_Tn.astype(jnp.float32)), norm_w_D)
    return R_new[:T], x[:T]


def mhc_post_pre(R_TnD, y_TD, post_Tn, comb_Tnn, pre_Tn, norm_w_D, *, eps: float, impl: str = "auto"):
    """(updated streams R' [T, n, D], normalised next-sublayer input x [T, D])."""
    fn = {"reference": reference, "xla": xla, "pallas": pallas}[resolve_impl(impl)]
    return fn(R_TnD, y_TD, post_Tn, comb_Tnn, pre_Tn, norm_w_D, eps=eps)
