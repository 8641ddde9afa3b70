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

from serving.runtime.step import KeptRows, SegmentCarry


def kept_rows(num_tokens: int, end: int, kv_floor: int, window: int, trim: bool) -> tuple[int, int]:
    """(rows of this chunk that run after the cut - its last ones -, their SWA floor in those layers)."""
    if not trim:
        return num_tokens, kv_floor
    return min(num_tokens, window), max(kv_floor, end - window)


def gather_kept(carry: SegmentCarry, kept: KeptRows) -> SegmentCarry:
    """Segment 2's inputs: the kept rows of segment 1's carry. (The cut layer's attention also reads the
    window rows before each kept row, trimmed ones included: it takes them from the whole carry's `kv_Td`
    through `kept.row_K`.)"""
    return jax.tree.map(lambda a: a[kept.row_K], carry)
