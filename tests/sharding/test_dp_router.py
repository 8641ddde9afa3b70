"""DP routing: session affinity, prefix-hash keys, saturation fallback, the load policy, and the benchmark's
comparison of prefix-hit rates."""

import pytest

from sharding.bench_router import simulate
from sharding.dp_router import DPRouter, PrefixCacheSim, RouterConfig, routing_key


def test_session_header_then_prefix_hash():
    assert routing_key({"x-session-id": "abc"}, [1, 2], 4) == routing_key({"X-Session-ID": "abc"}, [9], 4)
    assert routing_key({}, [1, 2, 3, 4, 5], 4) == routing_key({}, [1, 2, 3, 4, 6], 4)  # same first block
    assert routing_key({}, [1, 2, 3, 4], 4) != routing_key({}, [1, 2, 3, 5], 4)


def test_sticky_keeps_session_until_saturated():
    r = DPRouter(RouterConfig(3, "sticky", max_inflight=2))
    first = r.route({"X-Session-ID": "s"}, [1])
    assert r.route({"X-Session-ID": "s"}, [1]) == first  # 2 in flight now: saturated
    other = r.route({"X-Session-ID": "s"}, [1])
    assert other != first and r.moved == 1
    r.finish(first), r.finish(first)
    assert r.route({"X-Session-ID": "s"}, [1]) == other  # the session now lives where it moved


def test_load_policy_is_least_loaded():
    r = DPRouter(RouterConfig(3, "load"))
    ranks = [r.route({"X-Session-ID": "s"}, [1]) for _ in range(6)]
    assert sorted(ranks) == [0, 0, 1, 1, 2, 2]
    with pytest.raises(ValueError, match="policy"):
        RouterConfig(2, "random")


def test_prefix_cache_sim_longest_prefix():
    c = PrefixCacheSim(capacity_blocks=4, block_size=2)
    assert c.lookup_and_insert([1, 2, 3, 4, 5]) == 0
    assert c.lookup_and_insert([1, 2, 3, 4, 7, 8]) == 4
    assert c.lookup_and_insert([1, 9, 3, 4]) == 0  # chained hashes: a changed first block misses all


def test_benchmark_sticky_keeps_sessions_and_hits_more():
    kw = dict(ranks=4, sessions=48, turns=6, seed=0)
    sticky, load = simulate("sticky", **kw), simulate("load", **kw)
    print(f"\nsticky {sticky}\nload   {load}")
    assert sticky["sessions_with_95pct_turns_on_one_rank"] >= 0.95
    assert sticky["prefix_hit_rate"] > load["prefix_hit_rate"]
    by_prefix = simulate("sticky", use_session_header=False, **kw)
    assert by_prefix["mean_session_stickiness"] >= 0.95
