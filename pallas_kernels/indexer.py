"""Lightning-indexer selection of V4.1 (spec §2.7): S(t, j) = sum_h w[t, h] * ReLU(q[t, h] . k[j]) over a
request's paged index keys, then each query's top-k rows.

Two modes:
  dense        every visible row j < n_visible[t] (index sources before the candidate source); at the
               candidate source also the top candidate blocks: blocks of `cand_block` rows scored by their
               max, the newest (possibly partial) block pinned
  candidates   only the rows of each query's candidate blocks (later index sources): work and bytes are
               flat in the context length
Ids come in descending score order, ties to the lower row id, -1 where fewer rows than k are visible.

Kernel: one program per (query, chunk of rows) gathers the chunk's keys through the block table (MXFP4
records decoded in registers), does the [heads, c] x [c, rows] GEMM, the ReLU and the head-weighted sum,
and writes the chunk's scores; the selection is XLA's TopK over those scores (no in-kernel top-k yet).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import records
from pallas_kernels.dispatch import interpret_default, resolve_impl

BIG = jnp.iinfo(jnp.int32).max


class IndexMeta(NamedTuple):
    n_visible_T: jax.Array  # [T] rows visible to each query ((pos + 1) // ratio)
    req_T: jax.Array  # [T] request of each query
    block_table_RM: jax.Array  # [R, max_blocks]


def _check(q, w, keys, meta, cand):
    T, h, c = q.shape
    if w.shape != (T, h):
        raise ValueError(f"w_Th: expected {(T, h)}, got {w.shape}")
    if keys.dtype == jnp.uint8:
        records.check_record("mxfp4", c, keys.shape[2], "keys_NPx")
    elif keys.shape[2] != c:
        raise ValueError(f"keys_NPx: float keys must have {c} channels, got {keys.shape[2]}")
    if meta.n_visible_T.shape != (T,) or meta.req_T.shape != (T,):
        raise ValueError(f"meta.n_visible_T / meta.req_T must be [{T}]")
    if cand is not None and cand.shape[0] != T:
        raise ValueError(f"candidates_TK: expected {T} rows, got {cand.shape}")


def _row_ids(meta, cand, cand_block, rpb):
    """Row ids [T, N] each query scores and whether each is eligible (visible; inside a candidate block)."""
    T = meta.req_T.shape[0]
    if cand is None:
        n = meta.block_table_RM.shape[1] * rpb
        rid = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (T, n))
        return rid, rid < meta.n_visible_T[:, None]
    cb = -jax.lax.top_k(-jnp.where(cand < 0, BIG, cand), cand.shape[1])[0]  # ascending, missing last
    rid = (cb[..., None] * cand_block + jnp.arange(cand_block)).reshape(T, -1)
    ok = jnp.repeat(cb != BIG, cand_block, axis=1) & (rid < meta.n_visible_T[:, None])
    return jnp.where(ok, rid, 0), ok


def _gather_keys(keys, meta, rid, c, decode_fn):
    rpb, M = keys.shape[1], meta.block_table_RM.shape[1]
    blk = meta.block_table_RM[meta.req_T[:, None], jnp.minimum(rid // rpb, M - 1)]
    return decode_fn("mxfp4", keys[blk, rid % rpb], c)


def _cand_blocks(scores_TN, n_visible_T, cand_block, n_blocks, select):
    T, N = scores_TN.shape
    nb = N // cand_block
    bs = jnp.max(scores_TN.reshape(T, nb, cand_block), axis=-1)
    newest = -(-n_visible_T // cand_block) - 1
    bid = jnp.arange(nb)[None]
    bs = jnp.where(bid == newest[:, None], jnp.inf, jnp.where(bid < newest[:, None], bs, -jnp.inf))
    return select(bs, jnp.broadcast_to(bid, bs.shape), min(n_blocks, nb))


def _select_sorted(scores, ids, k):
    """Reference selection: stable descending sort."""
    order = jnp.argsort(-scores, axis=-1, stable=True)[:, :k]
    v = jnp.take_along_axis(scores, order, axis=-1)
    return jnp.where(v == -jnp.inf, -1, jnp.take_along_axis(ids, order, axis=-1))


def _select_topk(scores, ids, k):
    """XLA TopK (lower position first on ties; indices used whole so no sort is emitted)."""
    v, at = jax.lax.top_k(scores, k)
    return jnp.where(v == -jnp.inf, -1, jnp.take_along_axis(ids, at, axis=-1))


def _finish(scores, rid, meta, k, cand, cand_block, n_cand_blocks, select):
    ids = select(scores, rid, min(k, scores.shape[1]))
    if cand is None and n_cand_blocks:
        return ids, _cand_blocks(scores, meta.n_visible_T, cand_block, n_cand_blocks, select)
    return ids, None


def reference(q_Thc, w_Th, keys_NPx, meta: IndexMeta, *, k: int, candidates_TK=None, cand_block: int = 8,
              n_cand_blocks: int = 0):
    """The spec: every eligible row's key gathered and scored at once, stable-sort selection."""
    _check(q_Thc, w_Th, keys_NPx, meta, candidates_TK)
    hi = jax.lax.Precision.HIGHEST
    rid, ok = _row_ids(meta, candidates_TK, cand_block, keys_NPx.shape[1])
    kk = _gather_keys(keys_NPx, meta, rid, q_Thc.shape[2], records.reference_decode)
    s = jnp.einsum("th,thn->tn", w_Th.astype(jnp.float32),
                   jax.nn.relu(jnp.einsum("thc,tnc->thn", q_Thc.astype(jnp.float32), kk, precision=hi)), precision=hi)
    s = jnp.where(ok, s, -jnp.inf)
    return _finish(s, rid, meta, k, candidates_TK, cand_block, n_cand_blocks, _select_sorted)


def xla(q_Thc, w_Th, keys_NPx, meta: IndexMeta, *, k: int, candidates_TK=None, cand_block: int = 8,
        n_cand_blocks: int = 0, tile: int = 16):
    """CPU path: scores for tiles of queries under lax.map (bounded gathered keys), XLA TopK."""
    _check(q_Thc, w_Th, keys_NPx, meta, candidates_TK)
    T, h, c = q_Thc.shape
    hi = jax.lax.Precision.HIGHEST
    rid, ok = _row_ids(meta, candidates_TK, cand_block, keys_NPx.shape[1])

    def one_tile(u):
        m = meta._replace(req_T=meta.req_T[u])
        kk = _gather_keys(keys_NPx, m, rid[u], c, records.decode_rows)
        s = jax.nn.relu(jnp.einsum("uhc,unc->uhn", q_Thc[u].astype(jnp.float32), kk, precision=hi))
        return jnp.sum(s * w_Th[u].astype(jnp.float32)[..., None], axis=1)

    n = -(-T // tile)
    u = jnp.minimum(jnp.arange(n * tile).reshape(n, tile), T - 1)
    s = jax.lax.map(one_tile, u).reshape(n * tile, -1)[:T]
    s = jnp.where(ok, s, -jnp.inf)
    return _finish(s, rid, meta, k, candidates_TK, cand_block, n_cand_blocks, _select_topk)


def _scores_kernel(q_ref, w_ref, req_ref, bt_ref, rid_ref, ok_ref, keys_ref, s_ref, *, c, block_n):
    t = pl.program_id(0)
    r = req_ref[t]
    rid, ok = rid_ref[...], ok_ref[...]
    rpb = keys_ref.shape[1]
    blk = bt_ref[r, jnp.minimum(rid // rpb, bt_ref.shape[1] - 1)]
    at = rid % rpb
    if keys_ref.dtype == jnp.uint8:
        nb = c // records.block_size("mxfp4", c)
        kk = records.decode("mxfp4", keys_ref[blk, at, pl.ds(0, c // 2)], keys_ref[blk, at, pl.ds(c // 2, nb)])
    else:
        kk = keys_ref[blk, at, :].astype(jnp.float32)
    cdt = q_ref.dtype if q_ref.dtype == jnp.bfloat16 else jnp.float32
    prec = jax.lax.Precision.HIGHEST if cdt == jnp.float32 else None
    s = jax.lax.dot_general(q_ref[...].astype(cdt), kk.astype(cdt), (((1,), (1,)), ((), ())), precision=prec,
                            preferred_element_type=jnp.float32)  # [h, block_n]
    score = jnp.sum(jnp.maximum(s, 0.0) * w_ref[...].astype(jnp.float32)[:, None], axis=0)
    s_ref[...] = jnp.where(ok != 0, score, -jnp.inf)


def pallas(q_Thc, w_Th, keys_NPx, meta: IndexMeta, *, k: int, candidates_TK=None, cand_block: int = 8,
           n_cand_blocks: int = 0, block_n: int = 64, num_warps: int = 4, num_stages: int = 2,
           interpret: bool | None = None):
    """Scoring kernel, one program per (query, `block_n` rows), then XLA TopK."""
    _check(q_Thc, w_Th, keys_NPx, meta, candidates_TK)
    T, h, c = q_Thc.shape
    rid, ok = _row_ids(meta, candidates_TK, cand_block, keys_NPx.shape[1])
    N = rid.shape[1]
    block_n = min(block_n, 1 << (N - 1).bit_length())
    Np = -(-N // block_n) * block_n
    rid_p = jnp.pad(rid, ((0, 0), (0, Np - N)))
    ok_p = jnp.pad(ok.astype(jnp.int32), ((0, 0), (0, Np - N)))
    row_block = pl.BlockSpec((None, block_n), lambda t, j: (t, j))
    s = pl.pallas_call(
        functools.partial(_scores_kernel, c=c, block_n=block_n), grid=(T, Np // block_n),
        out_shape=jax.ShapeDtypeStruct((T, Np), jnp.float32),
        in_specs=[pl.BlockSpec((None, h, c), lambda t, j: (t, 0, 0)), pl.BlockSpec((None, h), lambda t, j: (t, 0)),
                  pl.BlockSpec((T,), lambda t, j: (0,)), pl.BlockSpec(meta.block_table_RM.shape, lambda t, j: (0, 0)),
                  row_block, row_block, pl.BlockSpec(keys_NPx.shape, lambda t, j: (0, 0, 0))],
        out_specs=row_block, interpret=interpret_default() if interpret is None else interpret, name="index_scores",
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
    )(q_Thc, w_Th, meta.req_T, meta.block_table_RM, rid_p, ok_p, keys_NPx)[:, :N]
    return _finish(s, rid, meta, k, candidates_TK, cand_block, n_cand_blocks, _select_topk)


def index_topk(q_Thc, w_Th, keys_NPx, meta: IndexMeta, *, k: int, candidates_TK=None, cand_block: int = 8,
               n_cand_blocks: int = 0, impl: str = "auto"):
    """(top-k row ids [T, min(k, N)], candidate blocks [T, n] at the candidate source else None)."""
    fn = {"reference": reference, "xla": xla, "pallas": pallas}[resolve_impl(impl)]
    return fn(q_Thc, w_Th, keys_NPx, meta, k=k, candidates_TK=candidates_TK, cand_block=cand_block,
              n_cand_blocks=n_cand_blocks)
