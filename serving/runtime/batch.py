"""Host-side step inputs: the scheduler's per-request chunks -> padded NumPy arrays for the device.

A step is a flat batch of tokens (prefill chunks and decode rows, each request's tokens contiguous)
padded to a token bucket T, with per-request arrays padded to `max_num_seqs` requests. Attention works on
tiles of `tile` consecutive tokens of one request, so a tile's window and top-k rows come from one
request's cache; a step has at most T / tile + min(T, max_num_seqs) tiles. Everything here is computed
from what the scheduler already knows (positions, slots, block tables): the device never syncs back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from serving.runtime.decoder_replay import kept_rows


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

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Buckets:
    """Padded shapes: token counts, from which tile counts derive; request arrays have a fixed size."""

    tokens: tuple[int, ...]
    max_num_seqs: int
    tile: int

    def token_bucket(self, n: int) -> int:
        for b in self.tokens:
            if b >= n:
                return b
        raise ValueError(f"{n} tokens exceed the largest token bucket {self.tokens[-1]}")

    def tiles(self, tokens: int) -> int:
        return -(-tokens // self.tile) + min(tokens, self.max_num_seqs)


def token_ladder(max_tokens: int, window: int, smallest: int = 1) -> tuple[int, ...]:
    """Powers of two from `smallest` below the window (decode batches), then the window times 1, 2, 3, 4, 6,
    8, 12, ... (each prefill keeps `window` rows after the cut, so segment 2's row counts are near multiples
    of it; the geometric 1-2-3-4-6-8 series keeps padding under 50% with few compiled shapes), ending at
    max_tokens."""
    out, b = [], smallest
    while b < min(window, max_tokens):
        out.append(b)
        b *= 2
    m = 1
    while window * m < max_tokens:
        out.append(window * m)
        m = m * 3 // 2 if m & (m - 1) == 0 and m >= 2 else m * 4 // 3 if m >= 3 else m + 1
    out.append(max_tokens)
    return tuple(sorted(set(out)))


def _tiles(first: np.ndarray, qlen: np.ndarray, tile: int, n_tiles: int) -> dict[str, np.ndarray]:
    req, t0, n = [], [], []
    for r, (f, q) in enumerate(zip(first, qlen)):
        for o in range(0, int(q), tile):
            req.append(r)
            t0.append(f + o)
            n.append(min(tile, int(q) - o))
    if len(req) > n_tiles:
        raise AssertionError(f"{len(req)} tiles exceed the bucket's {n_tiles}")
    pad = n_tiles - len(req)
    return {"tile_req": np.array(req + [0] * pad, np.int32), "tile_first": np.array(t0 + [0] * pad, np.int32),
            "tile_n": np.array(n + [0] * pad, np.int32)}


def build_step(chunks: Sequence[SeqChunk], buckets: Buckets, *, max_blocks: int, window: int, block_size: int,
               engram_hashes: Callable[[SeqChunk], np.ndarray] | None = None, engram_row_shape: tuple[int, ...] = (),
               token_bucket: int | None = None, kept_bucket: int | None = None) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(segment-1 batch over every token, segment-2 batch over the kept rows); buckets may be forced
    (ahead-of-time compilation builds example batches of each shape). `engram_hashes(chunk)`: the chunk's
    Engram hash ids [q, *engram_row_shape]."""
    R = buckets.max_num_seqs
    if len(chunks) > R:
        raise ValueError(f"{len(chunks)} requests exceed max_num_seqs {R}")
    total = sum(ch.num_tokens for ch in chunks)
    T = token_bucket or buckets.token_bucket(total)
    req = {k: np.zeros(R, np.int32) for k in ("slot", "start", "end", "first", "qlen", "kv_floor", "write_floor",
                                            "dec_floor", "kept_first", "kept_qlen", "logit_row")}
    req["block_table"] = np.zeros((R, max_blocks), np.int32)
    req["valid"] = np.zeros(R, bool)
    req["sample"] = np.zeros(R, bool)
    tok = {"ids": np.zeros(T, np.int32), "pos": np.zeros(T, np.int32), "req": np.zeros(T, np.int32),
           "valid": np.zeros(T, bool)}
    kept_idx: list[int] = []
    hashes = []
    f = 0
    for r, ch in enumerate(chunks):
        if not 0 <= ch.start < ch.end <= len(ch.token_ids):
            raise ValueError(f"request in slot {ch.slot}: chunk [{ch.start}, {ch.end}) outside its "
                             f"{len(ch.token_ids)} tokens")
        if ch.prompt_logprobs and ch.trim:
            raise ValueError(f"request in slot {ch.slot}: prompt logprobs need every row kept (trim=False)")
        if len(ch.block_table) * block_size < ch.end:
            raise ValueError(f"request in slot {ch.slot}: {len(ch.block_table)} blocks do not cover {ch.end} positions")
        q = ch.num_tokens
        sl = slice(f, f + q)
        tok["ids"][sl] = ch.token_ids[ch.start:ch.end]
        tok["pos"][sl] = np.arange(ch.start, ch.end)
        tok["req"][sl] = r
        tok["valid"][sl] = True
        keep, dec_floor = kept_rows(q, ch.end, ch.kv_floor, window, ch.trim)
        kept_idx.extend(range(f + q - keep, f + q))
        req["slot"][r], req["start"][r], req["end"][r] = ch.slot, ch.start, ch.end
        req["first"][r], req["qlen"][r] = f, q
        req["kv_floor"][r], req["write_floor"][r] = ch.kv_floor, ch.write_floor
        req["dec_floor"][r] = dec_floor
        req["kept_first"][r], req["kept_qlen"][r] = len(kept_idx) - keep, keep
        req["logit_row"][r] = len(kept_idx) - 1
        req["block_table"][r, : len(ch.block_table)] = ch.block_table
        req["valid"][r], req["sample"][r] = True, ch.sample
        if engram_hashes is not None:
            hashes.append(engram_hashes(ch))
        f += q
    n_rows = np.array([[ch.end // r for ch in chunks] or [0] for r in (1, 2)])
    rpb = np.array([block_size, block_size // 2])
    step1 = {**tok, **{f"req_{k}": v for k, v in req.items()},
             **_tiles(req["first"][: len(chunks)], req["qlen"][: len(chunks)], buckets.tile, buckets.tiles(T)),
             # dynamic trip counts of the dense indexer loop, per compress ratio (index 0: ratio 1, 1: ratio 2)
             "n_iter": (-(-n_rows.max(axis=1) // rpb)).astype(np.int32)}
    if engram_hashes is not None:
        step1["engram"] = np.zeros((T, *engram_row_shape), np.int32)
        if hashes:
            h = np.concatenate(hashes)
            step1["engram"][: len(h)] = h
    T2 = kept_bucket or buckets.token_bucket(len(kept_idx))
    kept = np.zeros(T2, np.int32)
    kept[: len(kept_idx)] = kept_idx
    rows_next = np.zeros(T2, np.int32)  # row logprobs: the token after each kept row (0 past the known ones)
    for r, ch in enumerate(chunks):
        if ch.prompt_logprobs:
            nxt = ch.token_ids[ch.start + 1:ch.end + 1]
            rows_next[req["kept_first"][r]:req["kept_first"][r] + len(nxt)] = nxt
    step2 = {"kept": kept, "valid": np.arange(T2) < len(kept_idx), "rows_next": rows_next,
             "rows_wanted": np.array(any(ch.prompt_logprobs for ch in chunks)),
             **{f"req_{k}": v for k, v in req.items()},
             **_tiles(req["kept_first"][: len(chunks)], req["kept_qlen"][: len(chunks)], buckets.tile,
                      buckets.tiles(T2)),
             "n_iter": step1["n_iter"]}
    return step1, step2
