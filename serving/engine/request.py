"""A request's host-side state, from arrival to finish, and the per-step deltas the engine reports."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import NamedTuple

from serving.engine.draft_allocation import Acceptance
from serving.runtime.encoder_replay import PrefixPlan
from serving.runtime.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"  # not admitted, or preempted (blocks freed; recomputes on resumption)
    RUNNING = "running"
    FINISHED = "finished"


class Finish(NamedTuple):
    """Why a request ends: reason "stop" (stop_reason: the stop token id or string; None for EOS), "length" or
    "abort"."""

    reason: str
    stop_reason: int | str | None

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the request (its text is cut there), if that is what ended it."""
        return self.stop_reason if isinstance(self.stop_reason, str) else None


class StopString(NamedTuple):
    """A stop string found in a step's text: the `index`-th of the step's new tokens completes `text`. The text
    handling finds it, the scheduler decides whether it ends the request (a finish by an earlier token comes
    first)."""

    index: int
    text: str


@dataclass(frozen=True)
class TokenLogprob:
    """One position's logprob: the chosen token's and the `k` most likely (id, logprob) pairs."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    eos_id: int | None = None
    priority: int = 0  # lower runs first under the priority policy (vLLM's convention)
    session_id: str | None = None  # X-Session-ID: recorded, and the DP router's key
    cache_salt: str | None = None  # prefix-cache namespace: only requests with the same salt share blocks
    arrival: float = field(default_factory=time.monotonic)
    # --- state, owned by the engine thread
    token_ids: list[int] = field(init=False)  # prompt + output; the runtime reads it in place
    status: Status = Status.WAITING
    num_computed: int = 0  # positions whose KV is in the cache (async scheduling: or in a dispatched step)
    num_pending: int = 0  # async scheduling: tokens after token_ids that a dispatched step samples, not read yet
    rank: int | None = None  # data-parallel rank (its slot and blocks are that rank's), set when queued
    slot: int | None = None
    plan: PrefixPlan | None = None
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (first admission)
    num_preemptions: int = 0
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or string that ended it
    first_token_time: float | None = None
    last_token_time: float | None = None
    admitted: bool = False
    draft_ids: list[int] = field(default_factory=list)  # speculative decoding: the next step's drafts
    draft_confidence: list[float] = field(default_factory=list)  # the drafter's confidence in each (read with them)
    acceptance: Acceptance | None = None  # adaptive speculative decoding: its drafts' acceptance so far

    def __post_init__(self):
        self.token_ids = list(self.prompt_ids)

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - len(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_ids):]

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def cache_key(self) -> bytes:
        return (self.cache_salt or "").encode()

    @property
    def keeps_all_rows(self) -> bool:
        """Prompt logprobs need every prompt row through the trimmed segment (and no prefix hit)."""
        return self.params.prompt_logprobs is not None


@dataclass
class RequestOutput:
    """What one step produced for one request (a delta; the final one has `finished` set)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    new_logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # once, when the prompt has been computed
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None  # the engine failed this request (not the client's fault)
