"""MoE router of V4.1 (spec §2.8) fused: gate GEMM, sqrt(softplus) scores, selection bias, top-k,
renormalisation x routed scale -> expert ids [T, k] (int32) and combine weights [T, k] (float32).

The bias only selects; weights come from the unbiased scores. Ties select the lower expert id.
Kernel: one program per block of tokens; the GEMM runs over D in chunks into per-expert-tile float32
accumulators (E = 384 is not a power of two, so the experts are held as tiles), then k passes of
row max -> lowest matching id -> mask, with no sort.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.common import product_precision
from pallas_kernels.dispatch import interpret_default, resolve_impl

RENORM_EPS = 1e-20


def _check(x_TD, w_ED, bias_E, top_k):
    if x_TD.ndim != 2 or w_ED.ndim != 2 or x_TD.shape[1] != w_ED.shape[1]:
        raise ValueError(f"x_TD {x_TD.shape} and w_ED {w_ED.shape} must share D")
    if bias_E.shape != (w_ED.shape[0],):
        raise ValueError(f"bias_E: expected [{w_ED.shape[0]}], got {bias_E.shape}")
    if not 0 < top_k <= w_ED.shape[0]:
        raise ValueError(f"top_k {top_k} must be in 1..{w_ED.shape[0]}")


def _gate_logits(x_TD, w_ED):
    return jnp.einsum("td,ed->te", x_TD.astype(w_ED.dtype), w_ED, preferred_element_type=jnp.float32,
                      precision=product_precision(w_ED.dtype))


def reference(x_TD, w_ED, bias_E, *, top_k: int, scaling: float):
    """The spec with a stable descending sort for the selection."""
    _check(x_TD, w_ED, bias_E, top_k)
    s = jnp.sqrt(jax.nn.softplus(_gate_logits(x_TD, w_ED)))
    ids = jnp.argsort(-(s + bias_E), axis=-1, stable=True)[:, :top_k].astype(jnp.int32)
    w = jnp.take_along_axis(s, ids, axis=-1)
    return ids, w / (jnp.sum(w, axis=-1, keepdims=True) + RENORM_EPS) * scaling


def xla(x_TD, w_ED, bias_E, *, top_k: int, scaling: float):
    """CPU path: XLA's TopK (ids consumed whole so no full sort is emitted)."""
    _check(x_TD, w_ED, bias_E, top_k)
    s = jnp.sqrt(jax.nn.softplus(_gate_logits(x_TD, w_ED)))
    _, ids = jax.lax.top_k(s + bias_E, top_k)
    w = jnp.take_along_axis(s, ids, axis=-1)
    return ids.astype(jnp.int32), w / (jnp.sum(w, axis=-1, keepdims=True) + RENORM_EPS) * scaling


def _pow2_divisor(n: int, cap: int) -> int:
    b = 1
    while b * 2 <= cap and n % (b * 2) == 0:
        b *= 2
    return b


def _softplus(x):
    """max(x, 0) + log1p(exp(-|x|)), with log1p's small-argument series (Triton has no log1p rule)."""
    e = jnp.exp(-jnp.abs(x))
    return jnp.maximum(x, 0.0) + jnp.where(e < 1e-4, e * (1.0 - 0.5 * e), jnp.log(1.0 + e))


def _router_kernel(x_ref, w_ref, bias_ref, ids_ref, wt_ref, *, E, block_e, block_d, top_k, kp, scaling):
    D = x_ref.shape[1]
    n_e = E // block_e
    cdt = w_ref.dtype
    prec = product_precision(cdt)

    def gemm_chunk(c, accs):
        xc = x_ref[:, pl.ds(c * block_d, block_d)].astype(cdt)
        return tuple(acc + jax.lax.dot_general(
            xc, w_ref[pl.ds(e * block_e, block_e), pl.ds(c * block_d, block_d)], (((1,), (1,)), ((), ())),
            precision=prec, preferred_element_type=jnp.float32) for e, acc in enumerate(accs))

    bt = x_ref.shape[0]
    accs = jax.lax.fori_loop(0, D // block_d, gemm_chunk,
                             tuple(jnp.zeros((bt, block_e), jnp.float32) for _ in range(n_e)))
    scores = [jnp.sqrt(_softplus(a)) for a in accs]
    sel = [s + bias_ref[pl.ds(e * block_e, block_e)][None, :] for e, s in enumerate(scores)]
    lane = jnp.arange(block_e)[None, :]
    slot = jnp.arange(kp)[None, :]
    ids = jnp.zeros((bt, kp), jnp.int32)
    wts = jnp.zeros((bt, kp), jnp.float32)
    for i in range(top_k):
        mx = functools.reduce(jnp.maximum, [jnp.max(v, axis=1) for v in sel])
        at = functools.reduce(jnp.minimum, [jnp.min(jnp.where(v == mx[:, None], lane + e * block_e, E), axis=1)
                                            for e, v in enumerate(sel)])
        w = functools.reduce(jnp.add, [jnp.sum(jnp.where(lane + e * block_e == at[:, None], s, 0.0), axis=1)
                                       for e, s in enumerate(scores)])
        sel = [jnp.where(lane + e * block_e == at[:, None], -jnp.inf, v) for e, v in enumerate(sel)]
        ids = jnp.where(slot == i, at[:, None], ids)
        wts = jnp.where(slot == i, w[:, None], wts)
    ids_ref[...] = ids
    wt_ref[...] = wts / (jnp.sum(wts, axis=1, keepdims=True) + RENORM_EPS) * scaling


def pallas(x_TD, w_ED, bias_E, *, top_k: int, scaling: float, block_t: int = 16, num_warps: int = 4,
           num_stages: int = 2, interpret: bool | None = None):
    """Pallas Triton kernel over blocks of `block_t` tokens (tokens padded up to a multiple)."""
    _check(x_TD, w_ED, bias_E, top_k)
    T, D = x_TD.shape
    E = w_ED.shape[0]
    block_e, block_d = _pow2_divisor(E, 128), _pow2_divisor(D, 256)
    kp = 1 << (top_k - 1).bit_length()
    Tp = -(-T // block_t) * block_t
    x = jnp.pad(x_TD, ((0, Tp - T), (0, 0)))
    kernel = functools.partial(_router_kernel, E=E, block_e=block_e, block_d=block_d, top_k=top_k, kp=kp,
                               scaling=scaling)
    ids, wts = pl.pallas_call(
        kernel, grid=(Tp // block_t,),
        out_shape=[jax.ShapeDtypeStruct((Tp, kp), jnp.int32), jax.ShapeDtypeStruct((Tp, kp), jnp.float32)],
        in_specs=[pl.BlockSpec((block_t, D), lambda i: (i, 0)), pl.BlockSpec((E, D), lambda i: (0, 0)),
                  pl.BlockSpec((E,), lambda i: (0,))],
        out_specs=[pl.BlockSpec((block_t, kp), lambda i: (i, 0))] * 2,
        interpret=interpret_default() if interpret is None else interpret, name="router_topk",
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages))(x, w_ED, bias_E.astype(jnp.float32))
    return ids[:T, :top_k], wts[:T, :top_k]


def route(x_TD, w_ED, bias_E, *, top_k: int, scaling: float, impl: str = "auto"):
    """Expert ids [T, top_k] and combine weights [T, top_k] through the chosen implementation."""
    fn = {"reference": reference, "xla": xla, "pallas": pallas}[resolve_impl(impl)]
    return fn(x_TD, w_ED, bias_E, top_k=top_k, scaling=scaling)
