"""The scheduler on its own (no model): budgets, chunking, admission with prefix hits and the replay rewind,
preemption, queue limits and priorities - invariants checked on every step of randomized runs."""

import random

import pytest

import dsv41
from serving.engine.request import Request, Status
from serving.engine.args import EngineArgs
from serving.engine.scheduler import QueueFull, Scheduler
from serving.runtime.block_manager import BlockManager
from serving.runtime.sampling_params import SamplingParams

CFG = dsv41.ModelConfig.preset("tiny")  # window 8: a hit of H > 8 tokens restarts at H - 8
BS = 8


def _sched(num_blocks=64, token_buckets=(), **kw):
    a = EngineArgs.of(**{"max_num_seqs": 4, "max_num_batched_tokens": 32, **kw})
    return Scheduler(a.scheduler, a.runtime, CFG, BlockManager(num_blocks, BS, a.scheduler.enable_prefix_caching),
                     token_buckets)


def _req(rid, n, seed=0, **kw):
    rng = random.Random(seed)
    return Request(rid, [rng.randrange(3, 500) for _ in range(n)], SamplingParams(temperature=0), **kw)


def _finish_step(s, sched, token=7):
    """What the engine does after a step: the scheduler registers the rows and appends a token where the chunk
    samples."""
    for x in sched:
        s.postprocess(x, token if x.sample else None)


def test_budget_chunking_and_decode_rows():
    s = _sched()
    a, b = _req("a", 50), _req("b", 5, seed=1)
    s.add(a), s.add(b)
    first = s.schedule()
    assert [(x.request.request_id, x.start, x.end) for x in first] == [("a", 0, 32)]
    _finish_step(s, first)
    second = s.schedule()  # a's last 18 tokens, then b in the 14 left
    assert [(x.request.request_id, x.start, x.end, x.sample) for x in second] == [("a", 32, 50, True),
                                                                                  ("b", 0, 5, True)]
    _finish_step(s, second)
    assert all(x.sample for x in second)  # fixed when scheduled: the token appended afterwards does not change it
    third = s.schedule()
    assert [(x.start, x.end) for x in third] == [(50, 51), (5, 6)]  # one decode row each


def test_long_prefill_cap_applies_with_company():
    s = _sched(long_prefill_token_threshold=8)
    s.add(_req("a", 30)), s.add(_req("b", 30, seed=2))
    assert [x.end - x.start for x in s.schedule()] == [8, 8]


def test_lone_request_is_not_capped():
    s = _sched(long_prefill_token_threshold=8)
    s.add(_req("a", 30))
    assert [x.end - x.start for x in s.schedule()] == [30]


def test_prefix_hit_rewinds_by_the_window_and_counts_cached_tokens():
    s = _sched()
    a = _req("a", 40)
    s.add(a)
    _finish_step(s, s.schedule())  # prefill 40 -> blocks 0..4 full and registered
    s.remove(a)
    b = Request("b", a.prompt_ids[:33] + [9, 9, 9], SamplingParams(temperature=0))
    s.add(b)
    x = s.schedule()[0]
    assert (b.cached_tokens, b.plan.replay_start, b.plan.write_floor) == (32, 24, 32)
    assert (x.start, x.end) == (24, 36)


def test_prompt_logprob_requests_skip_the_prefix_cache():
    s = _sched()
    a = _req("a", 40)
    s.add(a)
    _finish_step(s, s.schedule())
    s.remove(a)
    b = Request("b", list(a.prompt_ids), SamplingParams(temperature=0, prompt_logprobs=1))
    s.add(b)
    assert s.schedule()[0].start == 0 and b.cached_tokens == 0


def test_preemption_frees_blocks_and_resumes_first():
    s = _sched(num_blocks=8)  # 64 tokens in all
    a, b = _req("a", 30), _req("b", 25, seed=1)
    s.add(a), s.add(b)
    _finish_step(s, s.schedule())  # a: 4 blocks
    _finish_step(s, s.schedule())  # b admitted: 4 blocks; pool empty
    assert s.blocks.num_free_blocks == 0
    for _ in range(2):
        _finish_step(s, s.schedule())  # a grows past 32 -> needs a 5th block: b (the last) is preempted
    assert b.status is Status.WAITING and b.num_preemptions == 1 and s.num_preemptions == 1
    assert b.num_computed == 0 and b.slot is None and b.cached_tokens == 0
    assert s.next_waiting is b  # resumes before anything newer


def test_queue_limit_and_priority_order():
    s = _sched(max_queued_requests=2, scheduling_policy="priority")
    s.add(_req("late", 5, priority=5)), s.add(_req("urgent", 5, priority=-1))
    with pytest.raises(QueueFull):
        s.add(_req("x", 5))
    assert [x.request.request_id for x in s.schedule()] == ["urgent", "late"]


BUCKETS = (1, 2, 4, 8, 16, 24, 32)


def _chunks(sched):
    return [(x.request.request_id, x.start, x.end, x.sample) for x in sched]


def test_bucket_fit_cuts_the_newest_prefill_back_to_the_bucket_below():
    s = _sched(token_buckets=BUCKETS, bucket_fit_min_tokens=16)
    a, b, c = _req("a", 4), _req("b", 12, seed=1), _req("c", 8, seed=2)
    s.add(a)
    _finish_step(s, s.schedule())
    s.add(b), s.add(c)
    step = s.schedule()  # 1 + 12 + 8 = 21 tokens would pad to 24: cut to 16, c keeps 3 tokens and does not sample
    assert _chunks(step) == [("a", 4, 5, True), ("b", 0, 12, True), ("c", 0, 3, False)]
    _finish_step(s, step)
    assert _chunks(s.schedule()) == [("a", 5, 6, True), ("b", 12, 13, True), ("c", 3, 8, True)]  # 7 < 16: as is


def test_bucket_fit_sends_a_request_cut_to_nothing_back_to_the_queue_front():
    s = _sched(token_buckets=BUCKETS, bucket_fit_min_tokens=16, max_num_batched_tokens=20)
    a, b, c = _req("a", 4), _req("b", 15, seed=1), _req("c", 4, seed=2)
    s.add(a)
    _finish_step(s, s.schedule())
    free = s.blocks.num_free_blocks
    s.add(b), s.add(c)
    step = s.schedule()  # 1 + 15 + 4 = 20 would pad to 24: cut to 16, c is cut to nothing and waits, unadmitted
    assert _chunks(step) == [("a", 4, 5, True), ("b", 0, 15, True)]
    assert c.status is Status.WAITING and c.slot is None and c.num_computed == 0 and s.next_waiting is c
    assert s.num_preemptions == 0 and c.num_preemptions == 0
    assert s.blocks.num_free_blocks == free - 2  # b's two blocks only; c's reservation is back
    _finish_step(s, step)
    assert _chunks(s.schedule()) == [("a", 5, 6, True), ("b", 15, 16, True), ("c", 0, 4, True)]


def test_bucket_fit_leaves_small_steps_decode_rows_and_drafts():
    for kw in ({"bucket_fit_min_tokens": 0}, {"bucket_fit_min_tokens": 32}):  # off, or the bucket below too small
        s = _sched(token_buckets=BUCKETS, **kw)
        s.add(_req("a", 21))
        assert [x.end for x in s.schedule()] == [21]
    s = _sched(token_buckets=(1, 2, 4, 8, 16, 32), bucket_fit_min_tokens=2, max_num_batched_tokens=32)
    reqs = [_req(r, 2, seed=i) for i, r in enumerate("abc")]
    for r in reqs:
        s.add(r)
    _finish_step(s, s.schedule())  # 6 tokens: cut to 4, c waits
    _finish_step(s, s.schedule())  # a, b decode + c's 2 = 4: a bucket
    step = s.schedule()  # three decode rows over the 2-bucket: nothing to cut, padded to 4
    assert _chunks(step) == [("a", 3, 4, True), ("b", 3, 4, True), ("c", 2, 3, True)]
    reqs[0].draft_ids = [5, 6, 7]
    s.postprocess(step[0], 9), s.postprocess(step[1], 9), s.postprocess(step[2], 9)
    assert [x.num_draft for x in s.schedule()] == [3, 0, 0]  # 4 + 1 + 1 = 6 over the 4-bucket: drafts stay


def test_randomized_runs_keep_the_invariants():
    """Random arrivals, lengths and aborts on a small pool: budget and slots never exceed the limits, every
    scheduled chunk is covered by blocks, refcounts match the live tables, and all blocks come back. With the
    bucket fit: a step over a bucket >= 8 is one whose spill is not all prefill."""
    rng = random.Random(0)
    s = _sched(num_blocks=20, long_prefill_token_threshold=12, token_buckets=BUCKETS, bucket_fit_min_tokens=8)
    cuts, fit = [], s._fit_to_bucket

    def counting_fit(out, admitted):
        before = sum(x.end - x.start for x in out)
        out = fit(out, admitted)
        cuts.append(before - sum(x.end - x.start for x in out))
        return out

    s._fit_to_bucket = counting_fit
    live, n = [], 0
    for step in range(400):
        if rng.random() < 0.3 and n < 60:
            r = _req(f"r{n}", rng.randrange(1, 70), seed=n)
            r.params = SamplingParams(temperature=0, max_tokens=rng.randrange(1, 20))
            s.add(r)
            live.append(r)
            n += 1
        sched = s.schedule()
        total = sum(x.end - x.start for x in sched)
        assert total <= 32 and len(s.running) <= 4
        low = max(b for b in BUCKETS if b <= total) if total else 0
        if low >= 8 and total > low:
            assert sum(x.end - x.start for x in sched if x.cuttable) < total - low  # nothing the fit could cut
        assert len({x.request.slot for x in sched}) == len(sched)
        for x in sched:
            assert len(s.blocks.block_table(x.request.request_id)) * BS >= x.end
        _finish_step(s, sched)
        for r in list(live):
            if r.status is Status.RUNNING and (r.num_output >= r.params.max_tokens or rng.random() < 0.02):
                s.remove(r)
                live.remove(r)
        refs = {}
        for r in s.running:
            for blk in s.blocks.block_table(r.request_id):
                refs[blk] = refs.get(blk, 0) + 1
        assert refs == {b: c for b, c in enumerate(s.blocks.snapshot().ref_counts) if c}
    for r in list(live):
        s.remove(r)
    assert s.blocks.num_free_blocks == 20 and sorted(s.free_slots) == [0, 1, 2, 3] and n > 40
    assert sum(c > 0 for c in cuts) > 10  # the fit did cut, and the invariants held through it


def test_drafts_fit_the_token_budget_the_output_limit_and_the_step_k():
    s = _sched(max_num_batched_tokens=8)
    a, b = _req("a", 4), _req("b", 4, seed=1)
    b.params = SamplingParams(temperature=0, max_tokens=3, stop_token_ids=(21,))
    s.add(a), s.add(b)
    _finish_step(s, s.schedule())  # both prefilled (8 tokens), one token each
    a.draft_ids, b.draft_ids = [11, 12, 13, 14, 15], [21, 22, 23, 24, 25]
    step = s.schedule()
    # a: 1 + 5 drafts of the 8-token budget; b: 1 row and the 1 draft left in the budget (its max_tokens allows 2)
    assert [(x.start, x.end, x.num_draft, x.sample) for x in step] == [(4, 10, 5, True), (4, 6, 1, True)]
    # a accepts 2 drafts (3 tokens emitted): it has computed positions up to its last accepted draft
    assert s.postprocess(step[0], [11, 12, 99]) is None and a.num_computed == 7 and a.token_ids[-3:] == [11, 12, 99]
    # b emits 2 tokens of which the first is a stop id: the second is dropped
    assert s.postprocess(step[1], [21, 98]) == ("stop", 21) and b.output_ids == [7, 21]
    c = _req("c", 4, seed=2)
    c.params = SamplingParams(temperature=0, min_tokens=4)
    s = _sched()
    s.add(c)
    _finish_step(s, s.schedule())
    c.draft_ids = [1, 2]
    # min_tokens does not stop drafts (their rows are verified under the ban: test_spec_engine.py); a step's k does
    assert s.schedule()[0].num_draft == 2
    s.remove(c)
    d = _req("d", 4, seed=3)
    s.add(d)
    _finish_step(s, s.schedule())
    d.draft_ids = [1, 2, 3]
    assert s.schedule(max_drafts=1)[0].num_draft == 1
