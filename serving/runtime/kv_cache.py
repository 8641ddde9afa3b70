"""The hybrid KV cache of V4.1 (spec §3.2), and of V4-Flash: a typed pytree of device arrays (`KVCache`), its
static description (`CacheLayout`), sized from a memory budget.

Each field of `KVCache` maps a layer, KV source or draft stage to one array:
  swa         every layer's sliding window, request-private ring (position p at p % W): [num_slots, W, width]
  rows        KV source s's global (compressed) KV, paged: [num_blocks, block_size / ratio, width]
  keys        its index keys, paged with the same block ids: [num_blocks, block_size / ratio, index width]
  tail        ratio-2 sources: the open group's raw fp32 [kv, gate] rows, per slot: [num_slots, 2, d]
  pool, index_pool  V4 sources (CSA ratio 4, HCA ratio 128) and their indexers' compressors: the raw fp32
              [kv, gate + ape] of the request's last S positions, per slot (serving.runtime.v4_kv):
              [num_slots, S, 2, width] (CSA: S = 8, width 2d for the two overlapping series; HCA: S = 128, width d)
  draft       speculative decoding: DSpark stage k's context ring, like swa: [num_slots, W, width]
Only `rows` and `keys` are prefix-cacheable (one block id covers block_size positions of every source); the others
are private to a request slot. Engram look-back ids are host data (the scheduler holds every request's tokens).

Storage formats (`RowFormat`): "auto" keeps the compute dtype (exact); "release" stores DeepSeek's records - SWA FP8
e4m3 + UE8M0 per 32 (528 B/row), global NVFP4 (288 B/row), index keys MXFP4 (68 B/row) - as uint8.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from dsv41 import quant
from dsv41.config import ModelConfig

FORMATS = ("auto", "release")


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class KVCache:
    """One rank's cache (see the module docstring for each field's arrays); also its abstract form (arrays of
    `jax.ShapeDtypeStruct`, `CacheLayout.shapes`) and its shardings. Fields a model does not use are empty."""

    swa: dict[int, jax.Array]  # layer -> [num_slots, W, width]
    rows: dict[int, jax.Array]  # KV source -> [num_blocks, block_size / ratio, width]
    keys: dict[int, jax.Array]  # index source -> [num_blocks, block_size / ratio, index width]
    tail: dict[int, jax.Array]  # ratio-2 source -> [num_slots, 2, d] float32
    pool: dict[int, jax.Array]  # V4 source -> [num_slots, S, 2, width] float32
    index_pool: dict[int, jax.Array]  # V4 index source -> [num_slots, S, 2, width] float32
    draft: dict[int, jax.Array]  # DSpark stage -> [num_slots, W, width]

    def updated(self, **arrays: dict[int, jax.Array]) -> KVCache:
        """This cache with some arrays replaced, e.g. `updated(rows={source: new})`; the others are kept."""
        return dataclasses.replace(self, **{f: {**getattr(self, f), **a} for f, a in arrays.items()})

    def paged(self) -> list[jax.Array]:
        """The prefix-cacheable arrays (one block id covers block_size positions of each)."""
        return [*self.rows.values(), *self.keys.values()]

    def private(self) -> list[jax.Array]:
        """The arrays private to a request slot."""
        return [*self.swa.values(), *self.tail.values(), *self.pool.values(), *self.index_pool.values(),
                *self.draft.values()]


@dataclass(frozen=True)
class RowFormat:
    """How one kind of row is stored: the compute dtype (`record` None, exact) or a release record of uint8."""

    values: int  # channels of a decoded row
    record: str | None  # None, "fp8" (SWA), "nvfp4" (global rows) or "mxfp4" (index keys)
    dtype: str = "float32"  # the stored dtype without a record

    @property
    def width(self) -> int:
        """Stored elements per row."""
        return self.values if self.record is None else _RECORD_BYTES[self.record](self.values)

    @property
    def storage_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype) if self.record is None else jnp.dtype(jnp.uint8)

    def encode(self, x: jax.Array) -> jax.Array:
        return x.astype(self.dtype) if self.record is None else _ENCODE[self.record](x)

    def decode(self, r: jax.Array) -> jax.Array:
        """Stored rows -> float32 values."""
        return r.astype(jnp.float32) if self.record is None else _DECODE[self.record](r, self.values)


_RECORD_BYTES = {"fp8": quant.fp8_record_bytes, "nvfp4": quant.nvfp4_record_bytes, "mxfp4": quant.mxfp4_record_bytes}
_ENCODE = {"fp8": quant.encode_fp8_record, "nvfp4": quant.encode_nvfp4_record, "mxfp4": quant.encode_mxfp4_record}
_DECODE = {"fp8": quant.decode_fp8_record, "nvfp4": quant.decode_nvfp4_record, "mxfp4": quant.decode_mxfp4_record}


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

    # ------------------------------------------------------------------ row formats
    def _format(self, values: int, record: str) -> RowFormat:
        return RowFormat(values, None if self.fmt == "auto" else record, self.dtype)

    @property
    def swa_format(self) -> RowFormat:
        """SWA rings' rows (and the draft stages' rings)."""
        return self._format(self.config.head_dim, "fp8")

    @property
    def rows_format(self) -> RowFormat:
        """Global (compressed) rows."""
        return self._format(self.config.head_dim, "nvfp4")

    @property
    def keys_format(self) -> RowFormat:
        """Index keys."""
        return self._format(self.config.index_head_dim, "mxfp4")

    def shapes(self) -> KVCache:
        """The cache, abstractly (`jax.ShapeDtypeStruct` arrays)."""
        c, W, N, B = self.config, self.window, self.num_slots, self.num_blocks
        S = jax.ShapeDtypeStruct
        swa, rows, keys = self.swa_format, self.rows_format, self.keys_format
        return KVCache(
            swa={layer: S((N, W, swa.width), swa.storage_dtype) for layer in range(c.num_hidden_layers)},
            rows={s: S((B, self.rows_per_block(s), rows.width), rows.storage_dtype) for s in self.sources},
            keys={s: S((B, self.rows_per_block(s), keys.width), keys.storage_dtype) for s in self.index_sources},
            tail={s: S((N, 2, c.head_dim), jnp.float32) for s in self.sources
                  if c.compress_ratios[s] == 2 and c.family == "v41"},
            pool={s: S((N, *pool_ring(c.compress_ratios[s], c.head_dim)), jnp.float32) for s in self.v4_sources},
            index_pool={s: S((N, *pool_ring(c.compress_ratios[s], c.index_head_dim)), jnp.float32)
                        for s in self.v4_sources if s in self.index_sources},
            draft={k: S((N, W, swa.width), swa.storage_dtype) for k in range(self.draft_stages)},
        )

    def zeros(self) -> KVCache:
        """Zero-filled cache arrays on the default device."""
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), self.shapes())

    # ------------------------------------------------------------------ bytes
    def bytes_per_block(self) -> int:
        return sum(_nbytes(a) // self.num_blocks for a in self.shapes().paged())

    def bytes_per_slot(self) -> int:
        return sum(_nbytes(a) // self.num_slots for a in self.shapes().private())

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


def after_reads(read: jax.Array, buffer: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(read, buffer), the buffer ordered after `read` (what was computed from its old contents): a write into
    the returned buffer then happens in place. Unordered, XLA keeps the old contents readable by copying the
    whole buffer (twice on XLA:CPU: a layer's SWA ring, a V4 compressor ring) every step."""
    return jax.lax.optimization_barrier((read, buffer))
