"""Synthetic agentic (AgentX-style) workload: session trees of token-id conversations (serving spec §7.4).

Pure Python + NumPy (plus `workloads.Turn`); a tree is a function of (config, seed, tree index, salt) only.
Defaults are scaled to what the tiny preset serves on a CPU in seconds; `SCALES["agentx"]` holds
AgentX's published medians (43 turns, ~444 output tokens, 64-token blocks, 44% of sessions with subagents,
10-s idle cap) and every field is a flag of `python -m serving.bench.agentic`.

One `SessionTree`:
* a root conversation of T turns, T ~ lognormal(turns_median, turns_sigma) capped at max_turns, cut short
  before a turn whose prompt + output would pass max_context;
* turn 0's prompt is [system prompt][cache-bust marker][task]; turn t > 0 re-sends turn t-1's prompt, the
  recorded reply of turn t-1 (drawn here, as long as turn t-1's max_tokens, never the server's output) and a
  tool result. Reply + tool result is a whole number of KV blocks and turn 0 is block-aligned, so every
  prompt ends on a block boundary and its growth is a block-aligned delta (AgentX traces are block-exact);
* subagents: with probability subagent_prob a tree spawns n ~ lognormal(subagents_median) of them (capped),
  each after a uniformly drawn root turn a < T-1, with a fresh context [system][marker][own task] and its own
  turns. A gating subagent holds root turn a+1 back until it has finished (a join); the others run in the
  background and the tree ends when every conversation has. Subagents do not spawn subagents;
* think time before each turn after a conversation's first: lognormal(think_median_s), capped at
  think_cap_s, counted from the end of the previous request to the start of the next (AgentX's idle cap);
* the marker is marker_len ids encoding (salt, tree index), so two trees never share a prefix by accident
  and a new salt makes a rerun on the same server share nothing with the last one. With
  shared_system_prompt the system prompt comes first and is the same in every tree (a coding agent's is);
  without, the marker leads and trees share no block at all.

`block_reuse` counts what an ideal prefix cache would serve: the theoretical hit rate is tokens re-sent
(whole blocks already sent after the same prefix, within the first len - 1 tokens, as a server always
computes the last prompt token) / tokens sent.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

import numpy as np

from serving.bench.workloads import Turn


@dataclass(frozen=True)
class AgenticConfig:
    block_size: int = 16  # the server's KV block size: tool results are whole blocks
    token_id_range: tuple[int, int] = (10, 500)  # prompt ids drawn from [LOW, HIGH), inside the vocabulary
    system_prompt_len: int = 64
    shared_system_prompt: bool = True  # one system prompt for every tree (else the marker leads)
    marker_len: int = 4
    task_len: int = 24  # a conversation's first user message, rounded up to align turn 0 to a block
    turns_median: float = 4.0
    turns_sigma: float = 1.0
    max_turns: int = 16
    output_median: float = 16.0  # recorded reply = max_tokens of the turn (ignore_eos)
    output_sigma: float = 0.8
    max_output: int = 64
    tool_blocks_median: float = 2.0  # tool result blocks per turn
    tool_blocks_sigma: float = 0.8
    max_tool_blocks: int = 8
    max_context: int = 2048  # prompt + output of every request fit in this (the server's max-model-len)
    subagent_prob: float = 0.44
    subagents_median: float = 2.0
    max_subagents: int = 4
    subagent_turns_median: float = 3.0
    gating_fraction: float = 0.5
    think_median_s: float = 0.2
    think_sigma: float = 1.0
    think_cap_s: float = 2.0

    def __post_init__(self):
        ints = ("block_size", "system_prompt_len", "marker_len", "task_len", "max_turns", "max_output",
                "max_tool_blocks", "max_context", "max_subagents")
        for name in ints:
            if getattr(self, name) < (0 if name == "system_prompt_len" else 1):
                raise ValueError(f"{name} must be >= {0 if name == 'system_prompt_len' else 1}, "
                                 f"got {getattr(self, name)}")
        for name in ("turns_median", "output_median", "tool_blocks_median", "subagents_median",
                     "subagent_turns_median", "think_median_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("turns_sigma", "output_sigma", "tool_blocks_sigma", "think_sigma", "think_cap_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("subagent_prob", "gating_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must lie in [0, 1], got {getattr(self, name)}")
        low, high = self.token_id_range
        if not 0 <= low < high:
            raise ValueError(f"token_id_range must satisfy 0 <= low < high, got {low},{high}")
        first = self.first_prompt_len()
        if first + self.max_output > self.max_context:
            raise ValueError(f"max_context {self.max_context} cannot hold a first prompt ({first} tokens: system "
                             f"prompt + marker + task, block-aligned) plus max_output {self.max_output}")

    def first_prompt_len(self) -> int:
        """Turn 0's prompt: system + marker + task rounded up to a whole number of blocks."""
        n = self.system_prompt_len + self.marker_len + self.task_len
        return -(-n // self.block_size) * self.block_size


SCALES = {
    "cpu": AgenticConfig(),
    # AgentX's published shape (spec §7.1): median 43 turns, input growing to ~142K, output median 444,
    # 64-token blocks, 44% of sessions with subagents (median 4), 10-s idle cap, 256K corpus variant.
    "agentx": AgenticConfig(block_size=64, token_id_range=(10, 100_000), system_prompt_len=20_000, marker_len=8,
                            task_len=500, turns_median=43, turns_sigma=1.0, max_turns=400, output_median=444,
                            output_sigma=1.0, max_output=8192, tool_blocks_median=40, tool_blocks_sigma=1.0,
                            max_tool_blocks=500, max_context=256_000, subagents_median=4, max_subagents=16,
                            subagent_turns_median=20, think_median_s=2.0, think_sigma=1.0, think_cap_s=10.0),
}


@dataclass(frozen=True)
class Conversation:
    """One context: its turns (workloads.Turn, each the whole conversation so far) run one after another."""

    conversation_id: str
    turns: tuple[Turn, ...]
    think_s: tuple[float, ...]  # idle time before each turn (end of the previous request -> send); 0 first
    subagents: tuple["Subagent", ...] = ()


@dataclass(frozen=True)
class Subagent:
    after_turn: int  # spawned when the parent's turn `after_turn` finishes
    gating: bool  # the parent's turn after_turn + 1 waits until this subagent has finished
    conversation: Conversation


@dataclass(frozen=True)
class SessionTree:
    index: int
    session_id: str  # the X-Session-ID of every request of the tree (subagents included)
    root: Conversation
    warm_start_turn: int  # a lane's first tree starts here; root turn warm_start_turn - 1 is its warm-up

    def conversations(self) -> Iterator[Conversation]:
        yield self.root
        for s in self.root.subagents:
            yield s.conversation

    def requests_in_order(self, from_turn: int = 0) -> list[Turn]:
        """Root turns from `from_turn`, each followed by the turns of the subagents it spawned (roughly the
        order a lane sends them; only the first sender of a shared block depends on the order)."""
        out = []
        for t in range(from_turn, len(self.root.turns)):
            out.append(self.root.turns[t])
            for s in self.root.subagents:
                if s.after_turn == t:
                    out.extend(s.conversation.turns)
        return out

    @property
    def num_requests(self) -> int:
        return sum(len(c.turns) for c in self.conversations())


def _heavy(rng: np.random.Generator, median: float, sigma: float, cap: int) -> int:
    """A lognormal draw around `median`, rounded, in [1, cap]."""
    return int(min(cap, max(1, round(median * math.exp(sigma * rng.standard_normal())))))


def _ids(rng: np.random.Generator, n: int, token_id_range: tuple[int, int]) -> tuple[int, ...]:
    return tuple(int(x) for x in rng.integers(token_id_range[0], token_id_range[1], size=n))


def _digits(value: int, base: int, n: int, what: str) -> list[int]:
    if value >= base ** n:
        raise ValueError(f"{what} {value} does not fit in the cache-bust marker ({n} ids of base {base}); "
                         "raise marker_len")
    return [(value // base ** i) % base for i in range(n)]


def cache_bust_marker(config: AgenticConfig, index: int, salt: int) -> tuple[int, ...]:
    """marker_len ids: the tree index in base (HIGH - LOW), then the salt; distinct for distinct (salt, index)."""
    low, high = config.token_id_range
    base = high - low
    if config.marker_len < 2:
        raise ValueError("marker_len must be >= 2 to encode a tree index and a salt")
    digits = _digits(index, base, config.marker_len - 1, "tree index") + _digits(salt, base, 1, "salt")
    return tuple(low + d for d in digits)


def system_prompt(config: AgenticConfig, seed: int) -> tuple[int, ...]:
    return _ids(np.random.default_rng([seed, 0]), config.system_prompt_len, config.token_id_range)


def _think(rng: np.random.Generator, c: AgenticConfig) -> float:
    return min(c.think_cap_s, c.think_median_s * math.exp(c.think_sigma * rng.standard_normal()))


def _conversation(rng: np.random.Generator, c: AgenticConfig, conversation_id: str,
                  head: tuple[tuple[str, tuple[int, ...]], ...], n_turns: int) -> Conversation:
    """`head`: the first prompt's messages before the task; the task joins head's last message."""
    head_len = sum(len(ids) for _, ids in head)
    task = _ids(rng, c.first_prompt_len() - head_len, c.token_id_range)
    messages = head[:-1] + ((head[-1][0], head[-1][1] + task),)
    out = _heavy(rng, c.output_median, c.output_sigma, c.max_output)
    turns, think = [Turn(messages, out)], [0.0]
    prompt_len = c.first_prompt_len()
    for _ in range(n_turns - 1):
        tool_len = _heavy(rng, c.tool_blocks_median, c.tool_blocks_sigma, c.max_tool_blocks) * c.block_size
        tool_len += (-out) % c.block_size  # reply + tool result: whole blocks
        next_out = _heavy(rng, c.output_median, c.output_sigma, c.max_output)
        if prompt_len + out + tool_len + next_out > c.max_context:
            break
        messages = messages + (("assistant", _ids(rng, out, c.token_id_range)),
                               ("user", _ids(rng, tool_len, c.token_id_range)))
        prompt_len += out + tool_len
        out = next_out
        turns.append(Turn(messages, out))
        think.append(_think(rng, c))
    return Conversation(conversation_id, tuple(turns), tuple(think))


def session_tree(config: AgenticConfig, seed: int, index: int, salt: int = 0) -> SessionTree:
    """Tree `index` of the workload `seed`: the same for the same arguments, whatever else is generated."""
    if index < 0 or salt < 0:
        raise ValueError(f"tree index and salt must be >= 0, got {index}, {salt}")
    c = config
    rng = np.random.default_rng([seed, 1, index])
    marker = cache_bust_marker(c, index, salt)
    system = system_prompt(c, seed) if c.shared_system_prompt else _ids(rng, c.system_prompt_len, c.token_id_range)
    if c.shared_system_prompt:
        head = (("system", system), ("user", marker))
    else:
        head = (("system", marker + system), ("user", ()))
    session_id = f"agentic-seed{seed}-salt{salt}-tree{index}"
    root = _conversation(rng, c, session_id, head, _heavy(rng, c.turns_median, c.turns_sigma, c.max_turns))
    subagents = []
    n_root = len(root.turns)
    if n_root >= 2 and rng.random() < c.subagent_prob:
        for i in range(_heavy(rng, c.subagents_median, 0.8, c.max_subagents)):
            after = int(rng.integers(0, n_root - 1))
            gating = bool(rng.random() < c.gating_fraction)
            n_turns = _heavy(rng, c.subagent_turns_median, c.turns_sigma, c.max_turns)
            conv = _conversation(rng, c, f"{session_id}.sub{i}", head, n_turns)
            subagents.append(Subagent(after, gating, conv))
    subagents.sort(key=lambda s: s.after_turn)
    warm_start = int(rng.integers(1, n_root)) if n_root >= 2 else 0
    root = dataclasses.replace(root, subagents=tuple(subagents))
    return SessionTree(index, session_id, root, warm_start)


def session_trees(config: AgenticConfig, seed: int, num: int, salt: int = 0) -> list[SessionTree]:
    return [session_tree(config, seed, i, salt) for i in range(num)]


def block_reuse(prompts: Iterable[Sequence[int]], block_size: int, seen: set | None = None) -> tuple[int, int]:
    """(tokens an ideal prefix cache serves, tokens sent) for prompts sent in this order.

    A block is served when the same block after the same prefix was sent before (chained block keys, so only
    a contiguous prefix counts), and only whole blocks of the first len - 1 tokens. `seen` carries the
    cache's contents between calls (e.g. warm-up prompts sent first)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    seen = set() if seen is None else seen
    reused = sent = 0
    for prompt in prompts:
        key: object = None
        servable = (len(prompt) - 1) // block_size
        for b in range(len(prompt) // block_size):
            key = hash((key, tuple(prompt[b * block_size:(b + 1) * block_size])))
            if b < servable and key in seen:
                reused += block_size
            seen.add(key)
        sent += len(prompt)
    return reused, sent


def theoretical_hit_rate(trees: Sequence[SessionTree], block_size: int) -> float:
    """Over whole trees in order (each tree's requests as `requests_in_order`), one shared ideal cache."""
    seen: set = set()
    reused = sent = 0
    for tree in trees:
        r, s = block_reuse((t.prompt_ids for t in tree.requests_in_order()), block_size, seen)
        reused, sent = reused + r, sent + s
    return reused / sent if sent else 0.0
