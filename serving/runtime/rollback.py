"""KV rollback of rejected drafts: after a verification step the cache holds what it would hold had the
rejected tokens never been computed, byte for byte.

A verification chunk writes positions P .. P + k (P: the request's last emitted token, then its k drafts) in
every cache kind: each layer's SWA ring and each draft stage's ring at (slot, p % W), the global rows and
index keys that close at those positions, and - for ratio-2 KV sources - the open-group tail of the slot.
Before segment 1 `snapshot` copies what those sites hold (J = k + 1 rows per request and kind: a gather of a
few rows, no copy of the cache); once the target has accepted n drafts, `restore` writes the snapshot back at
the sites of positions P + n + 1 .. P + k, and sets each ratio-2 tail to what a chunk ending at P + n leaves:
the raw row of P + n when it opens a group (even), else the tail from before the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from serving.runtime.kv_cache import CacheLayout, KVCache


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class CacheSites:
    """What a verification step's sites held before it, per kind of store (as `KVCache`'s fields): the rings' and
    paged rows' [R, J, width] at positions start .. start + J - 1, and the ratio-2 tails [R, 2, d]."""

    swa: dict[int, jax.Array]
    draft: dict[int, jax.Array]
    rows: dict[int, jax.Array]
    keys: dict[int, jax.Array]
    tail: dict[int, jax.Array]


def _positions(start_R: jax.Array, J: int) -> jax.Array:
    return start_R[:, None] + jnp.arange(J)[None]


def _paged_site(layout: CacheLayout, source: int, pos_RJ: jax.Array, table_RM: jax.Array
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(block, offset) of the row position p belongs to, and whether p closes that row."""
    r, rpb = layout.config.compress_ratios[source], layout.rows_per_block(source)
    j = pos_RJ // r
    blk = jnp.take_along_axis(table_RM, jnp.minimum(j // rpb, table_RM.shape[1] - 1), axis=1)
    return blk, j % rpb, pos_RJ % r == r - 1


def snapshot(layout: CacheLayout, cache: KVCache, slot_R: jax.Array, start_R: jax.Array, table_RM: jax.Array,
             J: int) -> CacheSites:
    """What the sites of positions start_R .. + J - 1 hold, per kind of store."""
    pos = _positions(start_R, J)

    def ring(arrays: dict[int, jax.Array]) -> dict[int, jax.Array]:
        return {key: a[slot_R[:, None], pos % layout.window] for key, a in arrays.items()}

    def paged(arrays: dict[int, jax.Array]) -> dict[int, jax.Array]:
        out = {}
        for s, a in arrays.items():
            blk, off, _ = _paged_site(layout, s, pos, table_RM)
            out[s] = a[blk, off]
        return out

    return CacheSites(swa=ring(cache.swa), draft=ring(cache.draft), rows=paged(cache.rows), keys=paged(cache.keys),
                      tail={s: a[slot_R] for s, a in cache.tail.items()})


def restore(layout: CacheLayout, cache: KVCache, snap: CacheSites, slot_R: jax.Array, start_R: jax.Array,
            table_RM: jax.Array, n_draft_R: jax.Array, n_accepted_R: jax.Array, committed_raw: dict) -> KVCache:
    """The cache without positions start + n_accepted + 1 .. start + n_draft (requests with n_draft 0 untouched).
    `committed_raw` {ratio-2 source: [R, 2, d]}: the raw [kv, gate] row of each request's last committed
    position start + n_accepted, as segment 1 computed it."""
    J = next(iter(snap.swa.values())).shape[1]
    pos = _positions(start_R, J)
    i = jnp.arange(J)[None]
    rejected = (i > n_accepted_R[:, None]) & (i <= n_draft_R[:, None])  # [R, J]
    ring_slot = jnp.where(rejected, slot_R[:, None], layout.num_slots)  # out of range -> dropped

    def ring(arrays: dict[int, jax.Array], saved: dict[int, jax.Array]) -> dict[int, jax.Array]:
        return {key: a.at[ring_slot, pos % layout.window].set(saved[key], mode="drop") for key, a in arrays.items()}

    def paged(arrays: dict[int, jax.Array], saved: dict[int, jax.Array]) -> dict[int, jax.Array]:
        out = {}
        for s, a in arrays.items():
            blk, off, closes = _paged_site(layout, s, pos, table_RM)
            blk = jnp.where(rejected & closes, blk, layout.num_blocks)
            out[s] = a.at[blk, off].set(saved[s], mode="drop")
        return out

    spec = n_draft_R > 0
    last = start_R + n_accepted_R
    tail = {}
    for s, a in cache.tail.items():
        value = jnp.where((last % 2 == 0)[:, None, None], committed_raw[s], snap.tail[s])
        tail[s] = a.at[jnp.where(spec, slot_R, layout.num_slots)].set(value, mode="drop")
    return cache.updated(swa=ring(cache.swa, snap.swa), draft=ring(cache.draft, snap.draft),
                         rows=paged(cache.rows, snap.rows), keys=paged(cache.keys, snap.keys), tail=tail)
