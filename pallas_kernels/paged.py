"""Rows of a paged cache, the one gather the fused ops share (sparse MLA's top-k global rows, the indexer's keys).

A request's row j lives in cache block block_table[req, j // rows_per_block] at offset j % rows_per_block; a
cache is [num_blocks, rows_per_block, width] of release records (uint8, `records`: values, then scale bytes) or
float rows. `gather_rows` is the XLA form (whole records gathered, then decoded), `load_rows` the Pallas kernel
form (`records.load`), both on `row_address`; `decode_blocks` decodes whole blocks for the XLA paths that scan
a request's blocks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import records


def row_address(block_table, req, row_ids: jax.Array, rows_per_block: int) -> tuple[jax.Array, jax.Array]:
    """(cache block, offset in the block) of each row id of request(s) `req` (broadcasting against row_ids).
    `block_table` [R, M] is an array or a Pallas ref. Ids past the table read its last block and negative ids its
    first: callers mask those rows."""
    M = block_table.shape[1]
    return block_table[req, jnp.clip(row_ids // rows_per_block, 0, M - 1)], row_ids % rows_per_block


def gather_rows(cache_NPx: jax.Array, kind: str, d: int, block_table_RM: jax.Array, req, row_ids: jax.Array,
                decode=None) -> jax.Array:
    """Float32 rows [..., d] of row_ids [...] (XLA). `kind`: the record kind of a uint8 cache; `decode` (default
    `records.decode_rows`; `records.reference_decode` for the spec references) turns records into floats."""
    blk, at = row_address(block_table_RM, req, row_ids, cache_NPx.shape[1])
    return (decode or records.decode_rows)(kind, cache_NPx[blk, at], d)


def decode_blocks(cache_NPx: jax.Array, kind: str, d: int, blocks: jax.Array) -> jax.Array:
    """Float32 rows [..., rows_per_block, d] of whole cache blocks (block ids [...]) (XLA)."""
    return records.decode_rows(kind, cache_NPx[blocks], d)


def load_rows(cache_ref, kind: str, d: int, block_table_ref, req, row_ids: jax.Array) -> jax.Array:
    """Float32 rows [n, d] of row_ids [n] inside a Pallas kernel (refs to the cache and the block table)."""
    return records.load(kind, cache_ref, row_address(block_table_ref, req, row_ids, cache_ref.shape[1]), d)
