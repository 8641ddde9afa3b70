"""Routed experts of the V4.1 MoE FFN (spec §2.8) as a grouped matmul over expert-sorted rows:

  y[t] = sum_j w[t, j] * W2_e (silu(min(W1_e x_t, L)) * clamp(W3_e x_t, -L, L)),   e = ids[t, j]

Inputs: x_TD [T, D]; ids_TK [T, k] expert ids and weights_TK [T, k] (the router's outputs); w1, w3
[E, I, D] (gate, up) and w2 [E, D, I] (down) in the model's `Experts` layout, each a float array or a
`QuantizedExperts` (MXFP4 / FP8 records, see expert_weights). An id outside [0, E) contributes nothing
(padding tokens; an expert-parallel shard passes ids minus its first expert). Output float32 [T, D] (or
`out_dtype`).

Numerics follow the model: matmuls in the compute dtype (the float weights' dtype; x's dtype for quantized
weights, whose decoded values are exact in bf16) with float32 accumulation, SwiGLU in float32, the combine
weight applied to h before the down projection (h rounded to the compute dtype), the k contributions
summed in float32.

Grouped layout (pallas and the XLA tile form, `moe_xla.group_layout`): the T*k (token, slot) pairs are ordered by
expert with one argsort of T*k keys, each expert's group is padded to a multiple of `tile` rows so that every tile
belongs to one expert, and the static row count is T*k + min(E, T*k) * (tile - 1) rounded up to a tile. Tiles past
the last group are skipped. Each output row is gathered back from its k rows (no scatter-add over D). The XLA
path's batched form (float weights on CPU) gives every expert a fixed number of rows instead (see `moe_xla.xla`).

Here: the reference, the Pallas kernels and the dispatch. The CPU path (`xla`) and the layout and checks both
paths share are in `pallas_kernels.moe_xla`.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import moe_xla
from pallas_kernels.common import product_precision
from pallas_kernels.dispatch import interpret_default, resolve_impl
from pallas_kernels.expert_weights import QuantizedExperts, decode_tile, reference_dequantize
from pallas_kernels.moe_xla import check_operands, combine, compute_dtype, group_layout, sorted_rows, swiglu
from pallas_kernels.tile_table import KernelChoice, Tiles

MIN_DOT = 16  # Triton's smallest dot dimension


# ================================================================================ reference
def reference(x_TD, ids_TK, weights_TK, w1, w3, w2, *, limit: float, out_dtype=jnp.float32):
    """Dense over each (token, slot): the selected experts' weights gathered per pair, float32 sums."""
    check_operands(x_TD, ids_TK, weights_TK, w1, w3, w2)
    E = w1.shape[0]
    cdt = compute_dtype(x_TD, w1)
    prec = product_precision(cdt)
    ok = (ids_TK >= 0) & (ids_TK < E)
    e = jnp.where(ok, ids_TK, 0)
    W1, W3, W2 = (reference_dequantize(w).astype(cdt) if isinstance(w, QuantizedExperts) else w for w in (w1, w3, w2))
    x = x_TD.astype(cdt)
    mm = functools.partial(jnp.einsum, preferred_element_type=jnp.float32, precision=prec)
    h = swiglu(mm("td,tkid->tki", x, W1[e]), mm("td,tkid->tki", x, W3[e]), limit)
    h = (h * jnp.where(ok, weights_TK.astype(jnp.float32), 0.0)[..., None]).astype(cdt)
    return jnp.sum(mm("tki,tkdi->tkd", h, W2[e]), axis=1).astype(out_dtype)


# ================================================================================== pallas
def rows_per_tile(n_pairs: int, n_experts: int, lo: int, hi: int) -> int:
    """The power of two nearest below the mean rows per expert, within [lo, hi] (the Pallas path's block rows)."""
    per_expert = max(1, n_pairs // n_experts)
    return min(hi, max(lo, 1 << (per_expert.bit_length() - 1)))


class _Fmt(NamedTuple):
    """Static description of one weight operand: kind None = float array (one ref), else values + scales."""
    kind: str | None
    block: tuple[int, int]

    @property
    def n_refs(self) -> int:
        return 1 if self.kind is None else 2


def _fmt(w) -> _Fmt:
    return _Fmt(w.kind, w.block) if isinstance(w, QuantizedExperts) else _Fmt(None, (1, 1))


def _operands(w) -> list:
    return [w.values, w.scales] if isinstance(w, QuantizedExperts) else [w]


def _whole(shape):
    """BlockSpec of a whole array (Triton: a pointer; only what the kernel indexes is loaded)."""
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


def _weight_tile(refs, fmt: _Fmt, e, j, c, bn: int, bk: int, cdt):
    """Expert e's weight tile [bn, bk] at row block j, input chunk c, decoded in registers to `cdt`."""
    if fmt.kind is None:
        return refs[0][e, pl.ds(j * bn, bn), pl.ds(c * bk, bk)].astype(cdt)
    v_ref, s_ref = refs
    b0, b1 = fmt.block
    vk = bk // 2 if fmt.kind == "mxfp4" else bk
    v = v_ref[e, pl.ds(j * bn, bn), pl.ds(c * vk, vk)]
    s = s_ref[e, pl.ds(j * (bn // b0), bn // b0), pl.ds(c * (bk // b1), bk // b1)]
    return decode_tile(fmt.kind, v, s, fmt.block).astype(cdt)


def _tile_dot(a, w, prec):
    """a [m, bk] @ w [bn, bk]^T, float32 accumulation."""
    return jax.lax.dot_general(a, w, (((1,), (1,)), ((), ())), precision=prec, preferred_element_type=jnp.float32)


def _gate_up_kernel(tile_expert_ref, n_tiles_ref, x_ref, rw_ref, *refs, fmt1, fmt3, bn, bk, limit, prec):
    """h[rows of tile i, block j] = swiglu(x W1_e^T, x W3_e^T) * w_row, e the tile's expert."""
    w1_refs, w3_refs, h_ref = refs[:fmt1.n_refs], refs[fmt1.n_refs:-1], refs[-1]
    i, j = pl.program_id(0), pl.program_id(1)

    @pl.when(i < n_tiles_ref[0])
    def _():
        e = tile_expert_ref[i]
        cdt = h_ref.dtype

        def chunk(c, acc):
            xc = x_ref[:, pl.ds(c * bk, bk)]
            return (acc[0] + _tile_dot(xc, _weight_tile(w1_refs, fmt1, e, j, c, bn, bk, cdt), prec),
                    acc[1] + _tile_dot(xc, _weight_tile(w3_refs, fmt3, e, j, c, bn, bk, cdt), prec))

        zero = jnp.zeros((x_ref.shape[0], bn), jnp.float32)
        gate, up = jax.lax.fori_loop(0, x_ref.shape[1] // bk, chunk, (zero, zero))
        h_ref[...] = (swiglu(gate, up, limit) * rw_ref[...][:, None]).astype(cdt)


def _down_kernel(tile_expert_ref, n_tiles_ref, h_ref, *refs, fmt2, bn, bk, prec):
    """y[rows of tile i, block j] = h W2_e^T, float32."""
    w2_refs, y_ref = refs[:-1], refs[-1]
    i, j = pl.program_id(0), pl.program_id(1)

    @pl.when(i < n_tiles_ref[0])
    def _():
        e = tile_expert_ref[i]

        def chunk(c, acc):
            return acc + _tile_dot(h_ref[:, pl.ds(c * bk, bk)],
                                   _weight_tile(w2_refs, fmt2, e, j, c, bn, bk, h_ref.dtype), prec)

        y_ref[...] = jax.lax.fori_loop(0, h_ref.shape[1] // bk, chunk,
                                       jnp.zeros((h_ref.shape[0], bn), jnp.float32))


def _pow2_divisor(n: int, cap: int) -> int:
    b = 1
    while b * 2 <= cap and n % (b * 2) == 0:
        b *= 2
    return b


def _blocks(name: str, out_dim: int, in_dim: int, fmts: list[_Fmt], block_n: int, block_k: int) -> tuple[int, int]:
    """Power-of-two (rows, input chunk) dividing the weight, whole quantization blocks (grown to a block
    when it is larger, e.g. FP8 128 x 128), Triton-sized."""
    bn = _pow2_divisor(out_dim, max([block_n] + [f.block[0] for f in fmts]))
    bk = _pow2_divisor(in_dim, max([block_k] + [f.block[1] for f in fmts]))
    for f in fmts:
        if bn % f.block[0] or bk % f.block[1]:
            raise ValueError(f"{name}: tile {bn} x {bk} does not hold whole {f.kind} scale blocks {f.block}")
    if min(bn, bk) < MIN_DOT:
        raise ValueError(f"{name}: dims [{out_dim}, {in_dim}] allow only a {bn} x {bk} tile (Triton needs >= 16)")
    return bn, bk


def tiles_for(w1, w3, w2, block_n: int = 64, block_k: int = 128) -> tuple[tuple[int, int], tuple[int, int]]:
    """The (rows, input chunk) tiles of the gate/up kernel (w1, w3) and the down kernel (w2), for arrays or
    `QuantizedExperts` (of arrays or shape structs); ValueError naming why a tile cannot hold whole scale blocks or
    fit Triton."""
    _, I, D = w1.shape
    return (_blocks("w1/w3", I, D, [_fmt(w1), _fmt(w3)], block_n, block_k),
            _blocks("w2", D, I, [_fmt(w2)], block_n, block_k))


def pallas(x_TD, ids_TK, weights_TK, w1, w3, w2, *, limit: float, out_dtype=jnp.float32, block_m: int | None = None,
           block_n: int = 64, block_k: int = 128, num_warps: int = 4, num_stages: int = 2,
           interpret: bool | None = None):
    """Two Pallas Triton kernels over (row tile, output block): gate/up + SwiGLU -> h [Np, I], then down ->
    y [Np, D]; each program reads its tile's expert id and walks the input dim in `block_k` chunks, decoding
    quantized weight tiles in registers. Sorting, row gather and the final combine are XLA. Default
    block_m: 16 rows (Triton's smallest dot) for decode batches, up to 64 when experts get many rows (at
    most half the mean rows per expert, so padding stays near a quarter of the rows). block_n x block_k
    = 64 x 128 keeps two decoded weight tiles within 4 warps' registers (the untuned defaults; a device's tuned
    tiles come from `serving.bench.autotune` through `routed_experts`' choice)."""
    check_operands(x_TD, ids_TK, weights_TK, w1, w3, w2)
    T, D = x_TD.shape
    k, (E, I) = ids_TK.shape[1], w1.shape[:2]
    cdt = compute_dtype(x_TD, w1)
    prec = product_precision(cdt)
    bm = block_m or rows_per_tile(ids_TK.size // 2, E, MIN_DOT, 64)  # padding ~<= 25% of the rows
    if bm < MIN_DOT or bm & (bm - 1):
        raise ValueError(f"block_m {bm} must be a power of two >= {MIN_DOT}")
    f1, f3, f2 = _fmt(w1), _fmt(w3), _fmt(w2)
    (bn1, bk1), (bn2, bk2) = tiles_for(w1, w3, w2, block_n, block_k)
    interpret = interpret_default() if interpret is None else interpret
    params = plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)

    layout = group_layout(ids_TK, E, bm)
    xs, rw = sorted_rows(x_TD.astype(cdt), weights_TK, layout)
    Np = xs.shape[0]
    meta = [layout.tile_expert, layout.n_tiles]
    meta_specs = [_whole(a.shape) for a in meta]
    w13 = _operands(w1) + _operands(w3)
    h = pl.pallas_call(
        functools.partial(_gate_up_kernel, fmt1=f1, fmt3=f3, bn=bn1, bk=bk1, limit=limit, prec=prec),
        grid=(Np // bm, I // bn1), out_shape=jax.ShapeDtypeStruct((Np, I), cdt),
        in_specs=meta_specs + [pl.BlockSpec((bm, D), lambda i, j: (i, 0)), pl.BlockSpec((bm,), lambda i, j: (i,))]
        + [_whole(a.shape) for a in w13],
        out_specs=pl.BlockSpec((bm, bn1), lambda i, j: (i, j)),
        interpret=interpret, name="moe_gate_up", compiler_params=params)(*meta, xs, rw, *w13)
    w2_ops = _operands(w2)
    y = pl.pallas_call(
        functools.partial(_down_kernel, fmt2=f2, bn=bn2, bk=bk2, prec=prec),
        grid=(Np // bm, D // bn2), out_shape=jax.ShapeDtypeStruct((Np, D), jnp.float32),
        in_specs=meta_specs + [pl.BlockSpec((bm, I), lambda i, j: (i, 0))] + [_whole(a.shape) for a in w2_ops],
        out_specs=pl.BlockSpec((bm, bn2), lambda i, j: (i, j)),
        interpret=interpret, name="moe_down", compiler_params=params)(*meta, h, *w2_ops)
    return combine(y, layout, T, k, out_dtype)


# ================================================================================ dispatch
def routed_experts(x_TD, ids_TK, weights_TK, w1, w3, w2, *, limit: float, out_dtype=jnp.float32,
                   impl: str = "auto", small_steps: str = "rule", choice: KernelChoice | None = None):
    """sum_j weights[t, j] * expert_{ids[t, j]}(x_t) [T, D] through the chosen implementation (`small_steps`: the
    XLA path's form for steps of few rows per expert, see `moe_xla.xla`; `choice`: a device's tuned implementation
    and tiles for this shape, taken under auto, its tiles only under "pallas")."""
    if impl == "auto" and choice is not None:
        impl = choice.impl
    impl = resolve_impl(impl)
    if impl == "xla":
        return moe_xla.xla(x_TD, ids_TK, weights_TK, w1, w3, w2, limit=limit, out_dtype=out_dtype,
                           small_steps=small_steps)
    if impl == "reference":
        return reference(x_TD, ids_TK, weights_TK, w1, w3, w2, limit=limit, out_dtype=out_dtype)
    tiles = choice.tiles if choice is not None and choice.impl == "pallas" else Tiles()
    return pallas(x_TD, ids_TK, weights_TK, w1, w3, w2, limit=limit, out_dtype=out_dtype, **tiles.kwargs())
