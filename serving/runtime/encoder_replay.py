"""Encoder-side replay: what a prefix-cache hit of H tokens becomes (spec §3.4).

Only global rows and index keys are cached, so a hit restarts the request at replay_start = H - R and
recomputes [replay_start, H): those rows rewrite every layer's SWA ring and the ratio-2 tails, read no
SWA row below replay_start, and never rewrite the cached global/index rows (write floor H: a row is
written only if its last token is >= H, so a ratio-2 pair straddling the floor is still written).

R is the replay length: the window W with bounded replay (approximate by design: the replayed rows'
windows are cut), or the exact dependency halo L * (W - 1) with replay off - after recomputing that many
rows every layer's window rows below H are exactly those of a cold run (row p of layer l is exact once
p >= replay_start + l * (W - 1)), so a hit gives the cold-run logits. Hits of at most R tokens are not
adopted: the replay would recompute them all anyway.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsv41.config import ModelConfig


@dataclass(frozen=True)
class PrefixPlan:
    hit_tokens: int  # cached tokens adopted (0: the hit is dropped)
    replay_start: int  # first position the request computes
    write_floor: int  # cached rows below this are never rewritten

    @property
    def replayed(self) -> int:
        return self.hit_tokens - self.replay_start


def replay_length(config: ModelConfig, bounded: bool) -> int:
    W = config.sliding_window
    return W if bounded else config.num_hidden_layers * (W - 1)


def plan_prefix_hit(hit_tokens: int, config: ModelConfig, bounded: bool) -> PrefixPlan:
    """The rewind for a hit of `hit_tokens` (block aligned, leaving at least one prompt token)."""
    replay = replay_length(config, bounded)
    if hit_tokens <= replay:
        return PrefixPlan(0, 0, 0)
    return PrefixPlan(hit_tokens, hit_tokens - replay, hit_tokens)
