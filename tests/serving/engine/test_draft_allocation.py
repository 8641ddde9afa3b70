"""Each request's share of a verifying step's drafts (serving.engine.draft_allocation): acceptance per request and
position shrunk toward the engine's, a verifying step's cost per draft row fitted from measured steps, and the rows
chosen to maximise the batch's expected tokens per second - checked against every allocation of small batches."""

import itertools

import numpy as np
import pytest

from serving.engine.draft_allocation import Acceptance, DraftAllocator


def _rate(gains, counts, running, A, m):
    """Expected tokens per (relative) second of a step verifying counts[r] drafts of request r."""
    tokens = running + sum(sum(g[:n]) for g, n in zip(gains, counts))
    return tokens / (A + m * sum(counts))


def _with_cost(alloc, running, A, m, rows=(2, 4, 6, 8)):
    for n in rows:
        alloc.record(running, n, A + m * n)
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


def test_every_request_verifies_k_until_two_row_counts_are_measured():
    alloc = DraftAllocator(5)
    reqs = [(alloc.new_request(), 5), (alloc.new_request(), 2), (alloc.new_request(), 0)]
    assert alloc.allocate(reqs, 3, 3) == [3, 2, 0]
    alloc.record(3, 9, 2.0)
    alloc.record(3, 9, 2.1)
    assert alloc.cost(3) is None and alloc.allocate(reqs, 3, 3) == [3, 2, 0]
    alloc.record(3, 3, 1.5)
    assert alloc.cost(3) is not None and alloc.cost(1) is None  # costs are per concurrency bucket


def test_the_cost_fit_ignores_a_stalled_step():
    alloc = _with_cost(DraftAllocator(5), 4, 1.6, 0.05, rows=(4, 8, 12, 16, 20, 8, 12))
    alloc.record(4, 12, 9.0)  # a 5x stall
    A, m = alloc.cost(4)
    assert A == pytest.approx(1.6) and m == pytest.approx(0.05)


@pytest.mark.parametrize("seed", range(40))
def test_the_rows_chosen_give_the_best_expected_rate_of_every_allocation(seed):
    rng = np.random.default_rng(seed)
    k, running = int(rng.integers(1, 4)), int(rng.integers(1, 4))
    alloc = DraftAllocator(k)
    reqs = []
    for _ in range(running):
        a = alloc.new_request()
        for _ in range(int(rng.integers(0, 8))):
            alloc.observe(a, k, int(rng.integers(0, k + 1)))
        reqs.append((a, int(rng.integers(0, k + 1))))
    A, m = float(rng.uniform(1.0, 3.0)), float(rng.uniform(0.01, 0.6))
    _with_cost(alloc, running, A, m)
    gains = [alloc.gains(a) for a, _ in reqs]
    caps = [min(k, n) for _, n in reqs]
    got = alloc.allocate(reqs, k, running)
    assert all(0 <= n <= cap for n, cap in zip(got, caps))
    options = [c for c in itertools.product(*(range(cap + 1) for cap in caps)) if sum(c) or not any(caps)]
    best = max(_rate(gains, c, running, A, m) for c in options)
    assert _rate(gains, got, running, A, m) == pytest.approx(best)


def test_the_likelier_request_gets_the_rows_and_a_step_keeps_one():
    alloc = DraftAllocator(4)
    sure, unsure = alloc.new_request(), alloc.new_request()
    for _ in range(10):
        alloc.observe(sure, 4, 4)
        alloc.observe(unsure, 4, 0)
    _with_cost(alloc, 2, 1.2, 0.15)
    assert alloc.allocate([(sure, 4), (unsure, 4)], 4, 2) == [4, 0]
    _with_cost(alloc, 2, 1.2, 5.0, rows=(2, 4, 6, 8) * 8)  # rows far too dear: still one, the likeliest
    assert alloc.allocate([(unsure, 4), (sure, 4)], 4, 2) == [0, 1]


def test_free_rows_are_all_verified():
    alloc = _with_cost(DraftAllocator(3), 2, 2.0, 0.0)
    a, b = alloc.new_request(), alloc.new_request()
    alloc.observe(a, 3, 0)
    assert alloc.allocate([(a, 3), (b, 1)], 3, 2) == [3, 1]
