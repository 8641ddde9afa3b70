"""Simulated multi-turn agentic workload across DP ranks: prefix-hit rate and session stickiness per policy.

Sessions arrive over time; each turn's prompt is the previous prompt + the previous answer + a new
message, so turn n shares its whole history with turn n-1. Each rank has an LRU prefix cache of block
hashes; a request stays in flight for a number of ticks growing with its length. Prints one JSON object:

    python -m serving.bench.dp_router --ranks 4 --sessions 64 --turns 8 [--out router.json]
"""

from __future__ import annotations

import argparse
import heapq
import json
from collections import Counter, OrderedDict
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from serving.engine.dp_router import POLICIES, DPRouter, RouterConfig


class PrefixCacheSim:
    """A rank's prefix cache for the benchmark: an LRU of chained block hashes with a block capacity."""

    def __init__(self, capacity_blocks: int, block_size: int):
        self.capacity, self.block_size = capacity_blocks, block_size
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def lookup_and_insert(self, ids: Sequence[int]) -> int:
        """Tokens of `ids` whose blocks were cached (longest prefix); then caches all its full blocks."""
        h, hit, hashes = 0, 0, []
        for i in range(len(ids) // self.block_size):
            h = hash((h, tuple(ids[i * self.block_size:(i + 1) * self.block_size])))
            hashes.append(h)
        for h in hashes:
            if h not in self.blocks:
                break
            hit += self.block_size
        for h in hashes:
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)
        return hit


def simulate(policy: str, *, ranks: int, sessions: int, turns: int, seed: int = 0, block_size: int = 16,
             cache_blocks: int = 8192, max_inflight: int = 16, use_session_header: bool = True) -> dict:
    rng = np.random.default_rng(seed)
    router = DPRouter(RouterConfig(ranks, policy, max_inflight=max_inflight))
    caches = [PrefixCacheSim(cache_blocks, block_size) for _ in range(ranks)]
    history = {s: [int(t) for t in rng.integers(0, 50_000, int(rng.integers(200, 1200)))] for s in range(sessions)}
    # events: (time, kind, session, turn, rank); kind 0 = a turn finishes, 1 = a turn arrives
    events = [(float(rng.uniform(0, 20)), 1, s, 0, -1) for s in range(sessions)]
    heapq.heapify(events)
    placed: dict[int, list[int]] = {s: [] for s in range(sessions)}
    hit_tokens = prompt_tokens = 0
    while events:
        t, kind, s, turn, rank = heapq.heappop(events)
        if kind == 0:
            router.finish(rank)
            if turn + 1 < turns:  # user / tool think time, then the next turn
                history[s] += [int(x) for x in rng.integers(0, 50_000, int(rng.integers(50, 400)))]
                heapq.heappush(events, (t + float(rng.exponential(2.0)), 1, s, turn + 1, -1))
            continue
        prompt = history[s]
        headers = {"X-Session-ID": f"s{s}"} if use_session_header else {}
        rank = router.route(headers, prompt)
        placed[s].append(rank)
        hit_tokens += caches[rank].lookup_and_insert(prompt)
        prompt_tokens += len(prompt)
        answer = [int(x) for x in rng.integers(0, 50_000, int(rng.integers(20, 200)))]
        history[s] = prompt + answer
        heapq.heappush(events, (t + 1.0 + len(prompt) / 2000 + len(answer) / 50, 0, s, turn, rank))
    return routing_result(policy, hit_tokens, prompt_tokens, placed.values(), router.moved)


def routing_result(policy: str, cached_tokens: int, prompt_tokens: int, ranks_per_session, moved: int) -> dict:
    """What both routing benchmarks (this simulation, `dp_engine` through the engine) report of a policy: the
    prefix-hit rate (cached / prompt tokens), session stickiness from each session's ranks turn by turn (the mean
    share of a session's turns on its most used rank, the share of sessions with >= 95% of their turns on one
    rank) and the router's moves off saturated ranks."""
    stick = np.array([Counter(r).most_common(1)[0][1] / len(r) for r in ranks_per_session])
    return {"policy": policy, "prefix_hit_rate": cached_tokens / prompt_tokens,
            "mean_session_stickiness": float(stick.mean()),
            "sessions_with_95pct_turns_on_one_rank": float(np.mean(stick >= 0.95)),
            "sticky_moves_when_saturated": moved}


def emit(result: dict, out: str | None) -> None:
    """Print the JSON and, with `out`, also write it there."""
    text = json.dumps(result, indent=1)
    print(text)
    if out:
        Path(out).write_text(text + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--max-inflight", type=int, default=16)
    ap.add_argument("--cache-blocks", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-session-header", action="store_true", help="key sticky routing by the prefix hash")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    a = ap.parse_args()
    res = {p: simulate(p, ranks=a.ranks, sessions=a.sessions, turns=a.turns, seed=a.seed, cache_blocks=a.cache_blocks,
                       max_inflight=a.max_inflight, use_session_header=not a.no_session_header) for p in POLICIES}
    emit(res, a.out)


if __name__ == "__main__":
    main()
