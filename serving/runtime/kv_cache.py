"""The hybrid KV cache of V4.1 (spec §3.2), and of V4-Flash, as a pytree of device arrays, sized from a memory
budget.

Groups:
  rows[s]  global (compressed) KV of KV source s, paged: [num_blocks, block_size / ratio, d]
  keys[s]  its index keys, paged with the same block ids:  [num_blocks, block_size / ratio, ihd]
  swa[l]   every layer's sliding window, request-private ring (position p at p % W): [num_slots, W, d]
  tail[s]  ratio-2 sources: the open group's raw fp32 [kv, gate] rows, per slot: [num_slots, 2, d]
  pool[s], index_pool[s]  V4 sources (CSA ratio 4, HCA ratio 128) and their indexers' compressors: the raw fp32
           [kv, gate + ape] of the request's last S positions, per slot (serving.runtime.v4_kv):
           [num_slots, S, 2, width] (CSA: S = 8, width 2d for the two overlapping series; HCA: S = 128, width d)
  draft[k] speculative decoding: DSpark stage k's context ring, like swa: [num_slots, W, d]
Only `rows` and `keys` are prefix-cacheable (one block id covers block_size positions of every source).
Engram look-back ids are host data (the scheduler holds every request's tokens).

Storage formats: "auto" keeps the compute dtype (exact); "release" stores DeepSeek's records - SWA FP8
e4m3 + UE8M0 per 32 (528 B/row), global NVFP4 (288 B/row), index keys MXFP4 (68 B/row) - as uint8.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from dsv41 import quant
from dsv41.config import ModelConfig

FORMATS = ("auto", "release")
PRIVATE_GROUPS = ("swa", "tail", "pool", "index_pool", "draft")  # per request slot, never prefix-cached


def pool_ring(ratio: int, d: int) -> tuple[int, int, int]:
    """A V4 compressor's per-slot state: (positions S, [kv, gate], width). CSA (ratio 4) pools two overlapping
    series of width d over the previous and the current window; HCA (ratio 128) one series over its window."""
    k = 2 if ratio == 4 else 1
    return k * ratio, 2, k * d


@dataclass(frozen=True)
class CacheLayout:
    """Static description of a cache: what the compiled step functions are specialised on."""

    config: ModelConfig
    num_blocks: int
    block_size: int
    num_slots: int
    fmt: str = "auto"
    dtype: str = "float32"  # compute dtype of the rows when fmt == "auto"
    draft_stages: int = 0  # speculative decoding: the DSpark stages' context rings

    def __post_init__(self):
        c = self.config
        if self.fmt not in FORMATS:
            raise ValueError(f"kv cache format {self.fmt!r}: choose one of {FORMATS}")
        for s in self.sources:
            r = c.compress_ratios[s]
            if self.block_size % r or (self.block_size // r) % max(c.candidate_block_size, 1):
                raise ValueError(f"block_size {self.block_size} must hold whole ratio-{r} rows and whole "
                                 f"candidate blocks of {c.candidate_block_size} rows")

    @property
    def sources(self) -> tuple[int, ...]:
        return tuple(r.layer_id for r in self.config.roles if r.is_kv_source)

    @property
    def index_sources(self) -> tuple[int, ...]:
        """KV sources that own index keys (an indexer with wk)."""
        return tuple(r.layer_id for r in self.config.roles if r.is_kv_source and r.is_index_source)

    @property
    def v4_sources(self) -> tuple[int, ...]:
        """V4 compat: every compressed layer is its own KV source with windowed compressor state."""
        return self.sources if self.config.family == "v4" else ()

    def rows_per_block(self, source: int) -> int:
        return self.block_size // self.config.compress_ratios[source]

    @property
    def window(self) -> int:
        return self.config.sliding_window

    # ------------------------------------------------------------------ row byte widths
    def _width(self, kind: str) -> tuple[int, jnp.dtype]:
        c = self.config
        if self.fmt == "auto":
            d = {"swa": c.head_dim, "rows": c.head_dim, "keys": c.index_head_dim}[kind]
            return d, jnp.dtype(self.dtype)
        nbytes = {"swa": quant.fp8_record_bytes(c.head_dim), "rows": quant.nvfp4_record_bytes(c.head_dim),
                  "keys": quant.mxfp4_record_bytes(c.index_head_dim)}[kind]
        return nbytes, jnp.dtype(jnp.uint8)

    def shapes(self) -> dict:
        """{group: {layer: ShapeDtypeStruct}}: the cache pytree, abstractly."""
        c, W = self.config, self.window
        sw, sdt = self._width("swa")
        rw, rdt = self._width("rows")
        kw, kdt = self._width("keys")
        S = jax.ShapeDtypeStruct
        draft = {"draft": {k: S((self.num_slots, W, sw), sdt) for k in range(self.draft_stages)}
                 } if self.draft_stages else {}
        return {
            "swa": {layer: S((self.num_slots, W, sw), sdt) for layer in range(c.num_hidden_layers)},
            "rows": {s: S((self.num_blocks, self.rows_per_block(s), rw), rdt) for s in self.sources},
            "keys": {s: S((self.num_blocks, self.rows_per_block(s), kw), kdt) for s in self.index_sources},
            "tail": {s: S((self.num_slots, 2, c.head_dim), jnp.float32) for s in self.sources
                     if c.compress_ratios[s] == 2 and c.family == "v41"},
            "pool": {s: S((self.num_slots, *pool_ring(c.compress_ratios[s], c.head_dim)), jnp.float32)
                     for s in self.v4_sources},
            "index_pool": {s: S((self.num_slots, *pool_ring(c.compress_ratios[s], c.index_head_dim)), jnp.float32)
                           for s in self.v4_sources if s in self.index_sources},
            **draft,
        }

    # ------------------------------------------------------------------ bytes
    def bytes_per_block(self) -> int:
        sh = self.shapes()
        return sum(_nbytes(a) // self.num_blocks for g in ("rows", "keys") for a in sh[g].values())

    def bytes_per_slot(self) -> int:
        sh = self.shapes()
        return sum(_nbytes(a) // self.num_slots for g in PRIVATE_GROUPS for a in sh.get(g, {}).values())

    def report(self) -> dict:
        """Bytes per token of the prefix-cacheable (global) groups and per request of the private ones."""
        return {"format": self.fmt, "num_blocks": self.num_blocks, "block_size": self.block_size,
                "num_slots": self.num_slots,
                "global_bytes_per_token": self.bytes_per_block() / self.block_size,
                "swa_and_tail_bytes_per_request": self.bytes_per_slot(),
                "total_bytes": self.bytes_per_block() * self.num_blocks + self.bytes_per_slot() * self.num_slots}


def _nbytes(s: jax.ShapeDtypeStruct) -> int:
    return int(np.prod(s.shape)) * jnp.dtype(s.dtype).itemsize


def smallest_block_size(config: ModelConfig, at_least: int = 8) -> int:
    """The smallest block size >= at_least that `CacheLayout` accepts: whole compressed rows and whole
    candidate blocks of every KV source per block."""
    unit = math.lcm(1, *(config.compress_ratios[r.layer_id] * max(config.candidate_block_size, 1)
                         for r in config.roles if r.is_kv_source))
    return -(-at_least // unit) * unit


def plan_layout(config: ModelConfig, *, memory_bytes: int, block_size: int, num_slots: int, max_model_len: int,
                fmt: str = "auto", dtype: str = "float32", draft_stages: int = 0) -> CacheLayout:
    """The largest cache fitting `memory_bytes`: the per-slot state of `num_slots` requests first, then
    as many blocks as fit (at least enough for one request of max_model_len)."""
    probe = CacheLayout(config, 1, block_size, num_slots, fmt, dtype, draft_stages)
    free = memory_bytes - probe.bytes_per_slot() * num_slots
    per_block = probe.bytes_per_block()
    need = -(-max_model_len // block_size)
    num_blocks = free // per_block if per_block else need
    if num_blocks < need:
        raise ValueError(f"KV memory budget {memory_bytes} B holds {max(num_blocks, 0)} blocks of {block_size} tokens "
                         f"after {num_slots} request slots; one request of max_model_len {max_model_len} needs {need}")
    return CacheLayout(config, int(num_blocks), block_size, num_slots, fmt, dtype, draft_stages)


def allocate(layout: CacheLayout) -> dict:
    """Zero-filled cache arrays on the default device."""
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), layout.shapes())


# ============================================================ row encode / decode per group
def encode(layout: CacheLayout, group: str, x: jax.Array) -> jax.Array:
    if layout.fmt == "auto":
        return x.astype(layout.dtype)
    return {"swa": quant.encode_fp8_record, "rows": quant.encode_nvfp4_record,
            "keys": quant.encode_mxfp4_record}[group](x)


def decode(layout: CacheLayout, group: str, r: jax.Array) -> jax.Array:
    """Stored rows -> float32 values."""
    if layout.fmt == "auto":
        return r.astype(jnp.float32)
    c = layout.config
    d = c.index_head_dim if group == "keys" else c.head_dim
    return {"swa": quant.decode_fp8_record, "rows": quant.decode_nvfp4_record,
            "keys": quant.decode_mxfp4_record}[group](r, d)


def after_reads(read: jax.Array, buffer: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(read, buffer), the buffer ordered after `read` (what was computed from its old contents): a write into
    the returned buffer then happens in place. Unordered, XLA keeps the old contents readable by copying the
    whole buffer (twice on XLA:CPU: a layer's SWA ring, a V4 compressor ring) every step."""
    return jax.lax.optimization_barrier((read, buffer))
