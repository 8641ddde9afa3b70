"""Request routing across data-parallel ranks (serving spec §5.3): host-side policy the data-parallel
scheduler (`serving.engine.dp_scheduler`) asks for a new request's rank.

`sticky`: a request's key is its `X-Session-ID` header, else a hash of its first prompt block (the prefix
every turn of a conversation shares); a key stays on the rank that served it - where its prefix cache
is - unless that rank is saturated (`max_inflight` requests), then it moves to the least-loaded rank and
stays there. `load`: always the least-loaded rank (vLLM's in-process DP balancer), the comparison point.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Mapping, Sequence

POLICIES = ("sticky", "load")


@dataclass(frozen=True)
class RouterConfig:
    num_ranks: int
    policy: str = "sticky"
    max_inflight: int = 64  # a rank with this many requests in flight is saturated
    prefix_tokens: int = 64  # tokens hashed into the key when there is no session id
    max_keys: int = 100_000  # remembered keys (LRU)

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"policy {self.policy!r}: choose one of {POLICIES}")
        for name in ("num_ranks", "max_inflight", "prefix_tokens", "max_keys"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def routing_key(headers: Mapping[str, str], prompt_ids: Sequence[int], prefix_tokens: int) -> str:
    """The session id header (case-insensitive), else a hash of the prompt's first tokens."""
    for k, v in headers.items():
        if k.lower() == "x-session-id" and v:
            return "session:" + v
    head = ",".join(map(str, prompt_ids[:prefix_tokens]))
    return "prefix:" + hashlib.blake2b(head.encode(), digest_size=8).hexdigest()


class DPRouter:
    def __init__(self, config: RouterConfig):
        self.config = config
        self.inflight = [0] * config.num_ranks
        self.owner: OrderedDict[str, int] = OrderedDict()
        self.moved = 0  # sticky requests sent elsewhere because their rank was saturated

    def least_loaded(self) -> int:
        return min(range(self.config.num_ranks), key=lambda r: (self.inflight[r], r))

    def route(self, headers: Mapping[str, str], prompt_ids: Sequence[int]) -> int:
        """The rank for a new request (counted in flight until `finish`)."""
        c = self.config
        rank = self.least_loaded()
        if c.policy == "sticky":
            key = routing_key(headers, prompt_ids, c.prefix_tokens)
            owner = self.owner.get(key)
            if owner is not None and self.inflight[owner] < c.max_inflight:
                rank = owner
            elif owner is not None:
                self.moved += 1
            self.owner[key] = rank
            self.owner.move_to_end(key)
            if len(self.owner) > c.max_keys:
                self.owner.popitem(last=False)
        self.inflight[rank] += 1
        return rank

    def finish(self, rank: int) -> None:
        if self.inflight[rank] <= 0:
            raise ValueError(f"rank {rank} has no request in flight")
        self.inflight[rank] -= 1
