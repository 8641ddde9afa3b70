"""V4-Flash's compressed KV in the serving runtime (compat mode, spec §2.6 V4): CSA (ratio 4, two overlapping
series) and HCA (ratio 128) rows written to the paged cache as their windows close, from per-slot state.

A V4 compressor pools a window of r tokens with a per-channel softmax over gate + ape; CSA pools 2r slots, the
previous window's first series (Ca) and this window's second one (Cb). A chunk seldom covers whole windows, so
every V4 KV source keeps the raw [kv, gate + ape] of its request's last S positions in a per-slot ring
(`cache["pool"][layer]`, position q at q % S, S = 2r for CSA and r for HCA; the CSA indexer's own compressor
in `cache["index_pool"]`). A row closing at position p (p % r == r - 1) reads positions p - S + 1 .. p from
this step's rows where the step has them and from the ring below the request's first position of the step;
positions < 0 weigh nothing (CSA's window 0). At most T // r + min(T, R) rows close in a step of T rows and R
requests, so only those are pooled; a step of fewer rows than r (every decode step of an HCA layer) pools only when
one of its windows closes. Rows closing below the write floor (a prefix hit's cached rows) are kept.

Prefix hits are block aligned and a block holds whole ratio-128 windows (`CacheLayout` checks it), so a window
closing at or after the hit starts at or after it: the replayed rows refill the ring before any row reads it.

HCA layers attend to every visible row of their own compressed KV (no indexer): `global_kv.all_rows` gives a
query the ids 0 .. (p + 1) // r - 1, -1 beyond, as wide as a request's block table holds rows: the same top-k
form the sparse attention takes for CSA's indexer rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv41.layers.compressor import V4Compressor
from dsv41.layers.indexer import Indexer
from dsv41.layers.rope import apply_rope, inv_freq, rope_angles
from dsv41.quant import fake_quant_nvfp4
from serving.runtime import kv_cache
from serving.runtime.kv_cache import CacheLayout
from serving.runtime.step import Requests


def publish(layout: CacheLayout, block, x_TD: jax.Array, pos_T: jax.Array, req_T: jax.Array, valid_T: jax.Array,
            requests: Requests, cache: dict, fake_quant: bool) -> dict:
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
    cos, sin = rope_angles(j_C * r, inv_freq(c, "compress"))
    rpb = layout.rows_per_block(s)
    blk = jnp.where(ok_C, requests.block_table_RM[rq_C, j_C // rpb], layout.num_blocks)  # out of range -> dropped
    cache = dict(cache)

    def pool(comp: V4Compressor, group: str) -> jax.Array:
        ring = cache[group][s]
        raw_T2w = jnp.stack([comp.wkv(x_TD, jnp.float32), comp.wgate(x_TD, jnp.float32) + comp.ape[...][pos_T % r]], 1)
        closing_rows = lambda: _pool_closing(comp, raw_T2w, pos_T, req_T, requests, ring, t_C)  # noqa: E731
        if r > T:  # a window closes in few such steps (an HCA layer's decode: 1 in 128): skip its pooling in the rest
            pooled_Cd = jax.lax.cond(jnp.any(ok_C), closing_rows,
                                     lambda: jnp.zeros((n_close, comp.head_dim), jnp.float32))
        else:
            pooled_Cd = closing_rows()
        pooled_Cd, ring = kv_cache.after_reads(pooled_Cd, ring)
        cache[group] = {**cache[group], s: _advance_ring(raw_T2w, pos_T, req_T, valid_T, requests, ring)}
        return comp.norm(pooled_Cd, x_TD.dtype)

    rows = apply_rope(pool(block.attn.compressor, "pool"), cos, sin)
    rows = fake_quant_nvfp4(rows) if fake_quant else rows
    cache["rows"] = {**cache["rows"], s: cache["rows"][s].at[blk, j_C % rpb].set(
        kv_cache.encode(layout, "rows", rows), mode="drop")}
    ix = block.attn.indexer
    if ix is not None:
        keys = Indexer.rotate_keys(pool(ix.compressor, "index_pool"), cos, sin, fake_quant)
        cache["keys"] = {**cache["keys"], s: cache["keys"][s].at[blk, j_C % rpb].set(
            kv_cache.encode(layout, "keys", keys), mode="drop")}
    return cache


def _pool_closing(comp: V4Compressor, raw_T2w: jax.Array, pos_T: jax.Array, req_T: jax.Array, requests: Requests,
                  ring_NSw: jax.Array, t_C: jax.Array) -> jax.Array:
    """Pooled float32 rows [C, d] of the windows closing at rows t_C, from this step's raw [kv, gate + ape] rows
    [T, 2, w] and the compressor's ring (the positions before each request's first one of the step)."""
    r, d = comp.ratio, comp.head_dim
    T, S = raw_T2w.shape[0], ring_NSw.shape[1]
    p_C, rq_C = pos_T[t_C], req_T[t_C]
    q_CS = p_C[:, None] - (S - 1) + jnp.arange(S)  # the window's positions, oldest first
    in_step = q_CS >= requests.start_R[rq_C][:, None]
    step_rows = raw_T2w[jnp.clip(t_C[:, None] - (p_C[:, None] - q_CS), 0, T - 1)]  # a request's rows are in order
    ring_rows = ring_NSw[requests.slot_R[rq_C][:, None], q_CS % S]
    win = jnp.where(in_step[:, :, None, None], step_rows, ring_rows)  # [C, S, 2, w]
    kv, gate = win[:, :, 0], win[:, :, 1]
    if comp.overlap:  # slots [0, r): the previous window's Ca; [r, 2r): this window's Cb
        kv = jnp.concatenate([kv[:, :r, :d], kv[:, r:, d:]], axis=1)
        gate = jnp.concatenate([gate[:, :r, :d], gate[:, r:, d:]], axis=1)
    gate = jnp.where((q_CS >= 0)[:, :, None], gate, -jnp.inf)
    return jnp.sum(jax.nn.softmax(gate, axis=1) * kv, axis=1)


def _advance_ring(raw_T2w: jax.Array, pos_T: jax.Array, req_T: jax.Array, valid_T: jax.Array, requests: Requests,
                  ring_NSw: jax.Array) -> jax.Array:
    """The ring with each request's last S positions of this step written (position q at q % S)."""
    S = ring_NSw.shape[1]
    keep = valid_T & (pos_T >= requests.end_R[req_T] - S)
    slot = jnp.where(keep, requests.slot_R[req_T], ring_NSw.shape[0])  # out of range -> dropped
    return ring_NSw.at[slot, pos_T % S].set(raw_T2w, mode="drop")
