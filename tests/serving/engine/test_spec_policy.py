"""The speculation policy (serving.engine.spec_policy): plain first, then a block of each k that might pay, then the arm
with the most tokens per second at the batch's concurrency - step times by their median there, tokens per step pooled
over concurrencies - with re-tries of plain or the best's neighbours that follow a change and fade when nothing
changes."""

from serving.engine.spec_policy import SpeculationPolicy


def _run(policy, running, arms, steps, verified=True):
    """`steps` decisions, arm k's steps emitting arms[k][0] tokens per request in arms[k][1] seconds; the chosen ks."""
    chosen = []
    for _ in range(steps):
        k = policy.choose(running)
        tokens, seconds = arms[k]
        policy.record(k, running, tokens * running, seconds, verified=verified)
        chosen.append(k)
    return chosen


def _policy(max_k, **kw):
    return SpeculationPolicy(max_k, **{"block_steps": 4, "min_steps": 4, "window": 4, "token_window": 4, **kw})


def test_fixed_k_when_not_adaptive():
    p = SpeculationPolicy(5, adaptive=False)
    assert [p.choose(n) for n in (1, 8, 32)] == [5, 5, 5]


def test_plain_first_then_every_arm_then_the_fastest_plays():
    p = _policy(3, explore_every=1000)
    chosen = _run(p, 1, {0: (1, 0.01), 1: (1.5, 0.01), 2: (1.8, 0.01), 3: (1.25, 0.01)}, 40)
    assert chosen[:16] == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4
    assert set(chosen[16:]) == {2}
    assert p.rates()[1] == [100, 150, 180, 125]


def test_a_stalled_step_does_not_condemn_an_arm():
    """Step times by their median: plain's first block with one 20x stall still measures plain's rate, which
    speculation 20% ahead does not beat by the margin (the block's mean would have made it lose 4 to 5.8)."""
    p = _policy(1, explore_every=1000)
    assert [p.choose(2) for _ in range(4)] == [0] * 4
    for seconds in (1.0, 20.0, 1.0, 1.0):
        p.record(0, 2, 2, seconds)
    _run(p, 2, {0: (1, 1.0), 1: (1.2, 1.0)}, 4)
    assert p.rates()[2] == [1.0, 1.2] and p.best(2) == 0


def test_a_step_that_verified_no_drafts_is_not_counted():
    """Speculation's first step after plain ones verifies nothing (no drafts yet); it is not what the arm's steps
    cost or emit once running."""
    p = _policy(1, block_steps=5)
    _run(p, 4, {0: (1, 1.0)}, 5)
    assert p.choose(4) == 1
    p.record(1, 4, 4, 3.0, verified=False)
    assert p.rates()[4] == [1.0, None]
    _run(p, 4, {1: (2, 1.0)}, 4)
    assert p.rates()[4] == [1.0, 2.0]


def test_step_times_are_per_concurrency():
    """Speculation pays alone (1.8 tokens for a plain step's time) and not in a batch of 8 (3x the step time); 5-8
    running requests share the 8 bucket."""
    p = _policy(1, explore_every=1000)  # tried at 8: its step time was plain's alone
    _run(p, 1, {0: (1, 1.0), 1: (1.8, 1.0)}, 12)
    _run(p, 8, {0: (1, 1.0), 1: (1.8, 3.0)}, 12)
    assert p.rates() == {1: [1.0, 1.8], 8: [1.0, 0.6]}
    assert p.best(1) == 1 and p.best(5) == 0 and p.best(2) == 0  # 2: plain unmeasured there


def test_tokens_per_step_are_pooled_over_concurrencies():
    """Acceptance is the drafter's, not the batch's: tokens per step measured alone rate arm 1 at 8 as soon as its
    step time there is known."""
    p = _policy(1, explore_every=1000, token_window=8)
    _run(p, 1, {0: (1, 1.0), 1: (2.0, 1.0)}, 12)
    p.record(0, 8, 8, 1.0), p.record(0, 8, 8, 1.0), p.record(0, 8, 8, 1.0), p.record(0, 8, 8, 1.0)
    for _ in range(4):
        p.record(1, 8, 8 * 1.0, 2.0)  # at 8 one token a step: pooled with alone's 2.0
    assert p.rates()[8] == [1.0, 1.5 / 2.0]


def test_an_arm_that_lost_at_a_lower_concurrency_is_not_tried_at_a_higher_one():
    """Verification's step time relative to plain's only grows with the rows of a step: at 2 running, arm 2 took 3x
    plain's time for 2.2 tokens; at 8 it is not tried (until the first re-try), arm 1 (1.2x for 1.8 tokens) is."""
    p = _policy(2, explore_every=16)
    _run(p, 2, {0: (1, 1.0), 1: (1.8, 1.2), 2: (2.2, 3.0)}, 12)
    chosen = _run(p, 8, {0: (1, 2.0), 1: (1.8, 2.4), 2: (2.2, 6.0)}, 40)
    assert chosen[:8] == [0] * 4 + [1] * 4 and 2 not in chosen


def test_an_unmeasured_arm_is_bounded_by_the_smaller_arms_measured():
    """Arms 2 and 3 never ran anywhere: at 8 their step time is at least arm 1's at 2 running (3x plain: fewer rows,
    a lower concurrency) and their tokens at most arm 1's 1.5 + 1 and + 2, so 2.5 / 3 and 3.5 / 3 are under the
    margin and neither is tried (before, an arm unmeasured at every lower concurrency was tried: 1 + k tokens)."""
    p = _policy(3, explore_every=1000)
    _run(p, 2, {0: (1, 1.0), 1: (1.5, 3.0)}, 8)
    assert p._estimate(8, 3) == (1.5 + 2) / 3.0 and p._estimate(8, 2) == (1.5 + 1) / 3.0
    chosen = _run(p, 8, {0: (1, 1.0), 1: (1.5, 3.0), 2: (2.0, 3.5), 3: (2.5, 4.0)}, 24)
    assert chosen == [0] * 24


def test_neighbours_are_re_tried_and_a_change_moves_the_choice():
    p = _policy(4, explore_every=2, block_steps=1, min_steps=1, window=1, token_window=1, explore_budget=1)
    arms = {0: (1, 1.0), 1: (1.2, 1.0), 2: (1.5, 1.0), 3: (1.3, 1.0), 4: (1.1, 1.0)}
    chosen = _run(p, 2, arms, 5 + 8)
    # trials, then plain or a neighbour in turn, after 1, 3, 7 blocks of the best (each fruitless re-try doubles the wait)
    chosen += _run(p, 2, arms, 6)
    assert chosen[5:] == [2, 0] + [2] * 3 + [1] + [2] * 7 + [3]
    # the drafter gets better at longer blocks: k=3 now pays most; the re-tries find it and the choice moves
    arms.update({3: (3.0, 1.0), 4: (2.0, 1.0)})
    chosen = _run(p, 2, arms, 200)
    assert p.best(2) == 3 and chosen[-16:].count(3) >= 14


def test_re_tries_that_change_nothing_fade():
    """Speculation far behind plain decoding (a 2-core CPU): each fruitless re-try doubles the wait, up to max_wait."""
    p = _policy(2, block_steps=1, min_steps=1, explore_every=16, max_wait=256)
    chosen = _run(p, 8, {0: (1, 1.0), 1: (1.2, 3.0), 2: (1.3, 4.0)}, 3 + 4000)[3:]
    assert chosen.count(0) >= 4000 - 25
    gaps = [i for i, k in enumerate(chosen) if k]
    assert gaps[-1] - gaps[-2] >= 256  # at the cap


def test_speculation_plays_only_clearly_ahead_of_plain():
    """Its prefill steps (one at a time, drafting) are not in its rate: 5% ahead is not enough."""
    p = _policy(1, explore_every=1000)
    _run(p, 4, {0: (1, 1.0), 1: (1.05, 1.0)}, 12)
    assert p.best(4) == 0
    q = _policy(1, explore_every=1000)
    _run(q, 4, {0: (1, 1.0), 1: (1.5, 1.0)}, 12)
    assert q.best(4) == 1


def test_a_re_try_waits_until_its_loss_is_a_small_share():
    """Speculation at half plain's speed loses a block per re-try: with a 1% budget a re-try comes every 100 blocks,
    however short the backoff."""
    p = _policy(1, block_steps=1, min_steps=1, explore_every=1, explore_budget=0.01)
    chosen = _run(p, 8, {0: (1, 1.0), 1: (1.0, 2.0)}, 2 + 500)
    at = [i for i, k in enumerate(chosen) if k]
    assert at == [1, 101, 201, 301, 401, 501]


def test_a_re_try_into_speculation_also_pays_the_step_into_it():
    """The step into speculation (it verifies nothing: no request has drafts yet) is not the arm's speed, but a re-try
    from plain pays it: measured at 9 plain steps, it adds 8 / block_steps blocks to the loss, so with speculation at
    half plain's speed (1 block) and blocks of 4 steps the re-tries come every 300 blocks, not every 100 (the test above)."""
    p = _policy(1, block_steps=4, min_steps=1, window=4, explore_every=1, explore_budget=0.01)
    chosen = []
    for _ in range(4 * 1300):
        k = p.choose(8)
        if k and (not chosen or not chosen[-1]):
            p.record(1, 8, 8, 9.0, verified=False)  # the switch step, then the arm's own
        p.record(k, 8, 8, 2.0 if k else 1.0)
        chosen.append(k)
    starts = [i for i, k in enumerate(chosen) if k and (i == 0 or not chosen[i - 1])]
    # the trial after plain's first block (min_steps + 1 = 2 steps), then a re-try every 300 blocks of 4 steps
    assert starts == [4, 6 + 299 * 4] + [6 + 299 * 4 + 300 * 4 * n for n in (1, 2, 3)]


def test_an_arm_is_tried_once_per_concurrency():
    """A trial block whose steps went to other concurrencies (requests ending) measures nothing here; it is not
    repeated block after block (the re-tries measure it later)."""
    p = _policy(1, explore_every=1000)
    _run(p, 4, {0: (1, 1.0)}, 4)
    chosen = [p.choose(4) for _ in range(40)]  # no step recorded at 4: they ran at other concurrencies
    assert chosen == [1] * 4 + [0] * 36


def test_a_re_try_unmeasured_here_waits_by_the_lower_concurrency_estimate():
    """Arm 1 took 3x plain's step time for 1.5 tokens at 2 running: at 8 it is not tried, and its first re-try there
    waits until its estimated loss (1 block) is 1% of the blocks, as a measured one would."""
    p = _policy(1, block_steps=1, min_steps=1, explore_every=1, explore_budget=0.01)
    _run(p, 2, {0: (1, 1.0), 1: (1.5, 3.0)}, 2)
    chosen = _run(p, 8, {0: (1, 1.0), 1: (1.5, 3.0)}, 250)
    assert [i for i, k in enumerate(chosen) if k] == [100, 200]


def _buckets(rows, ladder=(8, 16, 32, 64, 128)):
    return next(b for b in ladder if b >= rows)


def test_only_arms_on_different_compiled_shapes_are_tried():
    """k and k + 1 drafts per request on one token bucket cost the same and k + 1 emits at least as much: alone (2-6
    rows, all in the 8-row bucket) only k = 5 is an arm; at 8 running, 16 / 32 / 64-row steps: k = 1, 3, 5."""
    p = SpeculationPolicy(5, step_shape=_buckets, block_steps=8, min_steps=4, explore_every=1000)
    assert p.arms(1) == [0, 5] and p.arms(8) == [0, 1, 3, 5] and p.arms(6) == [0, 1, 4, 5]
    alone = _run(p, 1, {0: (1, 1.0), 5: (3.5, 1.0)}, 8 + 5 + 20)
    assert alone == [0] * 8 + [5] * 25  # a trial of min_steps + 1, then the fastest plays
    q = SpeculationPolicy(5, step_shape=_buckets, block_steps=8, min_steps=4, explore_every=1000)
    arms = {0: (1, 1.0), 1: (1.8, 1.6), 3: (2.9, 2.5), 5: (3.5, 4.5)}
    assert _run(q, 8, arms, 8 + 15 + 16) == [0] * 8 + [1] * 5 + [3] * 5 + [5] * 5 + [0] * 16


def test_a_re_try_goes_to_the_next_arm_a_shape_tells_apart():
    """Best k = 3 at 8 running: its neighbours are k = 1 and k = 5, not 2 and 4 (on k = 3's and k = 5's shapes), and
    plain."""
    p = SpeculationPolicy(5, step_shape=_buckets, block_steps=1, min_steps=1, window=1, token_window=1,
                          explore_every=1, explore_budget=1)
    chosen = _run(p, 8, {0: (1, 1.0), 1: (1.5, 1.0), 3: (3.0, 1.0), 5: (3.2, 2.0)}, 4 + 40)
    assert chosen[:4] == [0, 1, 3, 5] and p.best(8) == 3
    assert {k for k in chosen[4:] if k != 3} == {0, 1, 5}
