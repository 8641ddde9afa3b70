"""A step's host inputs, built for given buckets: the scheduler's chunks split over the data-parallel ranks, each
rank's batch padded to the same buckets (`batch.build_step`) and stacked, and where each chunk's logits land.

With Engram tables in host memory the batch carries the rows the step gathers from them instead of their ids. With
speculative decoding `spec_inputs` gives the verification's per-request arrays.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence

import jax
import numpy as np

from serving.runtime.batch import Buckets, EngramHashing, SeqChunk, build_step
from serving.runtime.decoder_replay import kept_rows
from serving.runtime.kv_cache import CacheLayout
from serving.runtime.spec_step import SpecInputs
from serving.runtime.step import StepBatch


class BuiltStep(NamedTuple):
    """A step's host batch and where its chunks' outputs are."""

    batch: StepBatch  # every array with a leading rank dimension
    rows: np.ndarray  # [chunks] each chunk's logits row among the step's [ranks x max_num_seqs]
    where: list[tuple[int, int]]  # each chunk's (rank, index in the rank)


class StepBuilder:
    def __init__(self, model, layout: CacheLayout, buckets: Buckets, *, ranks: int, max_model_len: int,
                 verify_rows: int):
        c = model.config
        self.config, self.layout, self.buckets, self.ranks = c, layout, buckets, ranks
        self.max_blocks = -(-max_model_len // layout.block_size)
        self.verify_rows = verify_rows
        self.decoder_replay = c.family == "v41"  # V4 has no CED cut: no chunk is trimmed
        self.engram_tables = model.engram_tables
        self.engram_hashing = None if model.engram is None else EngramHashing(model.engram, model.token_map)

    def split(self, chunks: Sequence[SeqChunk]) -> tuple[list[list[SeqChunk]], list[tuple[int, int]]]:
        """The chunks of each rank, and each chunk's (rank, index in the rank)."""
        by_rank: list[list[SeqChunk]] = [[] for _ in range(self.ranks)]
        where = []
        for ch in chunks:
            if not 0 <= ch.rank < self.ranks:
                raise ValueError(f"request in slot {ch.slot}: rank {ch.rank} outside the {self.ranks} "
                                 "data-parallel ranks")
            where.append((ch.rank, len(by_rank[ch.rank])))
            by_rank[ch.rank].append(ch)
        return by_rank, where

    def demand(self, by_rank: list[list[SeqChunk]]) -> tuple[int, int]:
        """The rows of the busiest rank in segment 1 and in segment 2 (after decoder-replay trimming)."""
        W = self.config.sliding_window
        tokens = max(sum(ch.num_tokens for ch in r) for r in by_rank)
        kept = max(sum(kept_rows(ch.num_tokens, ch.end, ch.kv_floor, W, ch.trims and self.decoder_replay)[0]
                       for ch in r) for r in by_rank)
        return tokens, kept

    def build(self, by_rank: list[list[SeqChunk]], where: list[tuple[int, int]], token_bucket: int,
              kept_bucket: int) -> BuiltStep:
        built = [self.rank_batch(r, token_bucket, kept_bucket) for r in by_rank]
        batch = jax.tree.map(lambda *a: np.stack(a), *built)
        rows = np.array([r * self.buckets.max_num_seqs + j for r, j in where], np.int32)
        return BuiltStep(batch, rows, where)

    def rank_batch(self, chunks: Sequence[SeqChunk], token_bucket: int, kept_bucket: int) -> StepBatch:
        """One rank's batch (no rank dimension)."""
        batch = build_step(chunks, self.buckets, max_blocks=self.max_blocks, window=self.config.sliding_window,
                           block_size=self.layout.block_size, verify_rows=self.verify_rows,
                           decoder_replay=self.decoder_replay, engram=self.engram_hashing,
                           token_bucket=token_bucket, kept_bucket=kept_bucket)
        if self.engram_tables is not None:  # host tables: the step carries its rows, not their ids
            rows = self.engram_tables.gather(batch.rows.engram_TEc, valid=batch.rows.valid_T)  # no padding
            batch = dataclasses.replace(batch, rows=dataclasses.replace(batch.rows, engram_TEc=rows,
                                                                        engram_look_back_RLS2=None))
        return batch

    def example(self, token_bucket: int, kept_bucket: int) -> StepBatch:
        """A rank-stacked batch of these buckets (one one-token request): what a bucket is compiled on."""
        ch = SeqChunk(slot=0, block_table=[0], token_ids=[0], start=0, end=1)
        return self.build(*self.split([ch]), token_bucket, kept_bucket).batch

    def spec_inputs(self, chunks: Sequence[SeqChunk], batch: StepBatch, R: int) -> SpecInputs:
        """The verification's arrays of one rank's chunks, padded to R requests."""
        K = self.verify_rows - 1
        i32 = lambda *shape: np.zeros(shape, np.int32)  # noqa: E731
        slot, row0, n_draft, first, floor, drafts, active = i32(R), i32(R), i32(R), i32(R), i32(R), i32(R, K), i32(R)
        ban_rows = i32(R)
        for j, ch in enumerate(chunks):  # one rank: the chunk's index is its row
            nd = ch.num_draft
            slot[j], row0[j], n_draft[j], floor[j], active[j] = ch.slot, ch.end - 1 - nd, nd, ch.kv_floor, ch.sample
            first[j] = batch.rows.first_R[0, j] + ch.num_tokens - 1 - nd
            drafts[j, :nd] = ch.draft_ids[:nd]
            ban_rows[j] = ch.ban_rows
        return SpecInputs(slot, row0, n_draft, drafts, first, floor, active.astype(bool),
                          batch.requests.block_table_RM[0][:R], ban_rows)
