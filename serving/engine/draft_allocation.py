"""Each request's drafts in a step that verifies them: the k_r in 0..k (k: the speculation policy's choice for the
step, `serving.engine.spec_policy`) that maximise the batch's expected output tokens per second, from each request's
own acceptance and the measured cost of a verified row.

A request's j-th draft is emitted only if its drafts 1..j are all accepted, so the row's expected gain is that
prefix's probability a_j = q_1 ... q_j, where q_i is the request's acceptance rate at position i given the drafts
before it were accepted: a running count per request (recent verifications weigh more) shrunk toward the whole
engine's rate at that position, so a new request starts at the engine's and moves to its own as its text shows.
Acceptance differs by request more than by step: a request repeating its context accepts nearly every draft,
free prose few.

A verifying step's time, relative to a plain step's at the same concurrency (the policy's measure), grows with its
draft rows n: t(n) = A + m n, fitted over the last verifying steps at that concurrency (Theil-Sen: the median of
the pairwise slopes, so a stalled step does not move it). With c requests the step emits c + G tokens, G the sum of
the chosen rows' gains; with a linear cost the best set of n rows is always the n largest gains, and adding the
next one raises the rate (c + G) / (A + m n) exactly when its gain exceeds m times the rate so far. Until the fit
exists at a concurrency (steps of at least two different row counts: the policy's trials of different k give them)
every request verifies k. A step keeps at least one draft row: the policy chose to verify, and a step verifying
none would measure nothing and leave no drafts for the next.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

from serving.engine.spec_policy import concurrency_bucket


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
        for i in range(min(num_accepted + 1, num_draft, len(self.reached))):
            self.reached[i] = self.decay * self.reached[i] + 1.0
            self.accepted[i] = self.decay * self.accepted[i] + float(i < num_accepted)


@dataclass
class DraftAllocator:
    """`max_k`: drafts per request at most. `prior`: how many verifications the engine's rate at a position counts
    for in a request's estimate. `request_decay` / `engine_decay`: the weight a verification keeps per newer one at
    its position. `window`: verifying steps kept per concurrency for the cost fit."""

    max_k: int
    prior: float = 2.0
    request_decay: float = 0.8
    engine_decay: float = 0.99
    window: int = 32
    engine: Acceptance = field(init=False)
    _costs: dict[int, deque[tuple[int, float]]] = field(default_factory=dict)  # concurrency -> (draft rows, relative)

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
            points = self._costs.setdefault(concurrency_bucket(running), deque(maxlen=self.window))
            points.append((draft_rows, relative))

    def gains(self, request: Acceptance) -> list[float]:
        """The probability that each of the request's draft positions is accepted with all before it."""
        out, p = [], 1.0
        for i in range(self.max_k):
            rate = (self.engine.accepted[i] + 1.0) / (self.engine.reached[i] + 2.0)
            p *= (request.accepted[i] + self.prior * rate) / (request.reached[i] + self.prior)
            out.append(p)
        return out

    def cost(self, running: int) -> tuple[float, float] | None:
        """(A, m): a verifying step's time relative to a plain one, A + m per draft row, at this concurrency (None
        until steps of two row counts are measured there)."""
        points = self._costs.get(concurrency_bucket(running), ())
        slopes = [(r2 - r1) / (n2 - n1) for i, (n1, r1) in enumerate(points) for n2, r2 in list(points)[i + 1:]
                  if n2 != n1]
        if not slopes:
            return None
        m = max(statistics.median(slopes), 0.0)
        return max(statistics.median(r - m * n for n, r in points), 1e-3), m

    def allocate(self, requests: list[tuple[Acceptance, int]], k: int, running: int) -> list[int]:
        """Each request's drafts to verify, from (its acceptance, the drafts it has) and the step's most `k`."""
        caps = [min(k, n) for _, n in requests]
        fit = self.cost(running)
        if fit is None or fit[1] == 0.0 or not any(caps):
            return caps
        A, m = fit
        rows = sorted(((g, r) for r, ((acc, _), cap) in enumerate(zip(requests, caps))
                       for g in self.gains(acc)[:cap]), key=lambda row: -row[0])
        out, tokens, n = [0] * len(requests), float(running), 0
        for g, r in rows:
            if n and g <= m * tokens / (A + m * n):
                break  # the gains only fall from here: no later row pays for itself either
            out[r], tokens, n = out[r] + 1, tokens + g, n + 1
        return out
