"""V4-Flash's compressed KV in the serving runtime (compat mode, spec §2.6 V4): CSA (ratio 4, two overlapping
series) and HCA (ratio 128) rows written to the paged cache as their windows close, from per-slot state.

A V4 compressor pools a window of r tokens with a per-channel softmax over gate + ape; CSA pools 2r slots, the
previous window's first series (Ca) and this window's second one (Cb). A chunk seldom covers whole windows, so
every V4 KV source keeps the raw [kv, gate + ape] of its request's last S positions in a per-slot ring
(`KVCache.pool[layer]`, position q at q % S, S = 2r for CSA and r for HCA; the CSA indexer's own compressor
in `KVCache.index_pool`). A row closing at position p (p % r == r - 1) reads positions p - S + 1 .. p from
this step's rows where the step has them and from the ring below the request's first position of the step;
positions < 0 weigh nothing (CSA's window 0). At most T // r + min(T, R) rows close in a step of T rows and R
requests, so only those are pooled; a step of fewer rows than r (every decode step of an HCA layer) pools only when
one of its windows closes; CSA's ring is gathered only when a closing window reaches before its request's rows of
the step (not in a prefill chunk that starts at a window boundary), and HCA's wide windows are pooled one closing
window at a time (`_pool_closing`). Rows closing below the write floor (a prefix hit's cached rows) are kept.
The pooling is this module's own (`V4Compressor.pooled` pools a whole sequence from position 0, not windows
straddling steps through a ring); the norm, RoPE and index keys of the pooled rows are the model's
(`dsv41.layers.attention.publish_kv_source`).

Prefix hits are block aligned and a block holds whole ratio-128 windows (`CacheLayout` checks it), so a window
closing at or after the hit starts at or after it: the replayed rows refill the ring before any row reads it.

HCA layers attend to every visible row of their own compressed KV (no indexer): `global_kv.all_rows` gives a
query the ids 0 .. (p + 1) // r - 1, -1 beyond, as wide as a request's block table holds rows: the same top-k
form the sparse attention takes for CSA's indexer rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dsv41.layers.attention import publish_kv_source
from dsv41.layers.compressor import V4Compressor
from serving.runtime import kv_cache
from serving.runtime.kv_cache import CacheLayout, KVCache
from serving.runtime.step import Requests


def publish(layout: CacheLayout, block, x_TD: jax.Array, pos_T: jax.Array, req_T: jax.Array, valid_T: jax.Array,
            requests: Requests, cache: KVCache, fake_quant: bool) -> KVCache:
    """V4 KV source `block`: the global rows (and CSA's index keys) of the windows closing in this step written
    to the paged cache, the compressors' rings advanced."""
    c, s = layout.config, block.role.layer_id
    r = block.role.compress_ratio
    T, R = x_TD.shape[0], requests.slot_R.shape[0]
    n_close = min(T, T // r + min(T, R))
    closes = valid_T & (pos_T % r == r - 1) & (pos_T >= requests.write_floor_R[req_T])
    (t_C,) = jnp.nonzero(closes, size=n_close, fill_value=0)
    ok_C = jnp.arange(n_close) < jnp.sum(closes)
    p_C, rq_C = pos_T[t_C], req_T[t_C]
    j_C = p_C // r
    rpb = layout.rows_per_block(s)
    blk = jnp.where(ok_C, requests.block_table_RM[rq_C, j_C // rpb], layout.num_blocks)  # out of range -> dropped

    def pool(comp: V4Compressor, ring: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The closing windows' pooled rows [C, d] (before the norm) and the compressor's ring advanced past this
        step."""
        raw_T2w = jnp.stack([comp.wkv(x_TD, jnp.float32), comp.wgate(x_TD, jnp.float32) + comp.ape[...][pos_T % r]], 1)
        closing_rows = lambda: _pool_closing(comp, raw_T2w, pos_T, req_T, requests, ring, t_C, ok_C)  # noqa: E731
        if r > T:  # a window closes in few such steps (an HCA layer's decode: 1 in 128): skip its pooling in the rest
            pooled_Cd = jax.lax.cond(jnp.any(ok_C), closing_rows,
                                     lambda: jnp.zeros((n_close, comp.head_dim), jnp.float32))
        else:
            pooled_Cd = closing_rows()
        pooled_Cd, ring = kv_cache.after_reads(pooled_Cd, ring)
        return pooled_Cd, _advance_ring(raw_T2w, pos_T, req_T, valid_T, requests, ring)

    pooled, ring = pool(block.attn.compressor, cache.pool[s])
    cache = cache.updated(pool={s: ring})
    ix, index_pooled = block.attn.indexer, None
    if ix is not None:  # CSA: its indexer's own compressor
        index_pooled, ring = pool(ix.compressor, cache.index_pool[s])
        cache = cache.updated(index_pool={s: ring})
    rows, keys = publish_kv_source(block.attn, c, pooled, j_C, x_TD.dtype, fake_quant, index_pooled_Nc=index_pooled)
    cache = cache.updated(rows={s: cache.rows[s].at[blk, j_C % rpb].set(layout.rows_format.encode(rows), mode="drop")})
    if keys is not None:
        cache = cache.updated(keys={s: cache.keys[s].at[blk, j_C % rpb].set(layout.keys_format.encode(keys),
                                                                            mode="drop")})
    return cache


# On a CPU, windows at least this wide (HCA's 128 positions) are pooled one closing window at a time, only the
# windows that close: a step pools at most T // r + min(T, R) of them, mostly padding slots (a 512-row prefill with
# 32 KV slots: 36 slots, 4 or 5 windows), and gathering all [36, 128, 2, 512] float32 rows is slow on a CPU
# (docs/design/measurements.md). A GPU gathers them in one pass (a loop of ~64 windows per 8K-token chunk and HCA
# layer would cost a launch each).
LOOP_MIN_SLOTS = 32


def _pool_closing(comp: V4Compressor, raw_T2w: jax.Array, pos_T: jax.Array, req_T: jax.Array, requests: Requests,
                  ring_NSw: jax.Array, t_C: jax.Array, ok_C: jax.Array) -> jax.Array:
    """Pooled float32 rows [C, d] of the windows closing at rows t_C (those with ok_C, a prefix; zeros or any finite
    value in the rest), from this step's raw [kv, gate + ape] rows [T, 2, w] and the compressor's ring (the
    positions before each request's first one of the step). Narrow windows (CSA) in one batched pass, which reads
    the ring only when a closing window reaches before its request's rows of the step (not in a prefill chunk that
    starts at a window boundary, e.g. every fresh prompt); wide ones (HCA) on a CPU in a loop over the closing
    windows."""
    T, S = raw_T2w.shape[0], ring_NSw.shape[1]
    p_C, rq_C = pos_T[t_C], req_T[t_C]
    q_CS = p_C[:, None] - (S - 1) + jnp.arange(S)  # the window's positions, oldest first
    in_step = q_CS >= requests.start_R[rq_C][:, None]
    row_CS = jnp.clip(t_C[:, None] - (p_C[:, None] - q_CS), 0, T - 1)  # a request's rows are in order
    slot_C = requests.slot_R[rq_C]
    pool = functools.partial(_pool_window, comp)
    if S < LOOP_MIN_SLOTS or jax.default_backend() != "cpu":
        with_ring = lambda: jnp.where(in_step[:, :, None, None], raw_T2w[row_CS],  # noqa: E731
                                      ring_NSw[slot_C[:, None], q_CS % S])
        reads_ring = jnp.any(ok_C[:, None] & ~in_step & (q_CS >= 0))  # positions < 0 weigh nothing: never read
        return jax.vmap(pool)(jax.lax.cond(reads_ring, with_ring, lambda: raw_T2w[row_CS]), q_CS)

    def one(c, out_Cd):
        win = jnp.where(in_step[c][:, None, None], raw_T2w[row_CS[c]], ring_NSw[slot_C[c], q_CS[c] % S])
        return out_Cd.at[c].set(pool(win, q_CS[c]))

    return jax.lax.fori_loop(0, jnp.sum(ok_C), one, jnp.zeros((t_C.shape[0], comp.head_dim), jnp.float32))


def _pool_window(comp: V4Compressor, win_S2w: jax.Array, q_S: jax.Array) -> jax.Array:
    """One window's pooled float32 row [d] from its raw [kv, gate + ape] rows [S, 2, w] at positions q_S (those
    below 0 weigh nothing)."""
    r, d = comp.ratio, comp.head_dim
    kv, gate = win_S2w[:, 0], win_S2w[:, 1]
    if comp.overlap:  # slots [0, r): the previous window's Ca; [r, 2r): this window's Cb
        kv = jnp.concatenate([kv[:r, :d], kv[r:, d:]], axis=0)
        gate = jnp.concatenate([gate[:r, :d], gate[r:, d:]], axis=0)
    gate = jnp.where((q_S >= 0)[:, None], gate, -jnp.inf)
    return jnp.sum(jax.nn.softmax(gate, axis=0) * kv, axis=0)


def _advance_ring(raw_T2w: jax.Array, pos_T: jax.Array, req_T: jax.Array, valid_T: jax.Array, requests: Requests,
                  ring_NSw: jax.Array) -> jax.Array:
    """The ring with each request's last S positions of this step written (position q at q % S)."""
    S = ring_NSw.shape[1]
    keep = valid_T & (pos_T >= requests.end_R[req_T] - S)
    slot = jnp.where(keep, requests.slot_R[req_T], ring_NSw.shape[0])  # out of range -> dropped
    return ring_NSw.at[slot, pos_T % S].set(raw_T2w, mode="drop")
