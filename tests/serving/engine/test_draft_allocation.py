"""Each request's share of a verifying step's drafts (serving.engine.draft_allocation): acceptance per request and
position shrunk toward the engine's, a verifying step's time measured per compiled shape (token bucket), and the rows
chosen to maximise the batch's expected tokens per second - checked against every allocation of small batches."""

import itertools

import numpy as np
import pytest

from serving.engine.draft_allocation import Acceptance, DraftAllocator, RequestDrafts


BUCKETS = (4, 8, 16, 32)


def _bucket(rows: int) -> int:
    return next(b for b in BUCKETS if b >= rows)


def _rate(gains, counts, running, times):
    """Expected tokens per (relative) second of a step verifying counts[r] drafts of request r."""
    tokens = running + sum(sum(g[:n]) for g, n in zip(gains, counts))
    return tokens / times[_bucket(running + sum(counts))]


def _with_times(alloc, running, times, steps=3):
    for bucket, t in times.items():
        for _ in range(steps):
            alloc.record(running, bucket - running, t)
    return alloc


def test_acceptance_counts_only_the_positions_a_verification_reached():
    a = Acceptance.empty(4, decay=1.0)
    a.observe(num_draft=4, num_accepted=1)  # position 0 accepted, 1 rejected, 2 and 3 never judged
    a.observe(num_draft=2, num_accepted=2)  # both accepted; a 2-draft verification says nothing of 2 and 3
    assert a.reached == [2, 2, 0, 0] and a.accepted == [2, 1, 0, 0]


def test_a_request_starts_at_the_engine_rate_and_moves_to_its_own():
    alloc = DraftAllocator(3)
    others = [alloc.new_request() for _ in range(20)]
    for a in others:
        alloc.observe(a, 3, 1)  # the engine: position 0 accepted, position 1 rejected
    new, quoting, rejecting = alloc.new_request(), alloc.new_request(), alloc.new_request()
    for _ in range(6):
        alloc.observe(quoting, 3, 3)
        alloc.observe(rejecting, 3, 0)
    g_new, g_quote, g_reject = alloc.gains(new), alloc.gains(quoting), alloc.gains(rejecting)
    engine = [(alloc.engine.accepted[i] + 1) / (alloc.engine.reached[i] + 2) for i in range(3)]
    assert g_new == pytest.approx(np.cumprod(engine))
    assert g_quote[0] > g_new[0] > g_reject[0] and g_quote[2] > g_new[1] and g_reject[0] < 0.3 < 0.6 < g_quote[2]
    for g in (g_new, g_quote, g_reject):  # a later draft is emitted only with every one before it
        assert g == sorted(g, reverse=True)


def test_every_request_verifies_k_until_its_shape_is_measured():
    alloc = DraftAllocator(5, step_shape=_bucket)
    reqs = [RequestDrafts(alloc.new_request(), n) for n in (5, 2, 0)]
    assert alloc.allocate(reqs, 3, 3) == [3, 2, 0]
    alloc.record(3, 1, 1.4)  # 4 rows: another bucket than the 8 of k for all
    for _ in range(2):
        alloc.record(3, 5, 2.0)  # 8 rows, measured twice
    assert alloc.cost(3, 5) is None and alloc.allocate(reqs, 3, 3) == [3, 2, 0]
    alloc.record(3, 4, 2.0)  # 7 rows: the same bucket, the third step there
    assert alloc.cost(3, 5) == 2.0 and alloc.cost(3, 2) == 2.0 and alloc.cost(1, 5) is None  # per concurrency bucket
    assert alloc.cost(3, 1) is None  # the 4-row bucket: one step


def test_a_stalled_step_does_not_move_a_shapes_time():
    alloc = _with_times(DraftAllocator(5, step_shape=_bucket), 4, {8: 1.6, 16: 2.0}, steps=4)
    alloc.record(4, 10, 9.0)  # a 5x stall
    assert alloc.cost(4, 10) == pytest.approx(2.0) and alloc.cost(4, 2) == pytest.approx(1.6)


def test_rows_that_share_a_bucket_are_all_verified():
    alloc = _with_times(DraftAllocator(5, step_shape=lambda rows: _bucket(max(rows, 8))), 1, {8: 1.5})
    weak = alloc.new_request()
    for _ in range(10):
        alloc.observe(weak, 5, 0)  # a request whose drafts are rarely accepted: its later rows earn ~nothing
    assert alloc.allocate([RequestDrafts(weak, 5)], 5, 1) == [5]
    alloc = _with_times(DraftAllocator(5, step_shape=_bucket), 1, {4: 1.5, 8: 1.55})  # the 8-row bucket: dearer
    assert alloc.allocate([RequestDrafts(weak, 5)], 5, 1) == [3]  # its 4th and 5th rows earn less than the 3% they cost


@pytest.mark.parametrize("seed", range(40))
def test_the_rows_chosen_give_the_best_expected_rate_of_every_allocation(seed):
    rng = np.random.default_rng(seed)
    k, running = int(rng.integers(1, 5)), int(rng.integers(1, 5))
    alloc = DraftAllocator(k, step_shape=_bucket)
    reqs = []
    for _ in range(running):
        a = alloc.new_request()
        for _ in range(int(rng.integers(0, 8))):
            alloc.observe(a, k, int(rng.integers(0, k + 1)))
        reqs.append(RequestDrafts(a, int(rng.integers(0, k + 1))))
    steps = np.cumsum(rng.uniform(0.0, 1.0, len(BUCKETS)))  # a larger bucket never runs faster
    times = {b: float(rng.uniform(1.0, 2.0) + t) for b, t in zip(BUCKETS, steps)}
    _with_times(alloc, running, {b: t for b, t in times.items() if b > running})
    gains = [alloc.gains(r.acceptance) for r in reqs]
    caps = [min(k, r.available) for r in reqs]
    got = alloc.allocate(reqs, k, running)
    assert all(0 <= n <= cap for n, cap in zip(got, caps))
    options = [c for c in itertools.product(*(range(cap + 1) for cap in caps)) if sum(c) or not any(caps)]
    best = max(_rate(gains, c, running, times) for c in options)
    assert _rate(gains, got, running, times) == pytest.approx(best)


def test_the_likelier_request_gets_the_rows_and_a_step_keeps_one():
    alloc = DraftAllocator(4, step_shape=_bucket)
    sure, unsure = alloc.new_request(), alloc.new_request()
    for _ in range(10):
        alloc.observe(sure, 4, 4)
        alloc.observe(unsure, 4, 0)
    _with_times(alloc, 2, {4: 1.2, 8: 1.6, 16: 4.0})
    assert alloc.allocate([RequestDrafts(sure, 4), RequestDrafts(unsure, 4)], 4, 2) == [4, 2]  # the 8-row bucket holds 6 drafts
    by_rows = DraftAllocator(4, step_shape=lambda rows: rows)  # every row count its own shape
    for n in range(1, 9):
        for _ in range(3):
            by_rows.record(2, n, 1.0 + 5.0 * n)  # rows far too dear: still one, the likeliest
    assert by_rows.allocate([RequestDrafts(unsure, 4), RequestDrafts(sure, 4)], 4, 2) == [0, 1]


def test_a_greedy_requests_gains_are_its_drafters_confidence_in_each_draft():
    alloc = DraftAllocator(4, step_shape=_bucket)
    history = alloc.new_request()
    for _ in range(10):
        alloc.observe(history, 4, 4)  # its counts say every draft passes
    assert alloc.gains(history, [0.9, 0.5, 0.2]) == pytest.approx([0.9, 0.45, 0.09, 0.09 * alloc.gains(history)[3]
                                                                   / alloc.gains(history)[2]])
    _with_times(alloc, 2, {4: 1.0, 8: 1.9, 16: 3.0})  # the 8-row bucket costs 1.9x the 4-row one
    doubtful = RequestDrafts(history, 4, [0.3, 0.3, 0.3, 0.3])
    sure = RequestDrafts(alloc.new_request(), 4, [0.99, 0.99, 0.99, 0.99])
    assert alloc.allocate([doubtful, sure], 4, 2) == [0, 2]
    # by the counts alone the request whose drafts always passed gets all its rows first
    assert alloc.allocate([doubtful._replace(confidence=None), sure._replace(confidence=None)], 4, 2) == [4, 2]
