"""Benchmark workloads as token-id conversations: `random` and `prefix-repetition` (optionally multi-turn).

Pure Python + NumPy, no project imports: `hf_generate.py` loads this file by path under the HF python
(no jax there), and both sides draw identical prompts from the same seed.

A workload is a list of `Session`s. A session is a chain of `Turn`s; each turn holds the whole
conversation sent so far as (role, token ids) messages, so turn k re-sends turn k-1's messages plus the
previous assistant reply and a new user suffix. The assistant replies in the history are synthetic
(drawn here, `output_len` ids each), not what the server generated: the prompts, and so the cacheable
prefixes, do not depend on the server (AgentX replays recorded outputs the same way, spec §7.1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# Chat prompts turn ids into letters ('a' + id % 26): with a byte-level tokenizer each letter is one
# token, so the content has as many tokens as the ids (plus the chat template's own tokens).
_LETTERS = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", dtype=np.uint8)


@dataclass(frozen=True)
class Turn:
    """One request: the conversation so far as (role, ids) messages, and the forced output length."""

    messages: tuple[tuple[str, tuple[int, ...]], ...]
    output_len: int

    @property
    def prompt_ids(self) -> list[int]:
        """The completions prompt: every message's ids concatenated."""
        return [t for _, ids in self.messages for t in ids]

    @property
    def prompt_len(self) -> int:
        return sum(len(ids) for _, ids in self.messages)

    def chat_messages(self) -> list[dict[str, str]]:
        """The chat-completions messages: each message's ids as letters."""
        return [{"role": role, "content": ids_to_text(ids)} for role, ids in self.messages]


@dataclass(frozen=True)
class Session:
    """Turns that run one after another (turn k+1 is sent when turn k has finished)."""

    session_id: str
    turns: tuple[Turn, ...]


def ids_to_text(ids) -> str:
    return _LETTERS[np.asarray(ids, dtype=np.int64) % 26].tobytes().decode("ascii")


def _check_range(token_id_range: tuple[int, int]) -> None:
    low, high = token_id_range
    if not 0 <= low < high:
        raise ValueError(f"token_id_range must satisfy 0 <= low < high, got {low},{high}")


def _ids(rng: np.random.Generator, n: int, token_id_range: tuple[int, int]) -> tuple[int, ...]:
    return tuple(int(x) for x in rng.integers(token_id_range[0], token_id_range[1], size=n))


def length_bounds(length: int, range_ratio: float) -> tuple[int, int]:
    """[floor(L (1 - r)), ceil(L (1 + r))], vLLM's random-dataset length range."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must lie in [0, 1), got {range_ratio}")
    lo, hi = math.floor(length * (1 - range_ratio)), math.ceil(length * (1 + range_ratio))
    if lo < 1:
        raise ValueError(f"length {length} with range_ratio {range_ratio} allows lengths below 1")
    return lo, hi


def random_sessions(num_prompts: int, input_len: int, output_len: int, *, range_ratio: float = 0.0,
                    token_id_range: tuple[int, int] = (10, 8000), seed: int = 0) -> list[Session]:
    """`num_prompts` one-turn sessions of random ids; input and output lengths uniform in
    `length_bounds(L, range_ratio)` (exactly L when range_ratio is 0)."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    _check_range(token_id_range)
    in_lo, in_hi = length_bounds(input_len, range_ratio)
    out_lo, out_hi = length_bounds(output_len, range_ratio)
    rng = np.random.default_rng([seed, 0])
    in_lens = rng.integers(in_lo, in_hi + 1, size=num_prompts)
    out_lens = rng.integers(out_lo, out_hi + 1, size=num_prompts)
    return [Session(f"random-{i}", (Turn((("user", _ids(rng, int(n_in), token_id_range)),), int(n_out)),))
            for i, (n_in, n_out) in enumerate(zip(in_lens, out_lens))]


def prefix_repetition_sessions(num_prompts: int, num_prefixes: int, prefix_len: int, suffix_len: int,
                               output_len: int, *, turns: int = 1, token_id_range: tuple[int, int] = (10, 8000),
                               seed: int = 0) -> list[Session]:
    """`num_prompts` sessions; session i starts with shared prefix i % num_prefixes, then `turns` turns.

    Turn 1 is [user: prefix + suffix_1]; turn k > 1 appends [assistant: reply_{k-1}, user: suffix_k]
    (reply: `output_len` synthetic ids), so a session's prompts grow by output_len + suffix_len per turn.
    Sessions come in a seeded shuffled order (vLLM shuffles its prefix-repetition requests too)."""
    if num_prefixes < 1 or num_prompts < num_prefixes:
        raise ValueError(f"need 1 <= num_prefixes <= num_prompts, got num_prefixes {num_prefixes}, "
                         f"num_prompts {num_prompts}")
    if turns < 1:
        raise ValueError(f"turns must be >= 1, got {turns}")
    for name, v in (("prefix_len", prefix_len), ("suffix_len", suffix_len), ("output_len", output_len)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    _check_range(token_id_range)
    rng = np.random.default_rng([seed, 1])
    prefixes = [_ids(rng, prefix_len, token_id_range) for _ in range(num_prefixes)]
    sessions = []
    for i in range(num_prompts):
        messages = (("user", prefixes[i % num_prefixes] + _ids(rng, suffix_len, token_id_range)),)
        chain = [Turn(messages, output_len)]
        for _ in range(turns - 1):
            messages = messages + (("assistant", _ids(rng, output_len, token_id_range)),
                                   ("user", _ids(rng, suffix_len, token_id_range)))
            chain.append(Turn(messages, output_len))
        sessions.append(Session(f"prefix{i % num_prefixes}-session{i}", tuple(chain)))
    order = rng.permutation(num_prompts)
    return [sessions[j] for j in order]


def warmup_sessions(num: int, input_len: int, output_len: int, *, token_id_range: tuple[int, int] = (10, 8000),
                    seed: int = 0) -> list[Session]:
    """One-turn random sessions from their own seed stream, so warm-ups share no prefix with the workload."""
    _check_range(token_id_range)
    rng = np.random.default_rng([seed, 2])
    return [Session(f"warmup-{i}", (Turn((("user", _ids(rng, input_len, token_id_range)),), output_len),))
            for i in range(num)]
