"""A minimal synchronous scheduler for runtime tests: requests advance by the chunks a test asks for,
with real block allocation, prefix lookups and the encoder-replay plan (the engine's scheduler does this
for real)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from serving.runtime.batch import SeqChunk
from serving.runtime.block_manager import BlockManager
from serving.runtime.encoder_replay import PrefixPlan, plan_prefix_hit
from serving.runtime.runner import Runner


@dataclass
class Req:
    tokens: list[int]
    slot: int
    plan: PrefixPlan
    computed: int
    schedule: list[tuple[int, int]] = field(default_factory=list)  # (start, end) of every step
    keep_all: bool = False  # e.g. prompt logprobs: no decoder-replay trimming
    rank: int = 0  # data-parallel rank holding its KV


class Driver:
    def __init__(self, runner: Runner, *, prefix_caching: bool = True):
        self.runner = runner
        self.bounded = runner.rc.swa_bounded_replay
        # one block pool and slot list per data-parallel rank
        self.bms = [BlockManager(runner.layout.num_blocks, runner.layout.block_size, prefix_caching)
                    for _ in range(runner.ranks)]
        self.bm = self.bms[0]  # rank 0's pool: what single-rank tests inspect
        self.reqs: dict[str, Req] = {}
        self.free_slots = [list(range(runner.rc.max_num_seqs)) for _ in range(runner.ranks)]

    def start(self, rid: str, prompt: list[int], keep_all: bool = False, rank: int = 0) -> PrefixPlan:
        bm = self.bms[rank]
        hit = bm.lookup(prompt[:-1])
        plan = plan_prefix_hit(hit.num_tokens, self.runner.config, self.bounded)
        if plan.hit_tokens < hit.num_tokens:
            hit = type(hit)(plan.hit_tokens, hit.block_ids[: plan.hit_tokens // bm.block_size])
        bm.admit(rid, prompt, hit)
        self.reqs[rid] = Req(list(prompt), self.free_slots[rank].pop(0), plan, plan.replay_start, keep_all=keep_all,
                             rank=rank)
        return plan

    def step(self, work: dict[str, int]) -> dict[str, np.ndarray]:
        """Advance each request by up to n tokens; logits of each request's last computed row."""
        chunks = []
        for rid, n in work.items():
            r = self.reqs[rid]
            bm = self.bms[r.rank]
            start, end = r.computed, min(r.computed + n, len(r.tokens))
            assert bm.allocate(rid, end), "out of blocks"
            chunks.append(SeqChunk(slot=r.slot, block_table=bm.block_table(rid), token_ids=r.tokens[:end],
                                   start=start, end=end, kv_floor=r.plan.replay_start, write_floor=r.plan.write_floor,
                                   trim=self.bounded and not r.keep_all, rank=r.rank))
            r.schedule.append((start, end))
        logits = np.asarray(self.runner.forward(chunks))
        out = {}
        for i, rid in enumerate(work):
            r = self.reqs[rid]
            r.computed = chunks[i].end
            self.bms[r.rank].commit(rid, r.tokens, r.computed)
            out[rid] = logits[i]
        return out

    def append(self, rid: str, token: int) -> None:
        self.reqs[rid].tokens.append(int(token))

    def finish(self, rid: str) -> None:
        r = self.reqs.pop(rid)
        self.bms[r.rank].free(rid)
        self.free_slots[r.rank].append(r.slot)


def compiled_runner(model, **runtime) -> Runner:
    """A Runner of `model` with every bucket precompiled (the runtime tests' module fixtures)."""
    from serving.runtime.config import RuntimeConfig

    r = Runner(model, RuntimeConfig(**runtime), progress=False)
    r.compiler.precompile()
    return r


def assert_pending_rows_read_on_the_device(runner: Runner, requests: list[tuple[int, list[int], list[int]]]) -> None:
    """Async scheduling at the runner: each (slot, block table, prompt) is prefilled, then its next row is launched
    with its token pending (read from the prefill step's sampled tokens on the device, `SeqChunk.pending_row`)
    before the prefill is collected; its logits must equal, bit for bit, those of the same row with the token known
    on the host. The runner's cache is reset before and after (run it before any request fills the cache)."""
    prefill = [SeqChunk(slot=s, block_table=b, token_ids=p, start=0, end=len(p)) for s, b, p in requests]
    ahead = [SeqChunk(slot=s, block_table=b, token_ids=p, start=len(p), end=len(p) + 1, pending_row=i)
             for i, (s, b, p) in enumerate(requests)]
    unset = [None] * len(requests)
    runner.cache = runner.fresh_cache()
    first = runner.launch(prefill, unset)
    second = runner.launch(ahead, unset, prev=first)
    tokens = runner.collect(first).tokens[:len(requests)].tolist()
    runner.collect(second)
    got = np.asarray(second.segments.logits)[second.segments.rows]
    runner.cache = runner.fresh_cache()
    runner.collect(runner.launch(prefill, unset))
    known = [SeqChunk(slot=s, block_table=b, token_ids=p + [t], start=len(p), end=len(p) + 1)
             for (s, b, p), t in zip(requests, tokens)]
    np.testing.assert_array_equal(got, np.asarray(runner.forward(known)))
    runner.cache = runner.fresh_cache()
