"""What a step takes from the host and hands back, typed: the planned host inputs of a step (`HostStep`, what the engine
on several processes sends to the other ranks), the handle of a launched step (its device outputs, not read yet) and the host
outputs `Runner.collect` reads from it. A plain step emits one token per request (`StepOutput`); a speculative one
emits 1 .. 1 + k (`SpeculativeStepOutput`). Both answer `emitted(i)` and `emitted_logprobs(i)` with one row per
emitted token, so the engine reads either the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import jax
import numpy as np

from serving.runtime.batch import SeqChunk
from serving.runtime.builder import BuiltStep
from serving.runtime.sampler import Sampled, SamplingArrays
from serving.runtime.spec_step import SpecInputs, SpecOutput
from serving.runtime.step import KeptRows


class SampleInputs(NamedTuple):
    """A plain step's sampler inputs: per logits row [ranks x max_num_seqs], and the sampler bucket it runs at."""

    params: SamplingArrays
    rows: int


class SpecHostInputs(NamedTuple):
    """A speculative step's finish inputs: the requests' rows [R] and their sampling parameters [R]."""

    spec: SpecInputs
    params: SamplingArrays


class HostStep(NamedTuple):
    """Everything a step's programs take from the host (numpy only, so it pickles): the packed batch and the
    finish's inputs. `Runner.plan` makes it, `Runner.execute` dispatches it on the devices."""

    built: BuiltStep
    finish: SampleInputs | SpecHostInputs


class SegmentsOnDevice(NamedTuple):
    """Both segments of one step, on the devices (nothing read back yet)."""

    kept: KeptRows  # segment 2's host rows (rank-stacked)
    logits: jax.Array  # [ranks x max_num_seqs, V] (speculative: each request's verified row 0)
    verify_logits: jax.Array | None  # speculative: its verified rows 1 .. J - 1 [max_num_seqs, J - 1, V]
    prompt_logprobs: tuple  # segment 2's per-row logprobs (read where a chunk asks)
    expert_counts: tuple  # the two segments' [L, E] counts (None when off)
    rows: np.ndarray  # each chunk's logits row
    where: list[tuple[int, int]]  # each chunk's (rank, index in the rank)


class LaunchedStep(NamedTuple):
    """A step dispatched by `Runner.launch` whose outputs `Runner.collect` has not read yet."""

    chunks: list[SeqChunk]
    segments: SegmentsOnDevice
    sampled: Sampled | SpecOutput  # the sampler's (plain) or the speculative finish's device outputs


class PromptLogprobs(NamedTuple):
    """Per computed row of a chunk: log-probability of the next token [q] and the top ones [q, MAX_LOGPROBS]."""

    logprob: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray


class TokenRows(NamedTuple):
    """One request's emitted tokens' logprobs: [m], and the top ones' ids and logprobs [m, MAX_LOGPROBS]."""

    logprob: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray


@dataclass(frozen=True)
class StepOutput:
    """A plain step, per request (rows past the chunk count are dropped)."""

    tokens: np.ndarray  # [n] sampled ids (meaningless where the chunk does not sample)
    logprobs: np.ndarray  # [n]
    top_ids: np.ndarray  # [n, MAX_LOGPROBS]
    top_logprobs: np.ndarray  # [n, MAX_LOGPROBS]
    prompt_logprobs: dict[int, PromptLogprobs] = field(default_factory=dict)  # chunk index -> its rows', if asked
    expert_counts: np.ndarray | None = None  # [L, E] int32 routed choices of the step's valid rows per MoE layer

    def emitted(self, i: int) -> np.ndarray:
        """Request i's new tokens [1]."""
        return self.tokens[i:i + 1]

    def emitted_logprobs(self, i: int) -> TokenRows:
        return TokenRows(self.logprobs[i:i + 1], self.top_ids[i:i + 1], self.top_logprobs[i:i + 1])


@dataclass(frozen=True)
class SpeculativeStepOutput:
    """A speculative step, per request: each emitted its first `num_emitted` of J rows (accepted drafts, then the
    bonus token), and drafted the next block."""

    tokens: np.ndarray  # [n, J]
    logprobs: np.ndarray  # [n, J]
    top_ids: np.ndarray  # [n, J, MAX_LOGPROBS]
    top_logprobs: np.ndarray  # [n, J, MAX_LOGPROBS]
    num_emitted: np.ndarray  # [n]
    drafts: np.ndarray  # [n, B] the next block's drafts
    draft_confidence: np.ndarray  # [n, B] the drafter's confidence in each
    prompt_logprobs: dict[int, PromptLogprobs] = field(default_factory=dict)  # never asked (refused at launch)
    expert_counts: np.ndarray | None = None

    def emitted(self, i: int) -> np.ndarray:
        """Request i's new tokens [1 .. J]."""
        return self.tokens[i, :self.num_emitted[i]]

    def emitted_logprobs(self, i: int) -> TokenRows:
        n = self.num_emitted[i]
        return TokenRows(self.logprobs[i, :n], self.top_ids[i, :n], self.top_logprobs[i, :n])
