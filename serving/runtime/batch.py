"""Host-side step inputs: the scheduler's per-request chunks -> padded NumPy arrays for the device.

A step is a flat batch of tokens (prefill chunks and decode rows, each request's tokens contiguous)
padded to a token bucket T, with per-request arrays padded to `max_num_seqs` requests. Attention works on
tiles of `tile` consecutive tokens of one request, so a tile's window and top-k rows come from one
request's cache; a step has at most T / tile + min(T, max_num_seqs) tiles. Everything here is computed
from what the scheduler already knows (positions, slots, block tables): the device never syncs back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np

from dsv41.layers.engram import EngramLayout, ngram_windows
from pallas_kernels.tiles import max_tiles, plan_tiles
from serving.runtime.decoder_replay import kept_rows
from serving.runtime.step import INDEX_RATIOS, KeptRows, Requests, Rows, StepBatch


@dataclass
class SeqChunk:
    """What the scheduler asks the runtime to compute for one request in one step."""

    slot: int  # the request's row in its rank's per-slot state (SWA rings, compressor tails)
    block_table: Sequence[int]  # its rank's paged blocks covering positions [0, end)
    token_ids: Sequence[int]  # the request's tokens at positions [0, end)
    start: int  # first position computed in this step
    end: int  # one past the last position computed
    kv_floor: int = 0  # encoder replay: SWA rows below this position are never read (replay_start)
    write_floor: int = 0  # global / index rows whose last token is below this are not written (the hit)
    trim: bool = False  # decoder replay: only the last `window` rows run the layers after the cut
    sample: bool = True  # produce logits for position end - 1
    prompt_logprobs: bool = False  # log-probabilities of every row's next token (needs trim off)
    rank: int = 0  # the data-parallel rank holding the request's KV (slot and blocks are that rank's)
    draft_ids: Sequence[int] = ()  # speculative decoding: drafted tokens after token_ids that this chunk verifies
    # speculative decoding: its first this many verified rows may not emit the banned ids (min_tokens not reached)
    ban_rows: int = 0
    # async scheduling: the token after token_ids (this chunk's last position) is the one the previous step samples
    # in this row of its sampled tokens, still on the device; -1: every token of the chunk is in token_ids
    pending_row: int = -1

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    @property
    def num_known(self) -> int:
        """Positions with a token: token_ids, and the pending one."""
        return len(self.token_ids) + (self.pending_row >= 0)

    @property
    def num_draft(self) -> int:
        """Drafts this chunk verifies: its rows past the request's tokens."""
        return max(0, self.end - self.num_known)

    @property
    def trims(self) -> bool:
        """Decoder replay trims this chunk: it asks to, and it verifies no drafts (a verification chunk is decode
        rows: trimming would clip its first row's window in the layers after the cut)."""
        return self.trim and not self.num_draft

    def tokens(self, lo: int, hi: int) -> list[int]:
        """Token ids of positions [lo, hi), the drafts included; a pending token reads 0 (the device substitutes it)."""
        n, k = len(self.token_ids), self.num_known
        return (list(self.token_ids[lo:min(hi, n)]) + [0] * max(0, min(hi, k) - max(lo, n))
                + list(self.draft_ids[max(lo - k, 0):max(hi - k, 0)]))


class EngramHashing(NamedTuple):
    """A V4.1 model's Engram hashing on the host: the layout and the token -> compressed id map."""

    layout: EngramLayout
    token_map: np.ndarray

    def windows(self, ch: SeqChunk) -> np.ndarray:
        """The n-gram windows [q, max_ngram] of the chunk's rows (a pending token reads as 0: the device finishes
        that row's ids). The look-back reaches max_ngram - 1 tokens before the chunk, so only those and the chunk
        are read: a decode step costs O(1), not O(context)."""
        lo = max(0, ch.start - (self.layout.max_ngram - 1))
        return ngram_windows(ch.tokens(lo, ch.end), ch.start - lo, self.layout.max_ngram)


@dataclass(frozen=True)
class Buckets:
    """Padded shapes: token counts, from which tile counts derive, and kept-row counts (segment 2's rows: default
    the token counts); request arrays have a fixed size."""

    tokens: tuple[int, ...]
    max_num_seqs: int
    tile: int
    kept: tuple[int, ...] = ()

    def __post_init__(self):
        if not self.kept:
            object.__setattr__(self, "kept", self.tokens)
        if self.kept[-1] != self.tokens[-1]:
            raise ValueError(f"the kept-row buckets {self.kept} must end at the largest token bucket {self.tokens[-1]}")

    def token_bucket(self, n: int) -> int:
        for b in self.tokens:
            if b >= n:
                return b
        raise ValueError(f"{n} tokens exceed the largest token bucket {self.tokens[-1]}")

    def kept_bucket(self, n: int) -> int:
        for b in self.kept:
            if b >= n:
                return b
        raise ValueError(f"{n} kept rows exceed the largest kept-row bucket {self.kept[-1]}")

    def requests(self, kept_rows: int) -> int:
        """The most requests a step with `kept_rows` kept rows holds: each has a kept row (its last) of its own, so
        they are the first min(max_num_seqs, kept_rows) of its logit rows (the head and the sampler run on those)."""
        return min(self.max_num_seqs, kept_rows)

    def tile_size(self, tokens: int) -> int:
        """Query rows per tile in a `tokens`-row bucket: 1 where a decode batch fits (a decode row is its request's
        only row: a wider tile would be padding), else `tile`."""
        return 1 if tokens <= self.max_num_seqs else self.tile

    def tiles(self, tokens: int) -> int:
        return max_tiles(tokens, self.max_num_seqs, self.tile_size(tokens))


def token_ladder(max_tokens: int, window: int, smallest: int = 1, max_seqs: int | None = None, *,
                 kept: bool = False) -> tuple[int, ...]:
    """The token buckets (`kept`: segment 2's kept-row buckets), chosen by what padding a step up to the next bucket
    costs (measured on nano-austen, bf16, XLA:CPU: docs/design/measurements.md, "Token buckets"): a bucket is kept
    where the steps it serves would run more than ~15% slower padded to the next one, and each costs a compiled
    program (~4.5-7 s each there).

    Decode batches: `smallest`, then powers of two from 8 up to `max_seqs` (a decode step of 2-4 rows costs ~13% more
    padded to 8; of 9-16 rows ~50% more padded to 32), below the window. Above that, tiled attention takes over, so
    a step of more rows than `max_seqs` goes straight to the window (measured: a 64-row bucket ran slower than the
    128-row one). Prefill tokens: the window, 4x the window (a 256-token prefill ran 12% slower padded to 512), then
    doubling, ending at max_tokens. Kept rows: the window, then doubling (a step prefilling one prompt beside its
    decodes keeps the window's rows plus one per decode: padded from 256 to 512 they cost the served c=8 waves 9%)."""
    top = min(window, max_tokens)
    out, b = {smallest}, 8
    while b < top and (max_seqs is None or b <= max_seqs):
        out.add(b)
        b *= 2
    if max_seqs is not None and smallest < max_seqs < top:
        out.add(max_seqs)
    m = window
    while m < max_tokens:
        out.add(m)
        m = m * 4 if m == window and not kept else m * 2
    out.add(max_tokens)
    return tuple(sorted(b for b in out if b <= max_tokens))


def build_step(chunks: Sequence[SeqChunk], buckets: Buckets, *, max_blocks: int, window: int, block_size: int,
               engram: EngramHashing | None = None, token_bucket: int | None = None, kept_bucket: int | None = None,
               verify_rows: int = 1, decoder_replay: bool = True) -> StepBatch:
    """One rank's step as NumPy arrays; buckets may be forced (ahead-of-time compilation builds example
    batches of each shape). `engram`: the model's Engram hashing (None: no Engram).
    `verify_rows` J > 1 (speculative decoding): logits rows [R, J], a chunk's last 1 + num_draft kept rows.
    `decoder_replay` False (a model without a CED cut): no chunk is trimmed, whatever it asks."""
    R = buckets.max_num_seqs
    if len(chunks) > R:
        raise ValueError(f"{len(chunks)} requests exceed max_num_seqs {R}")
    T = token_bucket or buckets.token_bucket(sum(ch.num_tokens for ch in chunks))
    i32 = lambda n: np.zeros(n, np.int32)  # noqa: E731
    slot, start, end, kv_floor, write_floor, dec_floor = (i32(R) for _ in range(6))
    first, qlen, kept_first, kept_qlen = (i32(R) for _ in range(4))
    logit_row = np.zeros((R, verify_rows) if verify_rows > 1 else R, np.int32)
    block_table = np.zeros((R, max_blocks), np.int32)
    ids, pos, req, valid, prev = i32(T), i32(T), i32(T), np.zeros(T, bool), np.full(T, -1, np.int32)
    kept_idx: list[int] = []
    next_ids: list[int] = []
    windows, pending = [], []  # Engram: every row's n-gram window; (request, row) of each pending token
    f = 0
    for r, ch in enumerate(chunks):
        if not 0 <= ch.start < ch.end <= ch.num_known + len(ch.draft_ids):
            raise ValueError(f"request in slot {ch.slot}: chunk [{ch.start}, {ch.end}) outside its "
                             f"{len(ch.token_ids)} tokens and {len(ch.draft_ids)} drafts")
        if ch.num_draft and (ch.num_draft >= verify_rows or ch.num_draft >= ch.num_tokens):
            raise ValueError(f"request in slot {ch.slot}: {ch.num_draft} drafts to verify; this step verifies at most "
                             f"{verify_rows - 1}, after the request's last token")
        if ch.prompt_logprobs and ch.trim:
            raise ValueError(f"request in slot {ch.slot}: prompt logprobs need every row kept (trim=False)")
        if len(ch.block_table) * block_size < ch.end:
            raise ValueError(f"request in slot {ch.slot}: {len(ch.block_table)} blocks do not cover {ch.end} positions")
        q = ch.num_tokens
        sl = slice(f, f + q)
        ids[sl] = ch.tokens(ch.start, ch.end)
        if ch.pending_row >= 0:
            if ch.end != ch.num_known or ch.num_draft:
                raise ValueError(f"request in slot {ch.slot}: a pending token must be the chunk's last position")
            prev[f + q - 1] = ch.pending_row
            pending.append((r, f + q - 1))
        pos[sl] = np.arange(ch.start, ch.end)
        req[sl], valid[sl] = r, True
        keep, dec_floor[r] = kept_rows(q, ch.end, ch.kv_floor, window, ch.trims and decoder_replay)
        kept_first[r], kept_qlen[r] = len(kept_idx), keep
        kept_idx.extend(range(f + q - keep, f + q))
        if verify_rows > 1:
            logit_row[r] = len(kept_idx) - 1 - ch.num_draft + np.minimum(np.arange(verify_rows), ch.num_draft)
        else:
            logit_row[r] = len(kept_idx) - 1
        # prompt logprobs: the known token after each row (-1 past the known ones and for chunks not asking)
        nxt = ch.token_ids[ch.end - keep + 1:ch.end + 1] if ch.prompt_logprobs else []
        next_ids.extend(list(nxt) + [-1] * (keep - len(nxt)))
        slot[r], start[r], end[r] = ch.slot, ch.start, ch.end
        first[r], qlen[r] = f, q
        kv_floor[r], write_floor[r] = ch.kv_floor, ch.write_floor
        block_table[r, : len(ch.block_table)] = ch.block_table
        if engram is not None:
            windows.append(engram.windows(ch))
        f += q
    hash_ids = look_back = None
    if engram is not None:
        eg = engram.layout
        L, S = len(eg.layer_ids), eg.max_ngram - 1
        hash_ids, look_back = np.zeros((T, L, S * eg.n_heads), np.int32), np.zeros((R, L, S, 2), np.int32)
        if windows:
            w = np.concatenate(windows)
            hash_ids[: len(w)] = eg.hash_windows(w, engram.token_map)
        if pending:
            req_p, row_p = np.array(pending).T
            look_back[req_p] = eg.look_back(w[row_p, 1:], engram.token_map)
    n = len(chunks)
    query_tiles = plan_tiles(first[:n], qlen[:n], buckets.tile_size(T), buckets.tiles(T))
    rows = Rows(ids, pos, req, valid, first, qlen, query_tiles, hash_ids, prev, look_back)
    K = kept_bucket or buckets.kept_bucket(len(kept_idx))
    pad = K - len(kept_idx)
    kept_tiles = plan_tiles(kept_first[:n], kept_qlen[:n], buckets.tile_size(K), buckets.tiles(K))
    kept = KeptRows(np.array(kept_idx + [0] * pad, np.int32), np.arange(K) < len(kept_idx), kept_first, kept_qlen,
                    logit_row, kept_tiles, np.array(next_ids + [-1] * pad, np.int32))
    # trip counts of the dense indexer loop: the blocks of the step's longest context, per compress ratio
    longest = max((ch.end for ch in chunks), default=0)
    index_blocks = np.array([-(-(longest // r) // max(block_size // r, 1)) for r in INDEX_RATIOS], np.int32)
    return StepBatch(Requests(slot, start, end, kv_floor, write_floor, dec_floor, block_table), index_blocks,
                     rows, kept)
