"""Paged sparse attention of one layer over a step's tiles (the XLA path; `pallas_kernels` brings GPU ones).

Per tile (up to `tile` consecutive query rows of one request) the keys are:
  ring  the layer's SWA ring of the request: rows of positions [start - W, start) from earlier steps
  band  this step's own rows of the request within W - 1 rows before the tile (the new SWA rows)
  rows  each query's top-k global rows, gathered from the paged cache through the block table
A row is visible if it lies in the query's window [p - W + 1, p], at or above the request's floor
(encoder replay: replay_start; decoder replay: max(replay_start, seq_len - W) after the cut).
The softmax includes the per-head sink logit. Tiles are mapped in groups so memory stays bounded.
`fused_attention` runs the same through the Pallas kernel `pallas_kernels.sparse_mla` (on each
tensor-parallel rank's own heads under a mesh).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from dsv41.layers.attention import sink_softmax
from pallas_kernels.sparse_attention import AttnMeta, sparse_mla
from serving.runtime import kv_cache
from serving.runtime.kv_cache import CacheLayout
from sharding.runtime import on_local_heads

TILE_GROUP = 64  # tiles evaluated together (vectorised) per loop iteration of lax.map


class Tiles(NamedTuple):
    """A step's tiles over some flat row layout, with the per-request arrays they index."""

    req: jax.Array  # [NT] request index
    first: jax.Array  # [NT] flat index of the tile's first row
    n: jax.Array  # [NT] valid rows in the tile
    req_first: jax.Array  # [R] flat index of each request's first row in this layout
    req_qlen: jax.Array  # [R] rows of each request in this layout
    req_start: jax.Array  # [R] first position computed this step (where the ring ends)
    req_slot: jax.Array  # [R]
    floor: jax.Array  # [R] lowest visible SWA position
    block_table: jax.Array  # [R, max_blocks]
    size: int  # rows per tile (static)


def ring_positions(start: jax.Array, window: int) -> jax.Array:
    """Positions held by the ring slots [.., W] of a request whose next position is `start`: slot k holds
    the latest position < start congruent to k mod W (negative = never written)."""
    k = jnp.arange(window)
    return start[..., None] - 1 - jnp.mod(start[..., None] - 1 - k, window)


def tile_rows(tiles: Tiles, i: jax.Array, num_rows: int) -> tuple[jax.Array, jax.Array]:
    """Flat row indices [tile] of tile i (clamped) and their validity."""
    u = jnp.arange(tiles.size)
    return jnp.clip(tiles.first[i] + u, 0, num_rows - 1), u < tiles.n[i]


def flat_band(kv_Td: jax.Array, pos_T: jax.Array, tiles: Tiles, window: int) -> Callable:
    """band(i) -> (keys [W - 1 + tile, d], positions, ok): tile i's request rows in the flat layout."""
    T = kv_Td.shape[0]

    def band(i):
        r = tiles.req[i]
        idx = tiles.first[i] - (window - 1) + jnp.arange(window - 1 + tiles.size)
        ok = (idx >= tiles.req_first[r]) & (idx < tiles.req_first[r] + tiles.req_qlen[r])
        idx = jnp.clip(idx, 0, T - 1)
        return kv_Td[idx].astype(jnp.float32), pos_T[idx], ok

    return band


def gathered_band(keys: jax.Array, pos: jax.Array, ok: jax.Array) -> Callable:
    """band(i) from bands gathered ahead (the cut layer's rows in segment 2)."""
    return lambda i: (keys[i].astype(jnp.float32), pos[i], ok[i])


def attention(layout: CacheLayout, tiles: Tiles, q_THd: jax.Array, pos_T: jax.Array, band: Callable,
              ring_cache: jax.Array, sink_H: jax.Array, *, rows_cache: jax.Array | None = None,
              topk_Tk: jax.Array | None = None, rows_per_block: int = 0) -> jax.Array:
    """Attention output [T, H, d] (float32) for every row covered by a tile (others zero)."""
    T, H, d = q_THd.shape
    W = layout.window
    scale = d ** -0.5
    prec = jax.lax.Precision.HIGHEST

    def one_tile(i):
        rows, qok = tile_rows(tiles, i, T)
        r = tiles.req[i]
        q = q_THd[rows].astype(jnp.float32)
        qpos = pos_T[rows]
        bkv, bpos, bok = band(i)
        rkv = kv_cache.decode(layout, "swa", ring_cache[tiles.req_slot[r]])
        rpos = ring_positions(tiles.req_start[r], W)
        keys = jnp.concatenate([rkv, bkv])
        kpos = jnp.concatenate([rpos, bpos])
        kok = jnp.concatenate([rpos >= 0, bok]) & (kpos >= tiles.floor[r])
        vis = kok[None] & (kpos[None] <= qpos[:, None]) & (kpos[None] > qpos[:, None] - W)  # [tile, K]
        logits = [jnp.where(vis[:, None], jnp.einsum("uhd,kd->uhk", q, keys, precision=prec) * scale, -jnp.inf)]
        values = [keys]
        if topk_Tk is not None:
            idx = topk_Tk[rows]  # [tile, k]
            blk = tiles.block_table[r][jnp.clip(idx // rows_per_block, 0, tiles.block_table.shape[1] - 1)]
            g = kv_cache.decode(layout, "rows", rows_cache[blk, idx % rows_per_block])  # [tile, k, d]
            logits.append(jnp.where((idx >= 0)[:, None], jnp.einsum("uhd,ukd->uhk", q, g, precision=prec) * scale,
                                    -jnp.inf))
            values.append(g)
        probs, denom = sink_softmax(logits, sink_H)
        out = jnp.einsum("uhk,kd->uhd", probs[0], values[0], precision=prec)
        if len(probs) > 1:
            out = out + jnp.einsum("uhk,ukd->uhd", probs[1], values[1], precision=prec)
        return jnp.where(qok[:, None, None], out / denom, 0.0)

    NT = tiles.req.shape[0]
    o = jax.lax.map(one_tile, jnp.arange(NT), batch_size=min(TILE_GROUP, NT))  # [NT, tile, H, d]
    dest = tiles.first[:, None] + jnp.arange(tiles.size)
    dest = jnp.where(jnp.arange(tiles.size)[None] < tiles.n[:, None], dest, T)  # padding rows -> dropped
    return jnp.zeros((T, H, d), jnp.float32).at[dest.reshape(-1)].set(o.reshape(-1, H, d), mode="drop")


def fused_attention(layout: CacheLayout, tiles: Tiles, q_THd: jax.Array, pos_T: jax.Array, req_T: jax.Array,
                    kv_Td: jax.Array, ring_cache: jax.Array, sink_H: jax.Array, *, rows_cache: jax.Array | None = None,
                    topk_Tk: jax.Array | None = None, impl: str = "pallas") -> jax.Array:
    """`attention` through the fused kernel, [T, H, d] float32 before the inverse RoPE (like `attention`).

    The kernel takes a query's in-step SWA rows from kv_Td at its own flat row minus the position offset,
    so each request's rows must be contiguous from `req_start` in q's layout: true in segment 1 and, after
    the cut, in segment 2 (rows trimmed there lie below the decoder floor, masked); not for the cut layer
    in segment 2, whose kept rows read trimmed rows (its gathered band). q and kv are RoPE'd already and
    `Attention.output` inverts the RoPE, so the kernel's own rotations run with identity angles. Buckets of
    at most one row per request use the split-key decode form."""
    T = q_THd.shape[0]
    meta = AttnMeta(pos_T, req_T, tiles.req_slot, tiles.req_start, tiles.floor, tiles.block_table)

    def kernel(q, sink, kv, ring, meta, rows, topk):
        identity = jnp.ones((T, 1), jnp.float32), jnp.zeros((T, 1), jnp.float32)
        return sparse_mla(q, *identity, sink, kv, ring, meta, rows, topk, decode=T <= tiles.req_slot.shape[0],
                          impl=impl)

    return on_local_heads(kernel, q_THd, sink_H, kv_Td, ring_cache, meta, rows_cache, topk_Tk)


def write_ring(layout: CacheLayout, ring_cache: jax.Array, kv_Td: jax.Array, pos_T: jax.Array, slot_T: jax.Array,
               write_T: jax.Array) -> jax.Array:
    """Store rows into the ring at [slot, pos % W] where `write_T` (a request's last W rows of the step)."""
    W = layout.window
    slot = jnp.where(write_T, slot_T, ring_cache.shape[0])  # out of range -> dropped
    return ring_cache.at[slot, pos_T % W].set(kv_cache.encode(layout, "swa", kv_Td), mode="drop")
