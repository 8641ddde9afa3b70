"""Lightning-indexer selection of V4.1 (spec §2.7): S(t, j) = sum_h w[t, h] * ReLU(q[t, h] . k[j]) over a
request's paged index keys, then each query's top-k rows.

Two modes:
  dense        every visible row j < n_visible[t] (index sources before the candidate source); at the
               candidate source also the top candidate blocks: blocks of `cand_block` rows scored by their
               max, the newest (possibly partial) block pinned
  candidates   only the rows of each query's candidate blocks (later index sources): work and bytes are
               flat in the context length
Ids come in descending score order, ties to the lower row id, -1 where fewer rows than k are visible.

Dense mode scans the cache blocks up to `meta.n_blocks` (a dynamic value, e.g. the blocks of the step's
longest context), so one compiled function serves every context length.

Kernel: one program per (query, chunk of rows) gathers the chunk's keys through the block table (MXFP4
records decoded in registers; `pallas_kernels.paged`, sparse MLA's gather too), does the [heads, c] x
[c, rows] GEMM, the ReLU and the head-weighted sum, and writes the chunk's scores (programs past the scan
only write -inf); the selection is XLA's TopK over those scores (no in-kernel top-k yet). XLA path (CPU): per
query tile, a loop over the scanned blocks with a running top-k merge (dense), or each query's candidate rows
gathered and scored (candidates).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import paged, records
from pallas_kernels.common import product_dtype, product_precision
from pallas_kernels.dispatch import interpret_default, resolve_impl
from pallas_kernels.tiles import QueryTiles, map_tiles, plan_or_rows, tile_rows, to_flat_rows

BIG = jnp.iinfo(jnp.int32).max


class IndexMeta(NamedTuple):
    n_visible_T: jax.Array  # [T] rows visible to each query ((pos + 1) // ratio)
    req_T: jax.Array  # [T] request of each query
    block_table_RM: jax.Array  # [R, max_blocks]
    n_blocks: jax.Array | None = None  # dense mode: cache blocks to scan (>= any query's visible blocks; a
    #                                    dynamic bound, e.g. the step's longest context); None: the whole table
    tiles: QueryTiles | None = None  # the XLA path's work plan (None: one row per tile)


def _check(q, w, keys, meta, cand, k):
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
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")


def _n_blocks(meta: IndexMeta) -> jax.Array:
    return jnp.asarray(meta.block_table_RM.shape[1], jnp.int32) if meta.n_blocks is None else meta.n_blocks


def _pad_ids(ids, width):
    """[T, n] ids -> [T, width], -1 past n (a call always returns k ids, however few rows exist)."""
    return jnp.pad(ids, ((0, 0), (0, width - ids.shape[1])), constant_values=-1) if ids.shape[1] < width else ids


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


def _cand_blocks(scores_TN, n_visible_T, cand_block, n_blocks, select):
    T, N = scores_TN.shape
    nb = N // cand_block
    bs = jnp.max(scores_TN.reshape(T, nb, cand_block), axis=-1)
    newest = -(-n_visible_T // cand_block) - 1
    bid = jnp.arange(nb)[None]
    bs = jnp.where(bid == newest[:, None], jnp.inf, jnp.where(bid < newest[:, None], bs, -jnp.inf))
    return _pad_ids(select(bs, jnp.broadcast_to(bid, bs.shape), min(n_blocks, nb)), n_blocks)


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
    ids = _pad_ids(select(scores, rid, min(k, scores.shape[1])), k)
    if cand is None and n_cand_blocks:
        return ids, _cand_blocks(scores, meta.n_visible_T, cand_block, n_cand_blocks, select)
    return ids, None


def reference(q_Thc, w_Th, keys_NPx, meta: IndexMeta, *, k: int, candidates_TK=None, cand_block: int = 8,
              n_cand_blocks: int = 0):
    """The spec: every eligible row's key gathered and scored at once, stable-sort selection (ignores
    `meta.n_blocks`: a bound too small for a query's visible rows shows as a mismatch)."""
    _check(q_Thc, w_Th, keys_NPx, meta, candidates_TK, k)
    hi = jax.lax.Precision.HIGHEST
    rid, ok = _row_ids(meta, candidates_TK, cand_block, keys_NPx.shape[1])
    kk = paged.gather_rows(keys_NPx, "mxfp4", q_Thc.shape[2], meta.block_table_RM, meta.req_T[:, None], rid,
                           records.reference_decode)
    s = jnp.einsum("th,thn->tn", w_Th.astype(jnp.float32),
                   jax.nn.relu(jnp.einsum("thc,tnc->thn", q_Thc.astype(jnp.float32), kk, precision=hi)), precision=hi)
    s = jnp.where(ok, s, -jnp.inf)
    return _finish(s, rid, meta, k, candidates_TK, cand_block, n_cand_blocks, _select_sorted)


# ===================================================================================== xla
def _scores(q_uhc, w_uh, keys_nc):
    """sum_h w[u, h] * ReLU(q[u, h] . k[n]) -> [u, n] (keys [n, c] shared by the tile, or [u, n, c] per query)."""
    hi = jax.lax.Precision.HIGHEST
    eq = "uhc,unc->uhn" if keys_nc.ndim == 3 else "uhc,nc->uhn"
    s = jnp.einsum(eq, q_uhc.astype(jnp.float32), keys_nc.astype(jnp.float32), precision=hi)
    return jnp.einsum("uhn,uh->un", jax.nn.relu(s), w_uh.astype(jnp.float32), precision=hi)


def _merge_topk(vals, ids, new_vals, new_ids, k: int):
    """Running top-k: earlier rows first in the concatenation, so ties keep the lower row id."""
    v = jnp.concatenate([vals, new_vals], axis=-1)
    i = jnp.concatenate([ids, jnp.broadcast_to(new_ids, new_vals.shape)], axis=-1)
    top, at = jax.lax.top_k(v, k)
    return top, jnp.take_along_axis(i, at, axis=-1)


def _dense_xla(q, w, keys, meta, tiles, k, cand_block, n_cand_blocks):
    """Per query tile, a loop over the request's cache blocks (trip count `meta.n_blocks`, dynamic: no
    recompilation per context length) that scores one block's keys for the whole tile and merges a running
    top-k - and with candidate blocks a running top-K of block scores (max, newest block pinned)."""
    T = q.shape[0]
    rpb = keys.shape[1]
    K, cbs = n_cand_blocks, cand_block

    def one_tile(i):
        rows, _ = tile_rows(tiles, i, T)
        r = tiles.req_N[i]
        qq, ww = q[rows], w[rows]
        visible = meta.n_visible_T[rows]
        n_blocks_visible = -(-visible // cbs)
        init = (jnp.full((tiles.size, k), -jnp.inf), jnp.full((tiles.size, k), -1, jnp.int32))
        if K:
            init += (jnp.full((tiles.size, K), -jnp.inf), jnp.full((tiles.size, K), -1, jnp.int32))

        def body(b, carry):
            vals, ids, *cand = carry
            kb = paged.decode_blocks(keys, "mxfp4", q.shape[2], meta.block_table_RM[r, b])  # [rpb, c]
            rid = b * rpb + jnp.arange(rpb)
            sc = jnp.where(rid[None] < visible[:, None], _scores(qq, ww, kb), -jnp.inf)
            vals, ids = _merge_topk(vals, ids, sc, rid, k)
            if K:
                bid = b * (rpb // cbs) + jnp.arange(rpb // cbs)
                bs = jnp.max(sc.reshape(tiles.size, rpb // cbs, cbs), axis=-1)
                bs = jnp.where(bid[None] < n_blocks_visible[:, None], bs, -jnp.inf)
                bs = jnp.where(bid[None] == (n_blocks_visible - 1)[:, None], jnp.inf, bs)
                cand = _merge_topk(*cand, bs, bid, K)
            return vals, ids, *cand

        vals, ids, *cand = jax.lax.fori_loop(0, _n_blocks(meta), body, init)
        out = (jnp.where(vals == -jnp.inf, -1, ids),)
        return out + ((jnp.where(cand[0] == -jnp.inf, -1, cand[1]),) if K else ())

    ids, *cids = map_tiles(one_tile, tiles)
    return to_flat_rows(ids, tiles, T, -1), (to_flat_rows(cids[0], tiles, T, -1) if K else None)


def _candidates_xla(q, w, keys, meta, tiles, k, cand, cand_block):
    """Per query tile: each query scores the rows of its own candidate blocks (ascending block ids, so
    top-k ties keep the lowest row id)."""
    T = q.shape[0]

    def one_tile(i):
        rows, _ = tile_rows(tiles, i, T)
        r = tiles.req_N[i]
        cb = -jax.lax.top_k(-jnp.where(cand[rows] < 0, BIG, cand[rows]), cand.shape[1])[0]  # TopK, no sort
        rid = (cb[..., None] * cand_block + jnp.arange(cand_block)).reshape(tiles.size, -1)  # [size, K * cbs]
        ok = (cb[..., None] != BIG).repeat(cand_block, -1).reshape(rid.shape)
        ok &= rid < meta.n_visible_T[rows][:, None]
        rid = jnp.where(ok, rid, 0)
        kk = paged.gather_rows(keys, "mxfp4", q.shape[2], meta.block_table_RM, r, rid)  # [size, K * cbs, c]
        sc = jnp.where(ok, _scores(q[rows], w[rows], kk), -jnp.inf)
        top, at = jax.lax.top_k(sc, min(k, sc.shape[1]))
        return _pad_ids(jnp.where(top == -jnp.inf, -1, jnp.take_along_axis(rid, at, axis=-1)), k)

    return to_flat_rows(map_tiles(one_tile, tiles), tiles, T, -1)


def xla(q_Thc, w_Th, keys_NPx, meta: IndexMeta, *, k: int, candidates_TK=None, cand_block: int = 8,
        n_cand_blocks: int = 0):
    """The CPU path over query tiles (`meta.tiles`): dense mode loops over cache blocks up to `meta.n_blocks`
    with running top-k merges; candidate mode gathers each query's candidate rows."""
    _check(q_Thc, w_Th, keys_NPx, meta, candidates_TK, k)
    tiles = plan_or_rows(meta.tiles, meta.req_T)
    if candidates_TK is not None:
        return _candidates_xla(q_Thc, w_Th, keys_NPx, meta, tiles, k, candidates_TK, cand_block), None
    return _dense_xla(q_Thc, w_Th, keys_NPx, meta, tiles, k, cand_block, n_cand_blocks)


# ================================================================================== pallas
def _scores_kernel(q_ref, w_ref, req_ref, bt_ref, bound_ref, rid_ref, ok_ref, keys_ref, s_ref, *, c, block_n):
    t, j = pl.program_id(0), pl.program_id(1)

    @pl.when(j * block_n >= bound_ref[0])  # past the scanned blocks: nothing to load
    def _():
        s_ref[...] = jnp.full((block_n,), -jnp.inf, jnp.float32)

    @pl.when(j * block_n < bound_ref[0])
    def _():
        rid, ok = rid_ref[...], ok_ref[...]
        kk = paged.load_rows(keys_ref, "mxfp4", c, bt_ref, req_ref[t], rid)
        cdt = product_dtype(q_ref.dtype)
        prec = product_precision(cdt)
        s = jax.lax.dot_general(q_ref[...].astype(cdt), kk.astype(cdt), (((1,), (1,)), ((), ())), precision=prec,
                                preferred_element_type=jnp.float32)  # [h, block_n]
        score = jnp.sum(jnp.maximum(s, 0.0) * w_ref[...].astype(jnp.float32)[:, None], axis=0)
        s_ref[...] = jnp.where(ok != 0, score, -jnp.inf)


def pallas(q_Thc, w_Th, keys_NPx, meta: IndexMeta, *, k: int, candidates_TK=None, cand_block: int = 8,
           n_cand_blocks: int = 0, block_n: int = 64, num_warps: int = 4, num_stages: int = 2,
           interpret: bool | None = None):
    """Scoring kernel, one program per (query, `block_n` rows), then XLA TopK. In dense mode programs past
    `meta.n_blocks` cache blocks only write -inf (the scan length follows the step's context, not the table)."""
    _check(q_Thc, w_Th, keys_NPx, meta, candidates_TK, k)
    T, h, c = q_Thc.shape
    rpb = keys_NPx.shape[1]
    rid, ok = _row_ids(meta, candidates_TK, cand_block, rpb)
    N = rid.shape[1]
    block_n = min(block_n, 1 << (N - 1).bit_length())
    Np = -(-N // block_n) * block_n
    rid_p = jnp.pad(rid, ((0, 0), (0, Np - N)))
    ok_p = jnp.pad(ok.astype(jnp.int32), ((0, 0), (0, Np - N)))
    bound = jnp.reshape(N if candidates_TK is not None else _n_blocks(meta) * rpb, (1,)).astype(jnp.int32)
    row_block = pl.BlockSpec((None, block_n), lambda t, j: (t, j))
    s = pl.pallas_call(
        functools.partial(_scores_kernel, c=c, block_n=block_n), grid=(T, Np // block_n),
        out_shape=jax.ShapeDtypeStruct((T, Np), jnp.float32),
        in_specs=[pl.BlockSpec((None, h, c), lambda t, j: (t, 0, 0)), pl.BlockSpec((None, h), lambda t, j: (t, 0)),
                  pl.BlockSpec((T,), lambda t, j: (0,)), pl.BlockSpec(meta.block_table_RM.shape, lambda t, j: (0, 0)),
                  pl.BlockSpec((1,), lambda t, j: (0,)), row_block, row_block,
                  pl.BlockSpec(keys_NPx.shape, lambda t, j: (0, 0, 0))],
        out_specs=row_block, interpret=interpret_default() if interpret is None else interpret, name="index_scores",
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
    )(q_Thc, w_Th, meta.req_T, meta.block_table_RM, bound, rid_p, ok_p, keys_NPx)[:, :N]
    return _finish(s, rid, meta, k, candidates_TK, cand_block, n_cand_blocks, _select_topk)


def index_topk(q_Thc, w_Th, keys_NPx, meta: IndexMeta, *, k: int, candidates_TK=None, cand_block: int = 8,
               n_cand_blocks: int = 0, impl: str = "auto"):
    """(top-k row ids [T, k], -1 padded; candidate blocks [T, n_cand_blocks] at the candidate source else None)."""
    fn = {"reference": reference, "xla": xla, "pallas": pallas}[resolve_impl(impl)]
    return fn(q_Thc, w_Th, keys_NPx, meta, k=k, candidates_TK=candidates_TK, cand_block=cand_block,
              n_cand_blocks=n_cand_blocks)
