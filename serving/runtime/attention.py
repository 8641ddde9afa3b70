"""One layer's attention against the paged cache (`paged_attention`), and its SWA ring write.

The attention is one call of the fused op `pallas_kernels.sparse_mla` under the block's `kernel_impl`
(MegaAttention's shape: query RoPE, the SWA window from the request's ring and this step's own rows, the
top-k global rows gathered from the paged cache, the sink, and the inverse RoPE of the output), the same
function whichever implementation runs it: `xla` on CPU, the Pallas kernel on a GPU. Under a mesh that
splits the heads it runs on each tensor-parallel rank's own heads (`sharding.runtime.on_local_heads`).

A query's keys (spec §2.5): its own layer's SWA rows of positions max(p - W + 1, floor) .. p - the ones
before the step's first position from the ring, the rest from this step's rows - plus, in compressed
layers, the global rows its index source selected. `floor` is replay_start (encoder replay) or, after the
CED cut, max(replay_start, seq_len - W) (decoder replay).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.sparse_attention import AttnMeta, sparse_mla
from serving.runtime.kv_cache import RowFormat
from sharding.runtime import on_local_heads


def paged_attention(q_THd: jax.Array, cos_Tr: jax.Array, sin_Tr: jax.Array, sink_H: jax.Array, kv_Nd: jax.Array,
                    ring_cache: jax.Array, meta: AttnMeta, *, rows_cache: jax.Array | None = None,
                    topk_Tk: jax.Array | None = None, impl: str, out_dtype=jnp.float32) -> jax.Array:
    """Attention output [T, H, d] in `out_dtype` (float32 values rounded once) after the inverse RoPE, from
    un-rotated queries q_THd and this step's RoPE'd SWA rows kv_Nd (the query at row t finds its own row at
    meta.kv_row_T[t]) over the SWA ring [num_slots, W, .] and the paged global rows `rows_cache` its top-k ids
    select (the model's `dsv41.layers.attention.masked_attention` over the same keys). A bucket of at most one row
    per request runs the kernel's split-key decode form."""
    decode = q_THd.shape[0] <= meta.slot_R.shape[0]

    def kernel(q, sink, cos, sin, kv, ring, meta, rows, topk):
        return sparse_mla(q, cos, sin, sink, kv, ring, meta, rows, topk, out_dtype=out_dtype, decode=decode,
                          impl=impl)

    return on_local_heads(kernel, q_THd, sink_H, cos_Tr, sin_Tr, kv_Nd, ring_cache, meta, rows_cache, topk_Tk)


def write_ring(fmt: RowFormat, ring_NWd: jax.Array, kv_Td: jax.Array, pos_T: jax.Array, slot_T: jax.Array,
               write_T: jax.Array) -> jax.Array:
    """Store rows, encoded in `fmt`, into the ring [num_slots, W, width] at [slot, pos % W] where `write_T` (a
    request's last W rows of the step)."""
    W = ring_NWd.shape[1]
    slot = jnp.where(write_T, slot_T, ring_NWd.shape[0])  # out of range -> dropped
    return ring_NWd.at[slot, pos_T % W].set(fmt.encode(kv_Td), mode="drop")
