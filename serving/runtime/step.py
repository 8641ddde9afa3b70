"""The typed contract of one step between the host and the two segment functions.

`StepBatch` is built on the host by `batch.build_step` (NumPy arrays, padded to the step's buckets) and
read on the device by the segments, attention and decoder replay:

  requests  [R]  per request of the rank (R = max_num_seqs, unused entries zero)
  rows      [T]  segment 1: every row the step computes, each request's rows contiguous and in order
  kept      [K]  segment 2: the rows that run after the CED cut (decoder replay), as indices into `rows`
  index_blocks_2  the dense indexer's trip counts: cache blocks holding the step's longest context, per
                  compress ratio (in INDEX_RATIOS order) - dynamic values, so no recompilation

Segment 1 receives the batch without `kept` and segment 2 without `rows`, so each compiles for its own
bucket only. `SegmentCarry` is what segment 1 leaves for segment 2 (in a persistent buffer of the largest
bucket: segment 2's shapes then depend on its own bucket alone).

With data parallelism every array has a leading rank dimension on the host; the per-rank function sees
one rank's arrays.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from dsv41.layers.mhc import HcMix
from pallas_kernels.tiles import QueryTiles


INDEX_RATIOS = (1, 2, 4, 128)  # V4.1's compress ratios, then V4's (CSA, HCA)


def _pytree(cls):
    return jax.tree_util.register_dataclass(dataclass(frozen=True)(cls))


@_pytree
class Requests:
    slot_R: jax.Array  # the request's row in the rank's per-slot state (SWA rings, compressor tails)
    start_R: jax.Array  # first position computed this step (the SWA ring holds the earlier ones)
    end_R: jax.Array  # one past the last position computed
    kv_floor_R: jax.Array  # encoder replay: SWA rows below this position are never read
    write_floor_R: jax.Array  # global / index rows whose last token is below this are not written
    decoder_floor_R: jax.Array  # after the cut: max(kv_floor, end - window) for trimmed requests
    block_table_RM: jax.Array  # the rank's paged blocks covering positions [0, end)


@_pytree
class Rows:
    """Segment 1's rows: every token of the step."""

    ids_T: jax.Array
    pos_T: jax.Array
    req_T: jax.Array  # request index of each row
    valid_T: jax.Array  # false on padding rows
    first_R: jax.Array  # each request's first row
    qlen_R: jax.Array  # its rows in this step
    tiles: QueryTiles  # attention / indexer work plan over these rows
    # Engram hash ids [T, engram layers, (max_ngram - 1) x heads], or with the tables in host memory the rows
    # gathered for them (dsv41.layers.engram.EngramRows); None without Engram
    engram_TEc: jax.Array | None
    # async scheduling: the previous step's sampled-token row holding the row's token (ids_T has a placeholder
    # there), -1 for a row whose id is in ids_T
    prev_T: jax.Array
    # async scheduling with Engram hash ids: per request, its pending row's look-back [R, engram layers,
    # max_ngram - 1, (lo, hi)] (dsv41.layers.engram: the device finishes that row's ids); None without them
    engram_look_back_RLS2: jax.Array | None = None


@_pytree
class KeptRows:
    """Segment 2's rows: each prefill's last `window` rows (all rows with decoder replay off), every decode row."""

    row_K: jax.Array  # index of the kept row in `Rows`
    valid_K: jax.Array
    first_R: jax.Array  # each request's first kept row
    qlen_R: jax.Array  # its kept rows
    logit_row_R: jax.Array  # the kept row whose logits are sampled (the request's last); with speculative decoding
    #                         [R, J]: its last J rows (a verification chunk's 1 + k rows; others repeat the last)
    tiles: QueryTiles
    prompt_next_K: jax.Array  # prompt logprobs: the token after each kept row of a chunk that asks (-1: none)


@_pytree
class StepBatch:
    requests: Requests
    index_blocks_2: jax.Array
    rows: Rows | None = None
    kept: KeptRows | None = None

    def segment1(self) -> StepBatch:
        return dataclasses.replace(self, kept=None)

    def segment2(self) -> StepBatch:
        return dataclasses.replace(self, rows=None)


@_pytree
class SegmentCarry:
    """Segment 1's rows as segment 2 resumes them: the cut layer stopped after its KV path."""

    R_TnD: jax.Array  # the residual streams entering the cut layer's attention
    x_TD: jax.Array  # the cut layer's normed attention input
    mix: HcMix  # the cut layer's attention mix
    kv_Td: jax.Array  # the cut layer's SWA rows (RoPE'd)
    ids_T: jax.Array
    pos_T: jax.Array
    req_T: jax.Array
    topk: dict[int, jax.Array]  # index source layer id -> its top-k row ids [T, index_topk], for the sources before
    #                             the cut that a layer of segment 2 reads (the candidate source lies at or after the
    #                             cut, so no candidate blocks cross it)
    tails: dict[int, jax.Array]  # speculative decoding: ratio-2 source -> every row's raw [kv, gate] [T, 2, d]
    #                              (serving.runtime.rollback restores a tail from it); empty otherwise


class PackedBatch:
    """A host batch's int32 / bool arrays in one int32 array per rank [R, N] (plus its other arrays as they
    are), so a step transfers one small array instead of ~17: on the CPU backend each transfer has a fixed cost
    whatever its size (docs/design/measurements.md). The tree structure and each
    array's offset, shape and dtype are the pytree's static part, so every bucket still compiles once and a
    call with another layout is refused like any other tree mismatch. `unpack()` inside the jitted function
    gives the original tree (slices of the packed array; any leading rank dimension is kept)."""

    def __init__(self, packed, others: tuple, layout: tuple):
        self.packed, self.others, self.layout = packed, others, layout

    @classmethod
    def pack(cls, tree) -> "PackedBatch":
        leaves, treedef = jax.tree.flatten(tree)
        R = np.shape(leaves[0])[0] if leaves else 1
        parts, others, specs, offset = [], [], [], 0
        for a in leaves:
            a = np.asarray(a)
            if a.dtype in (np.int32, np.bool_):
                parts.append(a.reshape(R, -1).astype(np.int32))
                specs.append(("packed", offset, a.shape[1:], a.dtype.name))
                offset += parts[-1].shape[1]
            else:
                specs.append(("other", len(others), None, None))
                others.append(a)
        packed = np.concatenate(parts, axis=1) if parts else np.zeros((R, 0), np.int32)
        return cls(packed, tuple(others), (treedef, tuple(specs)))

    def unpack(self):
        treedef, specs = self.layout
        lead = self.packed.shape[:-1]  # (R,) on the host's stacked arrays, () inside a per-rank function
        leaves = []
        for kind, at, shape, dtype in specs:
            if kind == "other":
                leaves.append(self.others[at])
                continue
            size = math.prod(shape)
            a = self.packed[..., at:at + size].reshape(lead + tuple(shape))
            a = a != 0 if dtype == "bool" else a.astype(jnp.dtype(dtype))
            leaves.append(_replicated_on_auto_axes(a))
        return jax.tree.unflatten(treedef, leaves)


def _replicated_on_auto_axes(a: jax.Array) -> jax.Array:
    """Inside a per-rank shard_map whose tensor-parallel axes stay automatic, an unpacked array is pinned
    replicated over them, as the separate arrays it replaces were: left to sharding propagation, V4 on dp=2 x tp=4
    failed a check of XLA's SPMD partitioner (PartitionGather -> ExpandDeviceGroupsWithIota, jaxlib 0.12). Outside
    a mesh, or with every axis manual, it is the array itself."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not mesh.auto_axes:
        return a
    return jax.lax.with_sharding_constraint(a, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))


jax.tree_util.register_pytree_node(PackedBatch, lambda p: ((p.packed, *p.others), p.layout),
                                   lambda layout, ch: PackedBatch(ch[0], tuple(ch[1:]), layout))


def unpacked(batch):
    """A segment function's batch as the segments read it (a plain StepBatch passes through)."""
    return batch.unpack() if isinstance(batch, PackedBatch) else batch
