"""DP routing: session affinity, prefix-hash keys, saturation fallback, the load policy."""

import pytest

from serving.engine.dp_router import DPRouter, RouterConfig, routing_key


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
