"""Paged KV block manager with hash-chained prefix caching (host side, pure Python).

Only the *global* KV rows and indexer keys are paged: one block id covers ``block_size`` consecutive
token positions for every paged group at once. Sliding-window rings and compressor tails are
request-private state managed elsewhere. Device writes for masked rows are dropped, so there is no
null block and every id in ``0..num_blocks-1`` is usable.

Every block is in exactly one of three states:

* **referenced** -- ``ref[b] > 0``; ``ref[b]`` equals the number of live block tables holding ``b``
  (prefix hits let several requests share a block).
* **evictable** -- ``ref[b] == 0`` and ``b`` carries a hash; kept in ``_evictable`` in the order the
  blocks were freed (oldest first = next to evict). A prefix hit revives it.
* **free** -- ``ref[b] == 0`` and no hash; kept in ``_free`` and handed out before any eviction.

``_cached`` maps hash -> block and ``_hash`` maps block -> hash; the two are mutual inverses (a
bijection between hashes and hashed blocks). A block's hash is the chained digest
``blake2b(parent_hash + tokens_as_le_int64)``, so two blocks with identical contents but different
prefixes never collide. Only FULL blocks whose KV has been written (``commit``) get a hash; a
hash is dropped only when its block is evicted or by ``reset_prefix_cache``.

``snapshot()`` copies all of this into a frozen ``PoolSnapshot`` for inspection.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections import OrderedDict, deque
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

_ROOT_TAG = b"dsv41/paged-kv/prefix-root/v1"


def root_hash(extra_key: bytes = b"") -> bytes:
    """Parent digest of a sequence's first block; ``extra_key`` salts it (model, LoRA, ...)."""
    return hashlib.blake2b(_ROOT_TAG + b"\0" + extra_key, digest_size=16).digest()


def hash_block(parent: bytes, tokens: Sequence[int]) -> bytes:
    """Chained digest of one block: blake2b-128 over the parent digest and the tokens as LE int64."""
    packed = array("q", tokens)
    if sys.byteorder != "little":
        packed.byteswap()
    return hashlib.blake2b(parent + packed.tobytes(), digest_size=16).digest()


def chain_hashes(token_ids: Sequence[int], block_size: int, extra_key: bytes = b"") -> list[bytes]:
    """Hashes of every full block of ``token_ids``, in position order."""
    out: list[bytes] = []
    parent = root_hash(extra_key)
    for i in range(len(token_ids) // block_size):
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size])
        out.append(parent)
    return out


@dataclass(frozen=True)
class PrefixHit:
    num_tokens: int  # tokens covered by the hit (a multiple of block_size; 0 = miss)
    block_ids: tuple[int, ...]


@dataclass
class PrefixCacheStats:
    queries: int = 0  # tokens looked up
    hits: int = 0  # tokens covered by hits

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass(frozen=True)
class PoolSnapshot:
    """A copy of the pool's state at one moment, for inspection (tests, debugging); changing the pool later
    does not change it. Two snapshots are equal when the pool was in the same state."""

    ref_counts: tuple[int, ...]  # per block: live block tables holding it
    block_hashes: tuple[bytes | None, ...]  # per block: its chain hash, None if unhashed
    free: tuple[int, ...]  # unreferenced, never-hashed blocks, next handed out first
    evictable: tuple[int, ...]  # unreferenced hashed blocks, next evicted first
    cached: Mapping[bytes, int]  # hash -> block (the inverse of block_hashes)
    tables: Mapping[Hashable, tuple[int, ...]]  # per live request: its block table
    committed: Mapping[Hashable, int]  # per live request: full blocks registered in the cache so far


class BlockManager:
    """Ref-counted paged block pool with an LRU prefix cache. See the module docstring."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be positive")
        self.num_blocks: int = num_blocks
        self.block_size: int = block_size
        self.enable_prefix_caching: bool = enable_prefix_caching
        self.stats: PrefixCacheStats = PrefixCacheStats()
        self._ref: list[int] = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._tables: dict[Hashable, list[int]] = {}
        self._req_key: dict[Hashable, bytes] = {}  # extra_key given at admit
        self._req_hashes: dict[Hashable, list[bytes]] = {}  # chain hashes computed so far
        self._num_committed: dict[Hashable, int] = {}  # full blocks already registered

    # ---- queries ----------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref count 0 (never-cached free + cached-but-evictable)."""
        return len(self._free) + len(self._evictable)

    @property
    def usage(self) -> float:
        """Fraction of blocks with ref count > 0."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def block_table(self, req_id: Hashable) -> list[int]:
        return list(self._table(req_id))

    def snapshot(self) -> PoolSnapshot:
        """The whole pool's state, copied (O(num_blocks)): for tests and debugging, not the hot path."""
        return PoolSnapshot(tuple(self._ref), tuple(self._hash), tuple(self._free), tuple(self._evictable),
                            MappingProxyType(dict(self._cached)),
                            MappingProxyType({r: tuple(t) for r, t in self._tables.items()}),
                            MappingProxyType(dict(self._num_committed)))

    def lookup(self, token_ids: Sequence[int], extra_key: bytes = b"") -> PrefixHit:
        """Longest cached prefix of full blocks. Takes no references; a miss if caching is off."""
        blocks: list[int] = []
        if self.enable_prefix_caching:
            parent, bs = root_hash(extra_key), self.block_size
            for i in range(len(token_ids) // bs):
                parent = hash_block(parent, token_ids[i * bs:(i + 1) * bs])
                block = self._cached.get(parent)
                if block is None:
                    break
                blocks.append(block)
        hit = PrefixHit(len(blocks) * self.block_size, tuple(blocks))
        self.stats.queries += len(token_ids)
        self.stats.hits += hit.num_tokens
        return hit

    # ---- request lifecycle ------------------------------------------------------------------
    def admit(self, req_id: Hashable, token_ids: Sequence[int], hit: PrefixHit | None = None,
              extra_key: bytes = b"") -> None:
        """Start a request whose table begins with ``hit.block_ids`` (one reference taken on each).

        The hit must still be valid: each block must still hold the chain hash of the matching
        block of ``token_ids`` (an eviction between ``lookup`` and ``admit`` makes it stale)."""
        if req_id in self._tables:
            raise ValueError(f"req_id {req_id!r} is already live")
        blocks = hit.block_ids if hit is not None else ()
        if hit is not None and hit.num_tokens != len(blocks) * self.block_size:
            raise ValueError(f"hit covers {hit.num_tokens} tokens but has {len(blocks)} blocks")
        hashes = self._chain([], token_ids, len(blocks), extra_key)
        for i, (block, h) in enumerate(zip(blocks, hashes, strict=True)):
            if self._hash[block] != h:
                raise ValueError(f"stale prefix hit: block {block} (position block {i}) no longer "
                                 f"holds the prefix of req_id {req_id!r}")
        for block in blocks:
            if self._ref[block] == 0:
                del self._evictable[block]
            self._ref[block] += 1
        self._tables[req_id] = list(blocks)
        self._req_key[req_id] = extra_key
        self._req_hashes[req_id] = hashes
        self._num_committed[req_id] = len(blocks)

    def allocate(self, req_id: Hashable, num_tokens: int) -> bool:
        """Grow the table to cover positions [0, num_tokens). False, with no change, if the pool
        (free + evictable) is too small. Shrinking is not done: a smaller num_tokens is a no-op."""
        table = self._table(req_id)
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        need = -(-num_tokens // self.block_size) - len(table)
        if need > self.num_free_blocks:
            return False
        for _ in range(need):
            table.append(self._take_block())
        return True

    def commit(self, req_id: Hashable, token_ids: Sequence[int], num_computed: int,
               extra_key: bytes | None = None) -> None:
        """KV for positions [0, num_computed) is written: register every full block in that range.

        Idempotent. A block that already has a hash keeps it; if another block already holds the
        same hash, that mapping is kept and this block stays unhashed. ``extra_key`` defaults to
        the one given at ``admit`` and must match it."""
        table = self._table(req_id)
        key = self._req_key[req_id]
        if extra_key is not None and extra_key != key:
            raise ValueError(f"extra_key for req_id {req_id!r} differs from the one given at admit")
        if not 0 <= num_computed <= min(len(token_ids), len(table) * self.block_size):
            raise ValueError(f"num_computed {num_computed} outside [0, min(len(token_ids)="
                             f"{len(token_ids)}, allocated={len(table) * self.block_size})]")
        if not self.enable_prefix_caching:
            return
        n_full, start = num_computed // self.block_size, self._num_committed[req_id]
        if n_full <= start:
            return
        hashes = self._chain(self._req_hashes[req_id], token_ids, n_full, key)
        for i in range(start, n_full):
            block, h = table[i], hashes[i]
            if self._hash[block] is None and h not in self._cached:
                self._hash[block] = h
                self._cached[h] = block
        self._num_committed[req_id] = n_full

    def free(self, req_id: Hashable) -> None:
        """Drop the request's references, tail first, so a chain's tail is evicted before its head."""
        table = self._table(req_id)
        for block in reversed(table):
            self._ref[block] -= 1
            if self._ref[block] == 0:
                if self._hash[block] is not None:
                    self._evictable[block] = None
                else:
                    self._free.append(block)
        for d in (self._tables, self._req_key, self._req_hashes, self._num_committed):
            del d[req_id]

    def reset_prefix_cache(self) -> bool:
        """Drop every hash. Only allowed when no block is referenced; returns False otherwise."""
        if self.num_free_blocks != self.num_blocks:
            return False
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._cached.clear()
        self._hash = [None] * self.num_blocks
        return True

    # ---- helpers ----------------------------------------------------------------------------
    def _table(self, req_id: Hashable) -> list[int]:
        try:
            return self._tables[req_id]
        except KeyError:
            raise KeyError(f"unknown req_id {req_id!r}") from None

    def _chain(self, hashes: list[bytes], token_ids: Sequence[int], n_blocks: int,
               extra_key: bytes) -> list[bytes]:
        """Extend ``hashes`` (in place) to the first ``n_blocks`` chain hashes of ``token_ids``."""
        if n_blocks * self.block_size > len(token_ids):
            raise ValueError(f"{n_blocks} blocks need {n_blocks * self.block_size} tokens, "
                             f"got {len(token_ids)}")
        parent = hashes[-1] if hashes else root_hash(extra_key)
        bs = self.block_size
        for i in range(len(hashes), n_blocks):
            parent = hash_block(parent, token_ids[i * bs:(i + 1) * bs])
            hashes.append(parent)
        return hashes

    def _take_block(self) -> int:
        """A never-cached free block if any, else evict the least recently freed cached block."""
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._evictable.popitem(last=False)
            del self._cached[self._hash[block]]
            self._hash[block] = None
        self._ref[block] = 1
        return block
