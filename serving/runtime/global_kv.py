"""The paged global KV of a step: KV sources write rows and index keys, index sources select top-k.

Writes (KV source s, ratio r): a row closes at the last token of its group (every token for r = 1, odd
positions for r = 2, pooling with the previous token - or with the slot's tail when the chunk starts at
an odd position). Row j lives at block_table[j // rows_per_block], offset j % rows_per_block. Rows whose
last token lies below the request's write floor (a prefix hit being replayed) are never rewritten; an
open group at the end of a chunk leaves its raw [kv, gate] rows in the tail.

Top-k (index sources): dense sources score every visible row of the request's paged keys in a loop over
cache blocks whose trip count is the step's longest context (a dynamic bound: no recompile per length),
merging a running top-k - and at the candidate source a running top-K of candidate blocks (max score,
newest block pinned). Candidate consumers score only the rows of their K candidate blocks.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from dsv41.layers.indexer import Indexer, index_scores
from dsv41.layers.rope import apply_rope, inv_freq, rope_angles
from dsv41.quant import fake_quant_nvfp4
from serving.runtime import kv_cache
from serving.runtime.attention import TILE_GROUP, Tiles, tile_rows
from serving.runtime.kv_cache import CacheLayout


class TokenMeta(NamedTuple):
    """Per-row metadata of a flat layout."""

    pos: jax.Array  # [T]
    req: jax.Array  # [T] request index
    valid: jax.Array  # [T]


def publish_source(layout: CacheLayout, block, x_TD: jax.Array, meta: TokenMeta, req: dict, cache: dict,
                   fake_quant: bool) -> dict:
    """KV source `block`: write the rows closing in this step (+ index keys) and the open-group tail."""
    c, s = layout.config, block.role.layer_id
    comp, r = block.attn.compressor, block.role.compress_ratio
    rpb = layout.rows_per_block(s)
    kv, gate = comp.project(x_TD)
    slot = req["slot"][meta.req]
    if r == 2:
        tail = cache["tail"][s][slot]  # [T, 2, d]
        inside = meta.pos > req["start"][meta.req]  # the group's first token is in this step
        prev_kv = jnp.where(inside[:, None], jnp.roll(kv, 1, axis=0), tail[:, 0])
        prev_gate = jnp.where(inside[:, None], jnp.roll(gate, 1, axis=0), tail[:, 1])
        w = jax.nn.softmax(jnp.stack([prev_gate, gate]), axis=0)
        pooled = w[0] * prev_kv + w[1] * kv
        closes = meta.pos % 2 == 1
    else:
        pooled, closes = kv, jnp.ones_like(meta.valid)
    latent = comp.norm(pooled, x_TD.dtype)
    j = meta.pos // r
    cos, sin = rope_angles(j * r, inv_freq(c, "compress"))
    rows = apply_rope(latent, cos, sin)
    rows = fake_quant_nvfp4(rows) if fake_quant else rows
    write = meta.valid & closes & (meta.pos >= req["write_floor"][meta.req])
    blk = jnp.where(write, req["block_table"][meta.req, j // rpb], layout.num_blocks)  # out of range -> dropped
    cache = dict(cache)
    cache["rows"] = {**cache["rows"], s: cache["rows"][s].at[blk, j % rpb].set(
        kv_cache.encode(layout, "rows", rows), mode="drop")}
    ix = block.attn.indexer
    if ix is not None and ix.wk is not None:
        keys = ix.keys(latent, cos, sin, fake_quant)
        cache["keys"] = {**cache["keys"], s: cache["keys"][s].at[blk, j % rpb].set(
            kv_cache.encode(layout, "keys", keys), mode="drop")}
    if r == 2:
        opens = meta.valid & (meta.pos == req["end"][meta.req] - 1) & (meta.pos % 2 == 0)
        cache["tail"] = {**cache["tail"], s: cache["tail"][s].at[jnp.where(opens, slot, layout.num_slots)].set(
            jnp.stack([kv, gate], axis=1), mode="drop")}
    return cache


def _merge_topk(vals, ids, new_vals, new_ids, k: int):
    """Running top-k: earlier rows first in the concatenation, so ties keep the lower row id."""
    v = jnp.concatenate([vals, new_vals], axis=-1)
    i = jnp.concatenate([ids, jnp.broadcast_to(new_ids, new_vals.shape)], axis=-1)
    top, at = jax.lax.top_k(v, k)
    return top, jnp.take_along_axis(i, at, axis=-1)


def _scatter_rows(x_NTu: jax.Array, tiles: Tiles, T: int, fill) -> jax.Array:
    dest = tiles.first[:, None] + jnp.arange(tiles.size)
    dest = jnp.where(jnp.arange(tiles.size)[None] < tiles.n[:, None], dest, T)
    out = jnp.full((T, *x_NTu.shape[2:]), fill, x_NTu.dtype)
    return out.at[dest.reshape(-1)].set(x_NTu.reshape(-1, *x_NTu.shape[2:]), mode="drop")


def dense_topk(layout: CacheLayout, ix: Indexer, q_Thc: jax.Array, w_Th: jax.Array, pos_T: jax.Array, tiles: Tiles,
               keys_cache: jax.Array, n_iter: jax.Array, *, ratio: int, candidates: bool
               ) -> tuple[jax.Array, jax.Array | None]:
    """Top-k row ids [T, index_topk] (-1 = none) over every visible row, and at the candidate source the
    chosen candidate blocks [T, candidate_topk_blocks] (-1 = none)."""
    c = layout.config
    T, k = q_Thc.shape[0], c.index_topk
    K, cbs = c.candidate_topk_blocks, max(c.candidate_block_size, 1)
    rpb = layout.block_size // ratio

    def one_tile(i):
        rows, _ = tile_rows(tiles, i, T)
        r = tiles.req[i]
        q, w = q_Thc[rows], w_Th[rows]
        visible = (pos_T[rows] + 1) // ratio
        n_blocks_visible = -(-visible // cbs)
        init = (jnp.full((tiles.size, k), -jnp.inf), jnp.full((tiles.size, k), -1, jnp.int32))
        if candidates:  # only the candidate source carries block scores (a model may have no candidates)
            init += (jnp.full((tiles.size, K), -jnp.inf), jnp.full((tiles.size, K), -1, jnp.int32))

        def body(b, carry):
            vals, ids, *cand = carry
            kb = kv_cache.decode(layout, "keys", keys_cache[tiles.block_table[r, b]])  # [rpb, c]
            rid = b * rpb + jnp.arange(rpb)
            s = jnp.where(rid[None] < visible[:, None], index_scores(q, w, kb), -jnp.inf)
            vals, ids = _merge_topk(vals, ids, s, rid, k)
            if candidates:
                bid = b * (rpb // cbs) + jnp.arange(rpb // cbs)
                bs = jnp.max(s.reshape(tiles.size, rpb // cbs, cbs), axis=-1)
                bs = jnp.where(bid[None] < n_blocks_visible[:, None], bs, -jnp.inf)
                bs = jnp.where(bid[None] == (n_blocks_visible - 1)[:, None], jnp.inf, bs)
                cand = _merge_topk(*cand, bs, bid, K)
            return vals, ids, *cand

        vals, ids, *cand = jax.lax.fori_loop(0, n_iter, body, init)
        out = (jnp.where(vals == -jnp.inf, -1, ids),)
        return out + ((jnp.where(cand[0] == -jnp.inf, -1, cand[1]),) if candidates else ())

    NT = tiles.req.shape[0]
    ids, *cids = jax.lax.map(one_tile, jnp.arange(NT), batch_size=min(TILE_GROUP, NT))
    return _scatter_rows(ids, tiles, T, -1), (_scatter_rows(cids[0], tiles, T, -1) if candidates else None)


def candidate_topk(layout: CacheLayout, q_Thc: jax.Array, w_Th: jax.Array, pos_T: jax.Array, tiles: Tiles,
                   keys_cache: jax.Array, cand_TK: jax.Array, *, ratio: int) -> jax.Array:
    """Top-k row ids [T, index_topk] among the rows of each query's candidate blocks."""
    c = layout.config
    T, k, cbs = q_Thc.shape[0], c.index_topk, c.candidate_block_size
    rpb = layout.block_size // ratio

    def one_tile(i):
        rows, _ = tile_rows(tiles, i, T)
        r = tiles.req[i]
        # ascending block ids (missing ones last) so that top-k ties keep the lowest row id
        big = jnp.iinfo(jnp.int32).max
        cb = -jax.lax.top_k(-jnp.where(cand_TK[rows] < 0, big, cand_TK[rows]), cand_TK.shape[1])[0]  # TopK, no sort
        rid = (cb[..., None] * cbs + jnp.arange(cbs)).reshape(tiles.size, -1)  # [tile, K * cbs]
        ok = (cb[..., None] != big).repeat(cbs, -1).reshape(rid.shape)
        ok &= rid < ((pos_T[rows] + 1) // ratio)[:, None]
        rid = jnp.where(ok, rid, 0)
        blk = tiles.block_table[r][jnp.clip(rid // rpb, 0, tiles.block_table.shape[1] - 1)]
        keys = kv_cache.decode(layout, "keys", keys_cache[blk, rid % rpb])  # [tile, K * cbs, c]
        s = jnp.where(ok, index_scores(q_Thc[rows], w_Th[rows], keys), -jnp.inf)
        top, at = jax.lax.top_k(s, k)
        return jnp.where(top == -jnp.inf, -1, jnp.take_along_axis(rid, at, axis=-1))

    NT = tiles.req.shape[0]
    ids = jax.lax.map(one_tile, jnp.arange(NT), batch_size=min(TILE_GROUP, NT))
    return _scatter_rows(ids, tiles, T, -1)
