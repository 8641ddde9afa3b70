"""The speculation policy (serving.engine.spec_policy): it tries every k for a block of steps, then plays the one
measured fastest at the batch's concurrency, re-tries its neighbours now and then, and follows a change in the
rates."""

from serving.engine.spec_policy import SpeculationPolicy


def _run(policy, running, rate_of_k, steps):
    """`steps` decisions, each step recorded at `rate_of_k[k]` tokens/s per request; the chosen ks."""
    chosen = []
    for _ in range(steps):
        k = policy.choose(running)
        policy.record(k, running, int(rate_of_k[k] * running), 1.0)
        chosen.append(k)
    return chosen


def test_fixed_k_when_not_adaptive():
    p = SpeculationPolicy(5, adaptive=False)
    assert [p.choose(n) for n in (1, 8, 32)] == [5, 5, 5]


def test_every_arm_gets_a_block_plain_first_then_the_fastest_plays():
    p = SpeculationPolicy(3, block_steps=2, explore_every=1000)
    chosen = _run(p, 1, {0: 100, 1: 150, 2: 180, 3: 120}, 20)
    assert chosen[:8] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert set(chosen[8:]) == {2}
    assert p.rates()[1] == [100, 150, 180, 120]


def test_a_block_is_measured_whole_switch_included():
    """Speculation's first step after plain ones verifies nothing (slow); its block counts it, so an arm that only
    pays past its switch must pay for the switch too: here it does not (3 + 16 + 16 tokens in 3 s vs 12 / s)."""
    p = SpeculationPolicy(1, block_steps=3, explore_every=1000)
    for k, tokens in [(0, 12), (0, 12), (0, 12), (1, 3), (1, 16), (1, 16)]:
        assert p.choose(4) == k
        p.record(k, 4, tokens * 4, 1.0)
    assert p.choose(4) == 0 and p.rates()[4] == [12, 35 / 3]


def test_a_step_of_another_arm_is_not_counted_in_a_block():
    """The last step of a block is collected after the next block began (async): it is not counted there."""
    p = SpeculationPolicy(1, block_steps=2)
    assert p.choose(2) == 0 and p.choose(2) == 0
    p.record(0, 2, 20, 1.0)
    assert p.choose(2) == 1
    p.record(0, 2, 20, 1.0)  # block 0's second step, late: not block 1's
    p.record(1, 2, 30, 1.0)
    assert p.choose(2) == 1
    assert p.choose(2) == 1  # block 1 ended: both arms measured, 1 is faster
    assert p.rates()[2] == [10, 15]


def test_concurrencies_are_measured_apart_and_per_request():
    """Speculation pays alone and not in a batch of 8; 5-8 running requests share the 8 bucket, where rates are per
    request (650 tok/s at 5 beats 800 at 8)."""
    p = SpeculationPolicy(2, block_steps=1, explore_every=1000)
    _run(p, 1, {0: 50, 1: 70, 2: 90}, 10)
    _run(p, 8, {0: 50, 1: 30, 2: 25}, 10)
    assert p.choose(1) == 2 and p.choose(8) == 0 and p.choose(5) == 0
    assert p.best(2) == 0  # 2 running: not measured yet, plain
    q = SpeculationPolicy(1, block_steps=1)
    q.choose(8), q.record(0, 8, 800, 1.0), q.choose(5), q.record(1, 5, 650, 1.0)
    assert q.choose(6) == 1 and q.rates()[8] == [100, 130]  # the choice closed arm 1's block


def test_neighbours_are_re_tried_and_a_change_moves_the_choice():
    p = SpeculationPolicy(4, block_steps=1, explore_every=8)
    rates = {0: 100, 1: 120, 2: 150, 3: 130, 4: 110}
    chosen = _run(p, 2, rates, 5 + 16)
    assert chosen[5:] == [2] * 7 + [0] + [2] * 7 + [1]  # trials, then plain or a neighbour every 8 blocks, in turn
    # the drafter gets better at longer blocks: k=3 now pays most; the re-tries find it and the choice moves
    rates.update({3: 300, 4: 200})
    chosen = _run(p, 2, rates, 64)
    assert p.best(2) == 3 and chosen[-16:].count(3) >= 14  # re-tries of other arms: at most one in 8


def test_re_tries_that_change_nothing_fade():
    """Speculation far behind plain decoding (a 2-core CPU): each fruitless re-try doubles the wait, up to max_wait."""
    p = SpeculationPolicy(2, block_steps=1, explore_every=16, max_wait=256)
    chosen = _run(p, 8, {0: 100, 1: 40, 2: 30}, 3 + 4000)[3:]
    assert chosen.count(0) >= 4000 - 25
    gaps = [i for i, k in enumerate(chosen) if k]
    assert gaps[-1] - gaps[-2] >= 256  # at the cap


def test_speculation_plays_only_clearly_ahead_of_plain():
    """Its prefill steps (one at a time, drafting) are not in its rate: 5% ahead is not enough."""
    p = SpeculationPolicy(1, block_steps=1, explore_every=1000)
    _run(p, 4, {0: 100, 1: 105}, 10)
    assert p.best(4) == 0
    q = SpeculationPolicy(1, block_steps=1, explore_every=1000)
    _run(q, 4, {0: 100, 1: 150}, 10)
    assert q.best(4) == 1
