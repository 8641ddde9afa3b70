"""The paged global KV of a step: KV sources write rows and index keys, index sources select top-k.

Writes (KV source s, ratio r): a row closes at the last token of its group (every token for r = 1, odd
positions for r = 2, pooling with the previous token - or with the slot's tail when the chunk starts at
an odd position). Row j lives at block_table[j // rows_per_block], offset j % rows_per_block. Rows whose
last token lies below the request's write floor (a prefix hit being replayed) are never rewritten; an
open group at the end of a chunk leaves its raw [kv, gate] rows in the tail. The pooled rows become global rows
and index keys as in the model (`dsv41.layers.attention.publish_kv_source`); what is the paging's is here: the
pooling across chunks through the tail, the block addressing and the write floor.

Top-k (index sources): one call of the fused op `pallas_kernels.index_topk` under the block's
`kernel_impl`. Dense sources score every visible row of the request's paged keys, scanning the cache
blocks of the step's longest context (a dynamic bound: no recompile per length); the candidate source
also picks its top candidate blocks; candidate consumers score only the rows of those blocks. A source that
neither publishes nor reads candidate blocks skips the indexer in a step whose longest context holds at most
k rows (it would select them all).

V4 sources (CSA ratio 4, HCA ratio 128) write through `serving.runtime.v4_kv` (windowed compressor state).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from dsv41.layers.attention import publish_kv_source
from pallas_kernels.indexer import IndexMeta, index_topk
from pallas_kernels.tiles import QueryTiles
from serving.runtime import kv_cache, v4_kv
from serving.runtime.kv_cache import CacheLayout, KVCache
from serving.runtime.step import INDEX_RATIOS, Requests


def publish_source(layout: CacheLayout, block, x_TD: jax.Array, pos_T: jax.Array, req_T: jax.Array,
                   valid_T: jax.Array, requests: Requests, cache: KVCache, fake_quant: bool
                   ) -> tuple[KVCache, jax.Array | None]:
    """KV source `block`: write the rows closing in this step (+ index keys) and the open-group tail; returns the
    cache and, for a ratio-2 source, every row's raw [kv, gate] [T, 2, d] float32 (speculative rollback restores
    a tail from it), else None."""
    if layout.config.family == "v4":
        return v4_kv.publish(layout, block, x_TD, pos_T, req_T, valid_T, requests, cache, fake_quant), None
    c, s = layout.config, block.role.layer_id
    comp, r = block.attn.compressor, block.role.compress_ratio
    rpb = layout.rows_per_block(s)
    kv, gate = comp.project(x_TD)
    slot = requests.slot_R[req_T]
    if r == 2:
        tail = cache.tail[s][slot]  # [T, 2, d]
        inside = pos_T > requests.start_R[req_T]  # the group's first token is in this step
        prev_kv = jnp.where(inside[:, None], jnp.roll(kv, 1, axis=0), tail[:, 0])
        prev_gate = jnp.where(inside[:, None], jnp.roll(gate, 1, axis=0), tail[:, 1])
        w = jax.nn.softmax(jnp.stack([prev_gate, gate]), axis=0)
        pooled = w[0] * prev_kv + w[1] * kv
        closes = pos_T % 2 == 1
    else:
        pooled, closes = kv, jnp.ones_like(valid_T)
    j = pos_T // r
    rows, keys = publish_kv_source(block.attn, c, pooled, j, x_TD.dtype, fake_quant)
    write = valid_T & closes & (pos_T >= requests.write_floor_R[req_T])
    blk = jnp.where(write, requests.block_table_RM[req_T, j // rpb], layout.num_blocks)  # out of range -> dropped
    cache = cache.updated(rows={s: cache.rows[s].at[blk, j % rpb].set(layout.rows_format.encode(rows), mode="drop")})
    if keys is not None:
        cache = cache.updated(keys={s: cache.keys[s].at[blk, j % rpb].set(layout.keys_format.encode(keys),
                                                                           mode="drop")})
    if r == 2:
        opens = valid_T & (pos_T == requests.end_R[req_T] - 1) & (pos_T % 2 == 0)
        _, tails = kv_cache.after_reads(pooled, cache.tail[s])
        cache = cache.updated(tail={s: tails.at[jnp.where(opens, slot, layout.num_slots)].set(
            jnp.stack([kv, gate], axis=1), mode="drop")})
        return cache, jnp.stack([kv, gate], axis=1).astype(jnp.float32)
    return cache, None


def select_rows(layout: CacheLayout, block, queries: Callable[[], tuple[jax.Array, jax.Array]], pos_T: jax.Array,
                req_T: jax.Array, tiles: QueryTiles, requests: Requests, index_blocks_2: jax.Array,
                keys_cache: jax.Array, candidates_TK: jax.Array | None) -> tuple[jax.Array, jax.Array | None]:
    """Index source `block`: its top-k global row ids [T, index_topk] (-1 = none) and, at the candidate source,
    the chosen candidate blocks [T, candidate_topk_blocks] (else None). `queries()`: the index queries [T, ih, c]
    and head weights [T, ih], traced only where the indexer runs. `candidates_TK`: the candidate source's blocks,
    for a layer that restricts its top-k to them."""
    c, role = layout.config, block.role
    r = role.compress_ratio
    n_blocks = index_blocks_2[INDEX_RATIOS.index(r)]
    meta = IndexMeta((pos_T + 1) // r, req_T, requests.block_table_RM, n_blocks=n_blocks, tiles=tiles)
    if not (role.is_candidate_source or role.uses_candidates):
        # a step whose longest context has at most k rows selects them all: the scores cannot change the set
        # (the attention reads it as a set), so the indexer is skipped - exact, and most short prompts' case
        few = n_blocks * layout.rows_per_block(role.kv_source) <= c.index_topk
        return jax.lax.cond(few, lambda: all_rows(pos_T, r, c.index_topk), lambda: index_topk(
            *queries(), keys_cache, meta, k=c.index_topk, impl=block.kernel_impl)[0]), None
    return index_topk(*queries(), keys_cache, meta, k=c.index_topk,
                      candidates_TK=candidates_TK if role.uses_candidates else None,
                      cand_block=max(c.candidate_block_size, 1),
                      n_cand_blocks=c.candidate_topk_blocks if role.is_candidate_source else 0, impl=block.kernel_impl)


def all_rows(pos_T: jax.Array, ratio: int, n_rows: int) -> jax.Array:
    """Every visible compressed row of each query [T, n_rows] (ids, -1 past (pos + 1) // ratio): V4's HCA layers
    (all rows of their own KV), and an index source's top-k when no query sees more than k rows."""
    ids = jnp.arange(n_rows, dtype=jnp.int32)[None, :]
    return jnp.where(ids < ((pos_T + 1) // ratio)[:, None], ids, -1)
