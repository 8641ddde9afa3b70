"""Each request's drafts in a step that verifies them: the k_r in 0..k (k: the speculation policy's choice for the
step, `serving.engine.spec_policy`) that maximise the batch's expected output tokens per second, from each request's
own acceptance and the measured time of a step on the compiled shape its rows run on.

A request's j-th draft is emitted only if its drafts 1..j are all accepted, so the row's expected gain is that
prefix's probability a_j = q_1 ... q_j, where q_i is the probability that draft i is accepted given the drafts
before it were. For a greedy request q_i is the drafter's confidence head's output for that draft: the head is trained
on exactly that event (the draft is the target's argmax, the drafts before it given), and it ranks drafts where the
counts below cannot (docs/benchmarks/spec-decode.md). For a sampled request, whose drafts pass by min(1, p / q)
rather than by the argmax, q_i is its acceptance rate at position i: a running count per request (recent
verifications weigh more) shrunk toward the whole engine's rate at that position, so a new request starts at the
engine's and moves to its own as its text shows.

A verifying step's time, relative to a plain step's at the same concurrency (the policy's measure), depends on the
compiled shapes its rows run on: the segments pad a step's rows to a token bucket, so every row count in one bucket
costs the same, and a row that crosses into the next bucket costs that bucket's step. The allocator keeps the
measured time per (concurrency, shape) - the median of the last steps there, so a stalled step does not move it - and
chooses the number of draft rows n whose rate (c + G(n)) / t(shape of c + n rows) is highest among the measured
shapes, G(n) the sum of the n largest gains (each request's gains fall with position, so the n largest are prefixes
of each request's drafts). With c requests the step emits c + G(n) tokens. Until the shape that verifying k for all
runs on is measured at a concurrency, every request verifies k (the policy's trial of k measures it). A step keeps
at least one draft row: the policy chose to verify, and a step verifying none would measure nothing and leave no
drafts for the next.
"""

from __future__ import annotations

import itertools
import statistics
from collections import deque
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from serving.engine.spec_policy import concurrency_bucket, row_count_shape


def reached_drafts(num_draft: int, num_accepted: int, limit: int) -> Iterator[tuple[int, bool]]:
    """The draft positions (< `limit`) a verification of `num_draft` drafts that accepted the first `num_accepted`
    reached - every draft before them accepted - and whether each was accepted."""
    for i in range(min(num_accepted + 1, num_draft, limit)):
        yield i, i < num_accepted


@dataclass
class Acceptance:
    """Decayed counts, per draft position i, of verifications that reached i (drafts 0 .. i-1 accepted) and of those
    that accepted it."""

    reached: list[float]
    accepted: list[float]
    decay: float

    @classmethod
    def empty(cls, k: int, decay: float) -> Acceptance:
        return cls([0.0] * k, [0.0] * k, decay)

    def observe(self, num_draft: int, num_accepted: int) -> None:
        """A verification of `num_draft` drafts accepted the first `num_accepted`."""
        for i, accepted in reached_drafts(num_draft, num_accepted, len(self.reached)):
            self.reached[i] = self.decay * self.reached[i] + 1.0
            self.accepted[i] = self.decay * self.accepted[i] + float(accepted)


class RequestDrafts(NamedTuple):
    """What the allocator knows of one running request's next drafts."""

    acceptance: Acceptance
    available: int  # drafts it has for the step
    confidence: Sequence[float] | None = None  # the drafter's confidence in each (greedy requests); None: the counts


@dataclass
class DraftAllocator:
    """`max_k`: drafts per request at most. `step_shape`: the compiled shape a decode step of that many rows runs on
    (the engine's: its token and kept-row buckets; default: every row count its own). `prior`: how many
    verifications the engine's rate at a position counts for in a request's estimate. `request_decay` /
    `engine_decay`: the weight a verification keeps per newer one at its position. `window`: verifying steps kept per
    concurrency and shape; `min_steps`: steps a shape's time needs."""

    max_k: int
    step_shape: Callable[[int], Hashable] = row_count_shape
    prior: float = 2.0
    request_decay: float = 0.8
    engine_decay: float = 0.99
    window: int = 16
    min_steps: int = 3
    engine: Acceptance = field(init=False)
    _costs: dict[tuple[int, Hashable], deque[float]] = field(default_factory=dict)  # (concurrency, shape) -> relative

    def __post_init__(self):
        self.engine = Acceptance.empty(self.max_k, self.engine_decay)

    def new_request(self) -> Acceptance:
        return Acceptance.empty(self.max_k, self.request_decay)

    def observe(self, request: Acceptance, num_draft: int, num_accepted: int) -> None:
        """A request's verification: `num_accepted` of its `num_draft` drafts accepted."""
        request.observe(num_draft, num_accepted)
        self.engine.observe(num_draft, num_accepted)

    def record(self, running: int, draft_rows: int, relative: float) -> None:
        """A verifying decode step of `running` requests and `draft_rows` drafts took `relative` times a plain step."""
        if draft_rows > 0 and relative > 0:
            key = (concurrency_bucket(running), self.step_shape(running + draft_rows))
            self._costs.setdefault(key, deque(maxlen=self.window)).append(relative)

    def gains(self, request: Acceptance, confidence: Sequence[float] | None = None) -> list[float]:
        """The probability that each of the request's draft positions is accepted with all before it, from the
        drafter's `confidence` in each draft where given, else from the request's acceptance counts."""
        out, p = [], 1.0
        for i in range(self.max_k):
            if confidence is not None and i < len(confidence):
                p *= min(max(float(confidence[i]), 0.0), 1.0)
            else:
                rate = (self.engine.accepted[i] + 1.0) / (self.engine.reached[i] + 2.0)
                p *= (request.accepted[i] + self.prior * rate) / (request.reached[i] + self.prior)
            out.append(p)
        return out

    def cost(self, running: int, draft_rows: int) -> float | None:
        """A verifying step's time relative to a plain one with `draft_rows` drafts among `running` requests: the
        median measured on the shape those rows run on, at this concurrency (None: fewer than min_steps there)."""
        return self._measured(running).get(self.step_shape(running + draft_rows))

    def _measured(self, running: int) -> dict[Hashable, float]:
        b = concurrency_bucket(running)
        return {shape: statistics.median(times) for (at, shape), times in self._costs.items()
                if at == b and len(times) >= self.min_steps}

    def allocate(self, requests: Sequence[RequestDrafts], k: int, running: int) -> list[int]:
        """Each running request's drafts to verify, at most the step's `k`."""
        caps = [min(k, r.available) for r in requests]
        total = sum(caps)
        measured = self._measured(running)
        if not total or self.step_shape(running + total) not in measured:
            return caps
        rows = sorted(((g, i) for i, (r, cap) in enumerate(zip(requests, caps))
                       for g in self.gains(r.acceptance, r.confidence)[:cap]), key=lambda row: -row[0])
        gained = list(itertools.accumulate(g for g, _ in rows))
        rates = {n: (running + gained[n - 1]) / t for n in range(1, total + 1)
                 if (t := measured.get(self.step_shape(running + n))) is not None}
        best = max(rates, key=rates.get)
        out = [0] * len(requests)
        for _, i in rows[:best]:
            out[i] += 1
        return out
