"""How many drafts each speculative step verifies: the k in 0..num_speculative_tokens that has emitted the most tokens
per second at the batch's concurrency, measured on the running engine.

What speculation earns depends on what a step of 1 + k rows per request costs against a plain step, on this machine,
at this batch size, and on how often the drafts are accepted - none of which is known before serving: on a 2-core
CPU verifying rows costs nearly what they earn (docs/benchmarks/spec-decode.md), while a lone request on a GPU is
bound by the weight reads that a verification shares. So the engine measures. Each "arm" k is a way to run steps:
k = 0 is the plain step (the sampler, async scheduling kept), k >= 1 verifies up to k drafts per request and drafts
the next block (one step at a time). An arm holds for a block of `block_steps` steps, measured together: its decode
steps (a step with a prefill chunk would make the block's rate depend on where the prompts arrived, not on k),
the switch into it included (a first speculative step verifies nothing: no request has drafts yet; a first plain
step after speculative ones is not overlapped with the one before), as output tokens per second per request (a
concurrency bucket spans up to twice as many requests from one block to another). For each concurrency (running
requests, to a power of two) the policy tries every arm for one block, plain first, then plays the best - a k >= 1
only when it beats plain by `margin` (what its prefill steps cost, one at a time, is not in its rate) - and re-tries
plain or a neighbour of the best (k - 1 or k + 1: nearest, cheapest to try, and where the best moves first), in
turn, so a drafter that starts to be accepted (or stops) moves the choice. A re-try that does not move the choice
doubles the wait before the next (from `explore_every` blocks): where speculation loses by far (a 2-core CPU, where
a verifying step costs ~3 plain ones) the re-tries fade to a small fraction of the steps. Each arm's rate is an
exponential average of its blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class _Concurrency:
    """One concurrency bucket's measurements and its block in progress."""

    rates: list[float | None]  # per arm k: output tokens per second per request, averaged over blocks (None: untried)
    flips: int = 0  # re-tries so far (they take plain and the neighbours in turn)
    wait: int = 0  # blocks until the next re-try
    backoff: int = 0  # blocks between re-tries now
    retried: bool = False  # the block in progress is a re-try
    arm: int = 0  # the block in progress: its arm, steps left, tokens per request and seconds so far
    left: int = 0
    tokens: float = 0.0
    seconds: float = 0.0


@dataclass
class SpeculationPolicy:
    """`max_k`: the drafts a step may verify (num_speculative_tokens). `adaptive` False: always `max_k`."""

    max_k: int
    adaptive: bool = True
    block_steps: int = 8  # steps an arm holds, measured together
    explore_every: int = 16  # blocks before the first re-try (plain or a neighbour of the best arm, in turn)
    max_wait: int = 1024  # the most blocks between two re-tries
    margin: float = 1.25  # a k >= 1 plays only at this many times plain decoding's rate
    smoothing: float = 0.5  # weight of a new block's rate in its arm's average
    _by_bucket: dict[int, _Concurrency] = field(default_factory=dict)

    def choose(self, running: int) -> int:
        """The k of the next step of a batch of `running` requests."""
        if not self.adaptive or self.max_k == 0:
            return self.max_k
        c = self._at(running)
        if c.left:
            c.left -= 1
            return c.arm
        before = self.best(running) if c.retried else None
        self._close(c)
        if c.retried and self.best(running) == before:  # the re-try did not move the choice: wait longer
            c.backoff = min(2 * c.backoff, self.max_wait)
        elif c.retried:
            c.backoff = self.explore_every
        c.retried = False
        untried = [k for k, r in enumerate(c.rates) if r is None]
        if untried:
            arm = untried[0]
            c.backoff = c.wait = self.explore_every
        else:
            arm = self.best(running)
            c.wait -= 1
            if c.wait <= 0:
                others = sorted({k for k in (0, arm - 1, arm + 1) if 0 <= k <= self.max_k and k != arm})
                arm, c.flips, c.retried, c.wait = others[c.flips % len(others)], c.flips + 1, True, c.backoff
        c.arm, c.left, c.tokens, c.seconds = arm, self.block_steps - 1, 0.0, 0.0
        return arm

    def best(self, running: int) -> int:
        """The arm with the highest measured rate at this concurrency, a k >= 1 only `margin` above plain (0 while any
        is unmeasured)."""
        rates = self._at(running).rates
        if None in rates:
            return 0
        k = max(range(1, len(rates)), key=lambda k: rates[k])
        return k if rates[k] > self.margin * rates[0] else 0

    def record(self, k: int, running: int, tokens: int, seconds: float) -> None:
        """A step of `running` requests verifying up to `k` drafts each emitted `tokens` in `seconds` (the time since
        the step before it was collected); counted in the block in progress at that concurrency if it is k's."""
        if not self.adaptive or seconds <= 0 or running <= 0:
            return
        c = self._at(running)
        if c.arm == k:
            c.tokens += tokens / running
            c.seconds += seconds

    def rates(self) -> dict[int, list[float | None]]:
        """Each concurrency bucket's measured output tokens per second per request, per arm k (None: not yet)."""
        return {b: list(c.rates) for b, c in sorted(self._by_bucket.items())}

    def _close(self, c: _Concurrency) -> None:
        """The block that ended goes into its arm's average (a block that saw no counted step does not)."""
        if c.seconds <= 0:
            return
        old, rate = c.rates[c.arm], c.tokens / c.seconds
        c.rates[c.arm] = rate if old is None else (1 - self.smoothing) * old + self.smoothing * rate
        c.tokens = c.seconds = 0.0

    def _at(self, running: int) -> _Concurrency:
        b = _bucket(running)
        if b not in self._by_bucket:
            self._by_bucket[b] = _Concurrency([None] * (self.max_k + 1))
        return self._by_bucket[b]


def _bucket(running: int) -> int:
    """Concurrency to the power of two at or above it (1, 2, 4, ...)."""
    return 1 << max(running - 1, 0).bit_length()
