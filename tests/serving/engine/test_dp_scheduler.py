"""Data-parallel ranks behind the scheduler interface (no model): each rank its own budget, slots and block
pool; the router keeps a session on its rank (sticky) or spreads by load; a refused request is not counted."""

import pytest

from serving.engine.dp_scheduler import DataParallelScheduler
from serving.engine.args import EngineArgs
from serving.engine.scheduler import QueueFull
from tests.serving.engine.test_scheduler import BS, CFG, _finish_step, _req


def _dp(ranks=3, policy="sticky", max_inflight=None, **kw):
    a = EngineArgs.of(**{"max_num_seqs": 2, "max_num_batched_tokens": 16, "dp_routing_policy": policy,
                         "dp_max_inflight": max_inflight, **kw})
    return DataParallelScheduler(a.scheduler, a.runtime, CFG, num_blocks=8, block_size=BS, ranks=ranks)


def test_each_rank_has_its_own_budget_slots_and_blocks():
    s = _dp()
    reqs = [_req(f"r{i}", 20, seed=i, session_id=f"s{i}") for i in range(3)]
    for r in reqs:
        s.add(r)
    assert [r.rank for r in reqs] == [0, 1, 2]  # new sessions: least-loaded ranks in turn
    sched = s.schedule()
    # one budget of 16 tokens per rank: every request gets a 16-token chunk in the same step
    assert sorted((x.request.rank, x.end - x.start) for x in sched) == [(0, 16), (1, 16), (2, 16)]
    assert {r.slot for r in reqs} == {0}  # slots are per rank
    assert [s.block_table(r) for r in reqs] == [[0, 1, 2]] * 3  # block ids are per rank (whole prompt reserved)
    assert s.num_blocks == 24 and s.num_free_blocks == 24 - 9 and s.usage == pytest.approx(9 / 24)
    _finish_step(s, sched)
    assert [x.start for x in s.schedule()] == [16, 16, 16]
    s.remove(reqs[1])
    s.remove(reqs[1])  # the engine may remove a finished request again: nothing changes (the router's count too)
    assert s.rank_requests() == [1, 0, 1] and s.ranks[1].blocks.num_free_blocks == 8
    assert s.router.inflight == [1, 0, 1]


def test_sticky_session_stays_unless_saturated_and_load_policy_spreads():
    assert _dp().router.config.max_inflight == 4  # default: two per slot
    s = _dp(max_inflight=2)
    a1 = _req("a1", 9, session_id="chat")
    s.add(a1)
    a2 = _req("a2", 9, seed=1, session_id="chat")
    s.add(a2)
    assert a1.rank == a2.rank == 0  # same session, same rank (its prefix cache)
    a3 = _req("a3", 9, seed=2, session_id="chat")
    s.add(a3)  # rank 0 has 2 in flight: saturated -> least-loaded, and the session moves
    assert a3.rank == 1 and s.router.moved == 1
    no_session = [_req(f"p{i}", 9, seed=7) for i in range(2)]  # same prompt, no session: the prefix hash
    for r in no_session:
        s.add(r)
    assert no_session[0].rank == no_session[1].rank

    load = _dp(policy="load")
    same = [_req(f"l{i}", 9, session_id="chat") for i in range(3)]
    for r in same:
        load.add(r)
    assert [r.rank for r in same] == [0, 1, 2]


def test_queue_full_on_a_rank_is_not_counted_in_flight():
    s = _dp(ranks=1, max_queued_requests=1)
    s.add(_req("a", 5))
    with pytest.raises(QueueFull):
        s.add(_req("b", 5, seed=1))
    assert s.rank_requests() == [1]


def test_a_finish_the_scheduler_decides_frees_the_request_on_its_rank_once():
    """`postprocess` finishing a request (here by its length limit) frees its blocks and slot on its rank and takes it
    out of the router's count; the removal that follows an abort of the same id changes nothing."""
    from serving.runtime.sampling_params import SamplingParams

    s = _dp(ranks=2)
    reqs = [_req(f"r{i}", 12, seed=i, session_id=f"s{i}") for i in range(2)]
    reqs[1].params = SamplingParams(temperature=0, max_tokens=1)
    for r in reqs:
        s.add(r)
    finishes = [s.postprocess(x, 7) for x in s.schedule()]
    assert finishes == [None, ("length", None)] and reqs[1].finished
    assert s.rank_requests() == [1, 0] and s.ranks[1].blocks.num_free_blocks == 8 and s.ranks[1].free_slots == [1, 0]
    s.remove(reqs[1])
    assert s.rank_requests() == [1, 0] and s.ranks[1].free_slots == [1, 0]
