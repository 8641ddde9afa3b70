"""Decoder-side SWA bounded replay (spec §3.3): which rows run the layers after the CED cut.

Layer `cut` (the last KV source) projects the global KV every later layer reads, so after segment 1 has
run layers 0 .. cut-1 and the cut layer's KV path on every row, the rest only needs each prefill's last
`window` rows ("kept rows"): the only rows whose decoder-layer SWA KV a later token reads, and the last
row's hidden state. Decode rows and requests that keep all rows (prompt logprobs, replay off) are never
trimmed. In layers after the cut a kept row's window starts at max(replay_start, seq_len - window); the
cut layer wrote every row's SWA KV, so its window is only clipped by replay_start.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def kept_rows(num_tokens: int, end: int, kv_floor: int, window: int, trim: bool) -> tuple[int, int]:
    """(rows of this chunk that run after the cut - its last ones -, their SWA floor in those layers)."""
    if not trim:
        return num_tokens, kv_floor
    return min(num_tokens, window), max(kv_floor, end - window)


def gather_kept(carry: dict, b2: dict, *, window: int, tile: int) -> dict:
    """Segment 2's inputs: the kept rows of segment 1's carry (rows indexed by `b2["kept"]` in the step's
    flat layout), and each kept tile's band of cut-layer SWA rows from the full step (a kept row's window
    reaches W - 1 rows back, into trimmed rows)."""
    k = b2["kept"]
    kept = jax.tree.map(lambda a: a[k], {n: v for n, v in carry.items() if v is not None})
    T = carry["kv"].shape[0]
    f0 = k[b2["tile_first"]]
    idx = f0[:, None] - (window - 1) + jnp.arange(window - 1 + tile)
    r = b2["tile_req"]
    lo, hi = b2["req_first"][r], b2["req_first"][r] + b2["req_qlen"][r]
    ok = (idx >= lo[:, None]) & (idx < hi[:, None])
    idx = jnp.clip(idx, 0, T - 1)
    kept["band"] = (carry["kv"][idx], carry["pos"][idx], ok)
    return kept


