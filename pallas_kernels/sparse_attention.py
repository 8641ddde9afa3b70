"""Sparse MLA attention of V4.1 (spec §2.5) fused: query RoPE, attention over each query's SWA window and
its top-k global rows (gathered by index from the paged cache, `pallas_kernels.paged`, records decoded in
the kernel, -1 skipped), the per-head sink, inverse RoPE on the output and an optional FP8 cast for the
grouped output projection.

All heads share one K=V latent per row, so a program holds a block of heads as the M side of two small
GEMMs (scores q k^T, output p v) and reads every key row once for those heads.

Inputs, for T query rows of R requests (each request's rows in position order):
  q_THd       un-rotated queries;  cos_Tr, sin_Tr [T, d_r/2]: RoPE angles at each query's position
  sink_H      per-head sink logit (joins the softmax denominator only)
  kv_Td       this call's own SWA rows (RoPE'd, float): each request's rows from its `start` position on,
              consecutive; the query at row t finds its own position's row at meta.kv_row_T[t] (default t).
              The rows may be a superset of the queries' (a layer that runs on a subset of a step's rows
              still reads the window rows of the whole step).
  ring_SWx    per-slot SWA ring (W a power of two): slot entry k holds the latest position < start that
              is congruent to k mod W; FP8 records (uint8 [.., d + d/32]) or float rows [.., d]
  meta        AttnMeta below
  rows_NPx    paged global rows [num_blocks, rows_per_block, .]: NVFP4 records (uint8) or float rows
  topk_TK     distinct global row ids per query (-1 = none), as the indexer returns them (the XLA path's block
              scan reads the selection as a set)
Visible SWA positions of a query at p: max(p - W + 1, floor, 0) .. p; those >= start come from kv_Td.
Output: [T, H, d] in `out_dtype` (default float32; the float32 values rounded once), or with out_fp8 (e4m3
[T, H*d], float32 scales [T, H*d/128]) - one UE8M0 scale per 128 channels, the activation layout a block-scaled
GEMM over [T, o_groups, H*d/o_groups] reads.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import paged, records
from pallas_kernels.common import (FP8_OUT_BLOCK, fp8_block_cast, full_width_angles, product_dtype,
                                   product_precision, rotate, rotate_tail, sink_softmax)
from pallas_kernels.dispatch import interpret_default, resolve_impl
from pallas_kernels.tiles import QueryTiles, map_tiles, plan_or_rows, tile_rows, to_flat_rows


class AttnMeta(NamedTuple):
    pos_T: jax.Array  # [T] int32 query positions
    req_T: jax.Array  # [T] int32 request of each query row
    slot_R: jax.Array  # [R] SWA ring slot
    start_R: jax.Array  # [R] first position of the request in this call (the ring holds earlier ones)
    floor_R: jax.Array  # [R] lowest visible SWA position (replay floor; 0 when none)
    block_table_RM: jax.Array  # [R, max_blocks] global-row blocks
    kv_row_T: jax.Array | None = None  # [T] row of kv_Td holding each query's own position (None: row t)
    tiles: QueryTiles | None = None  # the XLA path's work plan (None: one row per tile)
    n_blocks: jax.Array | None = None  # XLA path: global-row blocks holding any query's rows (a dynamic bound, e.g.
    #                                    the step's longest context; None: the whole block table)


def _kv_rows(meta: AttnMeta, T: int) -> jax.Array:
    return jnp.arange(T, dtype=jnp.int32) if meta.kv_row_T is None else meta.kv_row_T


def _check(q, cos, kv, ring, meta, rows, topk):
    T, H, d = q.shape
    W = ring.shape[1]
    if W & (W - 1):
        raise ValueError(f"ring_SWx: the SWA window {W} must be a power of two")
    if cos.shape != (T, cos.shape[1]) or 2 * cos.shape[1] > d:
        raise ValueError(f"cos_Tr: expected [{T}, d_r/2] with d_r <= {d}, got {cos.shape}")
    if kv.ndim != 2 or kv.shape[1] != d or (meta.kv_row_T is None and kv.shape[0] != T):
        raise ValueError(f"kv_Td: expected {(T, d)} (or [N, {d}] with meta.kv_row_T), got {kv.shape}")
    if ring.dtype == jnp.uint8:
        records.check_record("fp8", d, ring.shape[2], "ring_SWx")
    elif ring.shape[2] != d:
        raise ValueError(f"ring_SWx: float rows must have {d} channels, got {ring.shape[2]}")
    if meta.pos_T.shape != (T,) or meta.req_T.shape != (T,):
        raise ValueError(f"meta.pos_T / meta.req_T must be [{T}]")
    if meta.kv_row_T is not None and meta.kv_row_T.shape != (T,):
        raise ValueError(f"meta.kv_row_T must be [{T}], got {meta.kv_row_T.shape}")
    if (rows is None) != (topk is None):
        raise ValueError("rows_NPx and topk_TK come together")
    if rows is not None:
        if topk.shape[0] != T:
            raise ValueError(f"topk_TK: expected {T} rows, got {topk.shape}")
        if rows.dtype == jnp.uint8:
            records.check_record("nvfp4", d, rows.shape[2], "rows_NPx")
        elif rows.shape[2] != d:
            raise ValueError(f"rows_NPx: float rows must have {d} channels, got {rows.shape[2]}")


# =============================================================================== reference
def _rope_ref(x, cos, sin, inverse=False):
    """Spec §2.4: rotate adjacent pairs of the last 2 * cos.shape[-1] channels by theta (or -theta)."""
    rd = 2 * cos.shape[-1]
    nope, rot = x[..., :-rd], x[..., -rd:]
    a, b = rot[..., 0::2], rot[..., 1::2]
    sin = -sin if inverse else sin
    out = jnp.stack([a * cos - b * sin, b * cos + a * sin], axis=-1).reshape(rot.shape)
    return jnp.concatenate([nope, out], axis=-1)


def _fp8_cast_ref(o_TC, block):
    z = o_TC.reshape(o_TC.shape[0], -1, block)
    s = 2.0 ** jnp.ceil(jnp.log2(jnp.maximum(jnp.max(jnp.abs(z), axis=-1), 1e-4) / 448.0))
    q = jnp.clip(z / s[..., None], -448.0, 448.0).astype(jnp.float8_e4m3fn)
    return q.reshape(o_TC.shape), s


def _swa_keys(kv, ring, meta, d, decode_fn):
    """SWA keys [T, W, d] (float32) and their visibility [T, W] for every query row."""
    T, W = meta.pos_T.shape[0], ring.shape[1]
    o = jnp.arange(W)
    p, r = meta.pos_T, meta.req_T
    kp = p[:, None] - o[None]
    in_call = kp >= meta.start_R[r][:, None]
    own = kv.astype(jnp.float32)[jnp.clip(_kv_rows(meta, T)[:, None] - o[None], 0, kv.shape[0] - 1)]
    ring_rows = decode_fn("fp8", ring[meta.slot_R[r][:, None], jnp.mod(kp, W)], d)
    keys = jnp.where(in_call[..., None], own, ring_rows)
    return keys, kp >= jnp.maximum(meta.floor_R[r], 0)[:, None]


def reference(q_THd, cos_Tr, sin_Tr, sink_H, kv_Td, ring_SWx, meta: AttnMeta, rows_NPx=None, topk_TK=None, *,
              out_fp8: bool = False):
    """The spec, materialising every query's key set [T, W + K, d] and one softmax with a sink column."""
    _check(q_THd, cos_Tr, kv_Td, ring_SWx, meta, rows_NPx, topk_TK)
    T, H, d = q_THd.shape
    hi = jax.lax.Precision.HIGHEST
    q = _rope_ref(q_THd.astype(jnp.float32), cos_Tr[:, None], sin_Tr[:, None])
    keys, ok = _swa_keys(kv_Td, ring_SWx, meta, d, records.reference_decode)
    if rows_NPx is not None:
        g = paged.gather_rows(rows_NPx, "nvfp4", d, meta.block_table_RM, meta.req_T[:, None],
                              jnp.maximum(topk_TK, 0), records.reference_decode)
        gok = topk_TK >= 0
        keys, ok = jnp.concatenate([keys, g], axis=1), jnp.concatenate([ok, gok], axis=1)
    logits = jnp.einsum("thd,tkd->thk", q, keys, precision=hi) * d ** -0.5
    logits = jnp.where(ok[:, None], logits, -jnp.inf)
    sink = jnp.broadcast_to(sink_H.astype(jnp.float32)[None, :, None], (T, H, 1))
    probs = jax.nn.softmax(jnp.concatenate([logits, sink], axis=-1), axis=-1)[..., :-1]
    out = _rope_ref(jnp.einsum("thk,tkd->thd", probs, keys, precision=hi), cos_Tr[:, None], sin_Tr[:, None],
                    inverse=True)
    return _fp8_cast_ref(out.reshape(T, H * d), min(FP8_OUT_BLOCK, d)) if out_fp8 else out


# ===================================================================================== xla
def _fp8_out(out_THd):
    """The FP8 cast of a float32 output: e4m3 [T, H*d], scales [T, H*d/128]."""
    T, H, d = out_THd.shape
    q8, s = fp8_block_cast(out_THd, min(FP8_OUT_BLOCK, d))
    return q8.reshape(T, H * d), s.reshape(T, -1)


def xla(q_THd, cos_Tr, sin_Tr, sink_H, kv_Td, ring_SWx, meta: AttnMeta, rows_NPx=None, topk_TK=None, *,
        out_fp8: bool = False, out_dtype=jnp.float32):
    """The CPU path, per query tile (`meta.tiles`): the tile's window, the W - 1 positions before its first query
    through its last [W - 1 + size] (from the call's rows, or from the ring below the request's start), is read
    once and shared by the tile's queries (two small GEMMs per tile). The top-k rows: when a request's table
    holds at most as many rows as the tile's queries select together (size x k), the tile scans its request's
    blocks up to `meta.n_blocks`, each block decoded once for the whole tile and masked to each query's selection
    (online softmax across blocks: a dense GEMM per block instead of a gather of k rows per query, which costs
    memory bandwidth on a CPU); otherwise each query gathers its own k rows. Tiles run in vectorised groups under
    lax.map, so the gathered keys stay bounded. A tile rotates its own queries and outputs (RoPE, inverse RoPE),
    scales its queries by d^-1/2 and rounds them to the compute dtype once (as the Pallas kernel), and casts its
    outputs to `out_dtype`: at a 4,096-row prefill whole-call float32 passes over [T, H, d] cost
    more than the attention itself."""
    _check(q_THd, cos_Tr, kv_Td, ring_SWx, meta, rows_NPx, topk_TK)
    T, H, d = q_THd.shape
    W = ring_SWx.shape[1]
    cdt = product_dtype(q_THd.dtype)
    mm = functools.partial(_mm, cdt)
    scale = d ** -0.5
    tiles = plan_or_rows(meta.tiles, meta.req_T)
    kv_row = _kv_rows(meta, T)
    n_kv = kv_Td.shape[0]
    dense_rows = topk_TK is not None and (
        meta.block_table_RM.shape[1] * rows_NPx.shape[1] <= tiles.size * topk_TK.shape[1])
    n_blocks = (jnp.asarray(meta.block_table_RM.shape[1], jnp.int32) if meta.n_blocks is None
                else jnp.minimum(meta.n_blocks, meta.block_table_RM.shape[1]))
    # Where the tiles would decode more ring records than the R rings hold (a prefill: W - 1 + size per tile), each
    # request's ring is decoded once up front; decode steps (a tile per row, R >= rows) decode only what they read.
    R = meta.slot_R.shape[0]
    ring_RWd = (records.decode_rows("fp8", ring_SWx[meta.slot_R], d).astype(cdt)
                if R * W <= tiles.count * (W - 1 + tiles.size) else None)
    # Likewise a prefill's tiles each scan the same blocks of their request: each request's whole table is decoded
    # once up front where that is no more blocks than the tiles' first scan steps alone would decode (the scan
    # stops at `meta.n_blocks`, unknown here: a short prompt in a long table keeps the per-tile decode) and fits in
    # SCAN_DECODED_BYTES: faster for NVFP4 rows, no change for bf16 rows, whose decode is a cast
    # (docs/design/measurements.md).
    rows_RXd = None
    if topk_TK is not None and dense_rows:
        M, rpb = meta.block_table_RM.shape[1], rows_NPx.shape[1]
        c = _scan_blocks(M, rpb)
        steps_M = jnp.minimum(jnp.arange(-(-M // c) * c), M - 1)  # whole scan steps, clamped as the scan does
        if (R * steps_M.size <= tiles.count * c
                and R * steps_M.size * rpb * d * jnp.dtype(cdt).itemsize <= SCAN_DECODED_BYTES):
            rows_RXd = paged.decode_blocks(rows_NPx, "nvfp4", d, meta.block_table_RM[:, steps_M]).astype(cdt)
            rows_RXd = rows_RXd.reshape(R, -1, d)

    def one_tile(i):
        rows, qok = tile_rows(tiles, i, T)
        r = tiles.req_N[i]
        cos, sin = cos_Tr[rows], sin_Tr[rows]
        q = (rotate_tail(q_THd[rows].astype(jnp.float32), cos, sin) * scale).astype(cdt)  # pre-scaled, rounded once
        qpos = meta.pos_T[rows]
        # the tile's window: positions from W - 1 before its first query through its last, each read from this
        # call's rows (>= start) or from the ring (the W positions below start, at position mod W)
        first = tiles.first_N[i]
        u = jnp.arange(W - 1 + tiles.size) - (W - 1)
        kpos = meta.pos_T[first] + u
        own = kv_Td[jnp.clip(kv_row[first] + u, 0, n_kv - 1)].astype(cdt)
        ring = (ring_RWd[r, jnp.mod(kpos, W)] if ring_RWd is not None
                else records.decode_rows("fp8", ring_SWx[meta.slot_R[r], jnp.mod(kpos, W)], d).astype(cdt))
        keys = jnp.where((kpos >= meta.start_R[r])[:, None], own, ring)
        kok = (kpos >= 0) & (kpos >= meta.floor_R[r])
        vis = kok[None] & (kpos[None] <= qpos[:, None]) & (kpos[None] > qpos[:, None] - W)  # [size, W - 1 + size]
        logits = [jnp.where(vis[:, None], mm("uhd,kd->uhk", q, keys), -jnp.inf)]
        values = [keys]
        if topk_TK is not None and dense_rows:
            out, denom = _blocks_softmax(mm, q, logits[0], keys, sink_H, rows_NPx, topk_TK[rows],
                                         meta.block_table_RM[r], n_blocks, d,
                                         None if rows_RXd is None else rows_RXd[r])
            return finish(out, denom, qok, cos, sin)
        if topk_TK is not None:
            idx = topk_TK[rows]  # [size, k]
            g = paged.gather_rows(rows_NPx, "nvfp4", d, meta.block_table_RM, r, idx)  # [size, k, d]
            logits.append(jnp.where((idx >= 0)[:, None], mm("uhd,ukd->uhk", q, g), -jnp.inf))
            values.append(g)
        probs, denom = sink_softmax(logits, sink_H)
        out = mm("uhk,kd->uhd", probs[0], values[0])
        if len(probs) > 1:
            out = out + mm("uhk,ukd->uhd", probs[1], values[1])
        return finish(out, denom, qok, cos, sin)

    def finish(out, denom, qok, cos, sin):  # [u, H, d]: normalised, inverse RoPE; float32 for the FP8 cast
        out = rotate_tail(jnp.where(qok[:, None, None], out / denom, 0.0), cos, sin, inverse=True)
        return out if out_fp8 else out.astype(out_dtype)

    out = to_flat_rows(map_tiles(one_tile, tiles), tiles, T, 0.0)  # [T, H, d]
    return _fp8_out(out) if out_fp8 else out


def _mm(cdt, spec: str, a, b) -> jax.Array:
    """An einsum with operands in the compute dtype and float32 sums, as the Pallas kernel: bfloat16 queries make
    bfloat16 products (XLA:CPU runs them on AMX / AVX512-BF16 where the CPU has them), float32 ones stay exact."""
    return jnp.einsum(spec, a.astype(cdt), b.astype(cdt), precision=product_precision(cdt),
                      preferred_element_type=jnp.float32)


# Global rows one step of the XLA path's block scan reads (whole blocks): one GEMM over 128 rows instead of four
# over 32 (block size 128, CSA) costs a quarter of the online-softmax rescales of the tile's [u, H, d] accumulator.
SCAN_ROWS = 128
# A prefill's requests' global rows decoded once up front at most (else each tile decodes the blocks it scans).
SCAN_DECODED_BYTES = 64 << 20


def _scan_blocks(M: int, rpb: int) -> int:
    """Blocks per step of the block scan."""
    return max(1, min(M, SCAN_ROWS // rpb))


def _blocks_softmax(mm, q_uhd, swa_logits_uhk, swa_keys_kd, sink_H, rows_NPx, idx_uk, table_M, n_blocks, d,
                    decoded_Xd=None):
    """One tile's attention over its SWA keys and, SCAN_ROWS at a time (whole blocks) of its request's global
    rows, the rows each query selected: (unnormalised output [u, H, d], softmax denominator [u, H, 1]) with the
    sink in the denominator. `q_uhd` is pre-scaled; `mm` the einsum in the compute dtype (`_mm`); `decoded_Xd`:
    the request's rows already decoded, whole scan steps of them (else each step decodes its blocks)."""
    u, rpb = idx_uk.shape[0], rows_NPx.shape[1]
    M = table_M.shape[0]
    c = _scan_blocks(M, rpb)
    n_rows = -(-M // c) * c * rpb  # the selection padded to whole steps (nothing selected past the table)
    selected = jnp.zeros((u, n_rows + 1), jnp.bool_).at[jnp.arange(u)[:, None], jnp.where(
        idx_uk >= 0, idx_uk, n_rows)].set(True)[:, :n_rows]
    sink = jnp.broadcast_to(sink_H.astype(jnp.float32), swa_logits_uhk.shape[:2])
    m = jnp.maximum(jnp.max(swa_logits_uhk, axis=-1), sink)
    p = jnp.exp(swa_logits_uhk - m[..., None])
    state = (m, jnp.exp(sink - m) + jnp.sum(p, axis=-1), mm("uhk,kd->uhd", p, swa_keys_kd))

    def step(b, state):
        m, l, acc = state
        j = b * c + jnp.arange(c)
        g = (paged.decode_blocks(rows_NPx, "nvfp4", d, table_M[jnp.minimum(j, M - 1)]).reshape(c * rpb, d)
             if decoded_Xd is None else jax.lax.dynamic_slice_in_dim(decoded_Xd, b * c * rpb, c * rpb))
        ok = jax.lax.dynamic_slice_in_dim(selected, b * c * rpb, c * rpb, axis=1) & jnp.repeat(j < n_blocks, rpb)
        s = jnp.where(ok[:, None], mm("uhd,kd->uhk", q_uhd, g), -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        alpha, p = jnp.exp(m - m_new), jnp.exp(s - m_new[..., None])
        return m_new, l * alpha + jnp.sum(p, axis=-1), acc * alpha[..., None] + mm("uhk,kd->uhd", p, g)

    _, l, acc = jax.lax.fori_loop(0, -(-n_blocks // c), step, state)
    return acc, l[..., None]


# ================================================================================== pallas
def _whole(shape):
    """BlockSpec of a whole array (Triton: a pointer; only what the kernel indexes is loaded)."""
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


def _attention_kernel(pos_ref, req_ref, kvrow_ref, slot_ref, start_ref, floor_ref, bt_ref, q_ref, cos_ref, sin_ref,
                      sink_ref, kv_ref, ring_ref, *refs, d, W, block_k, n_topk_chunks, splits, has_rows, out_fp8):
    if has_rows:
        rows_ref, topk_ref, *out_refs = refs
    else:
        out_refs = list(refs)
    t, s = pl.program_id(0), pl.program_id(2)
    p, r, own = pos_ref[t], req_ref[t], kvrow_ref[t]
    slot, start, lo = slot_ref[r], start_ref[r], jnp.maximum(floor_ref[r], 0)
    cos, sin = cos_ref[...], sin_ref[...]
    cdt = product_dtype(q_ref.dtype)
    prec = product_precision(cdt)
    q = (rotate(q_ref[...].astype(jnp.float32), cos, sin) * d ** -0.5).astype(cdt)  # [bh, d]

    def update(carry, keys, ok):
        m, l, acc = carry
        k = keys.astype(cdt)
        sc = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=prec, preferred_element_type=jnp.float32)
        sc = jnp.where(ok[None, :], sc, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(sc, axis=1))
        alpha = jnp.exp(m - m_new)
        pr = jnp.exp(sc - m_new[:, None])
        pv = jax.lax.dot_general(pr.astype(cdt), k, (((1,), (0,)), ((), ())), precision=prec,
                                 preferred_element_type=jnp.float32)
        return m_new, l * alpha + jnp.sum(pr, axis=1), acc * alpha[:, None] + pv

    def swa_chunk(c, carry):
        o = c * block_k + jnp.arange(block_k)
        kp = p - o
        chunk = kv_ref[jnp.maximum(own - o, 0), :].astype(jnp.float32)
        ring = records.load("fp8", ring_ref, (slot, kp & (W - 1)), d)
        keys = jnp.where((kp >= start)[:, None], chunk, ring)
        return update(carry, keys, kp >= lo)

    def topk_chunk(i, carry):
        idx = topk_ref[pl.ds((s * (n_topk_chunks // splits) + i) * block_k, block_k)]
        keys = paged.load_rows(rows_ref, "nvfp4", d, bt_ref, r, jnp.maximum(idx, 0))
        return update(carry, keys, idx >= 0)

    bh = q.shape[0]
    sink = sink_ref[...].astype(jnp.float32)
    first = s == 0
    one, zero = jnp.ones((bh,), jnp.float32), jnp.zeros((bh,), jnp.float32)
    carry = (jnp.where(first, sink, zero - 1e30), jnp.where(first, one, zero), jnp.zeros((bh, d), jnp.float32))
    swa = lambda c: jax.lax.fori_loop(0, W // block_k, swa_chunk, c)
    carry = swa(carry) if splits == 1 else jax.lax.cond(first, swa, lambda c: c, carry)
    if has_rows:
        carry = jax.lax.fori_loop(0, n_topk_chunks // splits, topk_chunk, carry)
    m, l, acc = carry
    if splits > 1:  # partial softmax state; combined outside
        m_ref, l_ref, acc_ref = out_refs
        m_ref[...], l_ref[...], acc_ref[...] = m, l, acc
        return
    out = rotate(acc / l[:, None], cos, sin, inverse=True)
    if out_fp8:
        o8_ref, scale_ref = out_refs
        o8_ref[...], scale_ref[...] = fp8_block_cast(out, min(FP8_OUT_BLOCK, d))
    else:
        out_refs[0][...] = out


def pallas(q_THd, cos_Tr, sin_Tr, sink_H, kv_Td, ring_SWx, meta: AttnMeta, rows_NPx=None, topk_TK=None, *,
           out_fp8: bool = False, splits: int = 1, block_h: int | None = None, block_k: int = 32,
           num_warps: int = 8, num_stages: int = 2, interpret: bool | None = None):
    """Pallas Triton kernel, one program per (query row, head block, key split).

    splits > 1 is the decode (flash-decoding) form: the top-k chunks are divided over `splits` programs
    whose partial softmax states are merged in XLA; SWA rows go to split 0. block_h = H reads each key row
    once for all heads."""
    _check(q_THd, cos_Tr, kv_Td, ring_SWx, meta, rows_NPx, topk_TK)
    T, H, d = q_THd.shape
    W = ring_SWx.shape[1]
    block_h = block_h or H
    block_k = min(block_k, W)
    if H % block_h or W % block_k:
        raise ValueError(f"block_h {block_h} must divide H {H} and block_k {block_k} the window {W}")
    interpret = interpret_default() if interpret is None else interpret
    cos, sin = full_width_angles(cos_Tr, sin_Tr, d)
    has_rows = rows_NPx is not None
    n_chunks = 0
    args = [meta.pos_T, meta.req_T, _kv_rows(meta, T), meta.slot_R, meta.start_R, meta.floor_R, meta.block_table_RM]
    specs = [_whole(a.shape) for a in args]
    args += [q_THd, cos, sin, sink_H, kv_Td, ring_SWx]
    specs += [pl.BlockSpec((None, block_h, d), lambda t, h, s: (t, h, 0)),
              pl.BlockSpec((None, d), lambda t, h, s: (t, 0)), pl.BlockSpec((None, d), lambda t, h, s: (t, 0)),
              pl.BlockSpec((block_h,), lambda t, h, s: (h,)), _whole(kv_Td.shape), _whole(ring_SWx.shape)]
    if has_rows:
        per = block_k * splits
        K = -(-topk_TK.shape[1] // per) * per
        topk = jnp.pad(topk_TK.astype(jnp.int32), ((0, 0), (0, K - topk_TK.shape[1])), constant_values=-1)
        n_chunks = K // block_k
        args += [rows_NPx, topk]
        specs += [_whole(rows_NPx.shape), pl.BlockSpec((None, K), lambda t, h, s: (t, 0))]
    elif splits != 1:
        raise ValueError("splits > 1 needs top-k rows to split")
    if splits > 1:
        out_shape = [jax.ShapeDtypeStruct((T, splits, H), jnp.float32)] * 2 + [
            jax.ShapeDtypeStruct((T, splits, H, d), jnp.float32)]
        out_specs = [pl.BlockSpec((None, None, block_h), lambda t, h, s: (t, s, h))] * 2 + [
            pl.BlockSpec((None, None, block_h, d), lambda t, h, s: (t, s, h, 0))]
    elif out_fp8:
        fb = min(FP8_OUT_BLOCK, d)
        out_shape = [jax.ShapeDtypeStruct((T, H, d), jnp.float8_e4m3fn),
                     jax.ShapeDtypeStruct((T, H, d // fb), jnp.float32)]
        out_specs = [pl.BlockSpec((None, block_h, d), lambda t, h, s: (t, h, 0)),
                     pl.BlockSpec((None, block_h, d // fb), lambda t, h, s: (t, h, 0))]
    else:
        out_shape = [jax.ShapeDtypeStruct((T, H, d), jnp.float32)]
        out_specs = [pl.BlockSpec((None, block_h, d), lambda t, h, s: (t, h, 0))]
    kernel = functools.partial(_attention_kernel, d=d, W=W, block_k=block_k, n_topk_chunks=n_chunks, splits=splits,
                               has_rows=has_rows, out_fp8=out_fp8)
    outs = pl.pallas_call(kernel, out_shape=out_shape, grid=(T, H // block_h, splits), in_specs=specs,
                          out_specs=out_specs, interpret=interpret, name="sparse_mla",
                          compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages))(*args)
    if splits == 1:
        return (outs[0].reshape(T, H * d), outs[1].reshape(T, -1)) if out_fp8 else outs[0]
    m, l, acc = outs  # merge the splits' softmax states
    mx = jnp.max(m, axis=1, keepdims=True)
    w = jnp.exp(m - mx)
    out = rotate_tail(jnp.sum(w[..., None] * acc, axis=1) / jnp.sum(w * l, axis=1)[..., None], cos_Tr, sin_Tr,
                      inverse=True)
    return _fp8_out(out) if out_fp8 else out


# ================================================================================ dispatch
def sparse_mla(q_THd, cos_Tr, sin_Tr, sink_H, kv_Td, ring_SWx, meta: AttnMeta, rows_NPx=None, topk_TK=None, *,
               out_fp8: bool = False, out_dtype=jnp.float32, decode: bool = False, impl: str = "auto"):
    """Fused sparse MLA attention (module docstring). `decode` picks the split-key Pallas form for one
    query row per request; prefill splits heads instead. `out_dtype`: the float output's dtype (its float32
    values rounded once; the consumer's dtype, so the op writes no float32 [T, H, d] it would round anyway)."""
    impl = resolve_impl(impl)
    args = (q_THd, cos_Tr, sin_Tr, sink_H, kv_Td, ring_SWx, meta, rows_NPx, topk_TK)
    if impl == "xla":
        return xla(*args, out_fp8=out_fp8, out_dtype=out_dtype)
    if impl == "reference":
        out = reference(*args, out_fp8=out_fp8)
    elif decode and topk_TK is not None:
        out = pallas(*args, out_fp8=out_fp8, splits=max(1, min(4, topk_TK.shape[1] // 32)), block_h=q_THd.shape[1])
    else:
        out = pallas(*args, out_fp8=out_fp8, block_h=min(q_THd.shape[1], 16))
    return out if out_fp8 else out.astype(out_dtype)
