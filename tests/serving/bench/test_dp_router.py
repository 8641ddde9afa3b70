"""The routing benchmark's simulation: its prefix cache and the comparison of prefix-hit rates per policy; the
result both routing benchmarks report (`dp_engine` too)."""

from serving.bench.dp_router import PrefixCacheSim, routing_result, simulate


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


def test_routing_result_hit_rate_and_stickiness():
    r = routing_result("sticky", 30, 120, [[0, 0, 0, 1], [1, 1], [2, 2, 2]], moved=2)
    assert r == {"policy": "sticky", "prefix_hit_rate": 0.25, "mean_session_stickiness": (0.75 + 1 + 1) / 3,
                 "sessions_with_95pct_turns_on_one_rank": 2 / 3, "sticky_moves_when_saturated": 2}
