"""How many drafts each speculative step verifies: the k in 0..num_speculative_tokens expected to emit the most tokens
per second at the batch's concurrency, from what the running engine has measured.

What speculation earns depends on what a step of 1 + k rows per request costs against a plain step, on this machine,
at this batch size, and on how often the drafts are accepted - none of which is known before serving: on a 2-core
CPU verifying rows costs more than they earn (docs/benchmarks/spec-decode.md), while a lone request on a GPU is
bound by the weight reads that a verification shares. So the engine measures. Each "arm" k is a way to run steps:
k = 0 is the plain step (the sampler, async scheduling kept), k >= 1 verifies up to k drafts per request and drafts
the next block (one step at a time).

An arm's speed at a concurrency (running requests, to a power of two), relative to plain decoding's there = its
tokens per request per step / its step time relative to a plain step's:
  - relative step time: the median, over its last `window` decode steps at that concurrency, of each step's seconds
    over the median of the plain steps there before it (the last `window`). A step with a prefill chunk depends on
    where prompts arrived, not on k, and is not counted; medians, because single steps on a shared CPU stall now and
    then; and each step against the plain steps just before it, because a shared machine also runs for seconds at a
    time at half its speed, which would decide between arms measured at different times;
  - tokens per request per step: the mean over its last steps that verified drafts, at any concurrency (acceptance
    is the drafter's and the text's, not the batch's); 1 for plain steps. A first speculative step after plain ones
    verifies nothing (no request has drafts yet) and is not counted.
An arm holds for a block of `block_steps` steps. For each concurrency the policy plays plain first, then tries each
k >= 1 that might beat plain there by `margin` - its most tokens per step (measured, else 1 + k and what the other arms'
measured tokens bound) over its least relative step time (the largest measured of an arm j <= k at this or a lower
concurrency: fewer rows in a step cost less, and verification is relatively dearer with more rows per step; tried where
none is measured) - then plays the fastest: a k >= 1 only at `margin` times plain's speed (what its prefill steps cost,
one at a time, is not in it). A trial lasts only until it can be measured (`min_steps` + 1 steps: the first may verify
nothing), since many requests may pay for a losing one. Arms are only those a step's compiled shape tells apart
(`step_shape`, the engine's token and kept-row buckets of the step's rows): where k and k + 1 drafts per request run on
one shape, they cost the same and k + 1 emits at least as much, so k is never tried or played (with one request and an
8-row smallest bucket, only k = 5 of 1..5). It re-tries plain or a neighbour of the best (the next arm below or above:
nearest, cheapest to try, and where the best moves first), in turn, so a drafter that starts to be accepted (or stops)
moves the choice. A re-try waits `explore_every` blocks, doubled after each re-try that did not move the choice (up to
`max_wait`), and at least until what it loses against the best is `explore_budget` of the blocks since the last. The
loss is measured: a block of an arm at half the best's speed loses one block, and a re-try between plain and speculation
also pays the step into speculation (it verifies nothing, drafts, and ends async scheduling's overlap: on a 2-core CPU
most of what a re-try of k = 1 costs). Where speculation loses by far (a 2-core CPU, where a verifying step costs ~3
plain ones) the re-tries take ~1% of the time.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field


@dataclass
class _Concurrency:
    """One concurrency bucket's step times and its block in progress."""

    plain: deque[float]  # the last plain decode steps' seconds at this concurrency
    relative: list[deque[float]]  # per arm k >= 1: its last steps' seconds / the plain median at the time
    switch: deque[float] = field(default_factory=lambda: deque(maxlen=16))  # the same for steps into speculation
    flips: int = 0  # re-tries so far (they take plain and the neighbours in turn)
    since: int = 0  # blocks since the last trial or re-try
    backoff: int = 0  # blocks between re-tries at least, now
    retried: bool = False  # the block in progress is a re-try
    best_before: int = 0  # the best arm when the block in progress began
    tried: set[int] = field(default_factory=set)  # arms given a trial block here (a block may count too few steps
    # to measure: requests ending or arriving move steps to other concurrencies; re-tries measure them then)
    arm: int = 0  # the block in progress: its arm and steps left
    left: int = 0


def row_count_shape(rows: int) -> Hashable:
    """A step shape where every row count is its own (no compiled buckets)."""
    return rows


@dataclass
class SpeculationPolicy:
    """`max_k`: the drafts a step may verify (num_speculative_tokens). `adaptive` False: always `max_k`. `step_shape`:
    the compiled shape a decode step of that many rows runs on (default: every row count its own)."""

    max_k: int
    adaptive: bool = True
    step_shape: Callable[[int], Hashable] = row_count_shape
    block_steps: int = 8  # steps an arm holds
    explore_every: int = 16  # blocks before the first re-try (plain or a neighbour of the best arm, in turn)
    max_wait: int = 1024  # the most blocks a fruitless re-try doubles the wait to
    explore_budget: float = 0.01  # a re-try waits until its measured loss against the best is this share of the blocks
    margin: float = 1.25  # a k >= 1 plays only at this many times plain decoding's rate
    window: int = 16  # steps kept per arm and concurrency
    token_window: int = 64  # verifying steps kept per arm for its tokens per step
    min_steps: int = 4  # an arm's rate at a concurrency needs this many of its steps there
    _by_bucket: dict[int, _Concurrency] = field(default_factory=dict)
    _tokens: list[deque[float]] = field(default_factory=list)  # per arm k >= 1: tokens per request of its steps

    def __post_init__(self):
        self._tokens = [deque(maxlen=self.token_window) for _ in range(self.max_k + 1)]

    def choose(self, running: int) -> int:
        """The k of the next step of a batch of `running` requests."""
        if not self.adaptive or self.max_k == 0:
            return self.max_k
        b = concurrency_bucket(running)
        c = self._at(b)
        if c.left:
            c.left -= 1
            return c.arm
        best = self._best(b)
        if c.retried and best == c.best_before:  # the re-try did not move the choice: wait longer
            c.backoff = min(2 * c.backoff, self.max_wait)
        elif c.retried:
            c.backoff = self.explore_every
        c.retried = False
        arms = self.arms(running)
        trials = [k for k in arms if self._worth_a_trial(b, k)]
        steps = self.block_steps
        if trials:
            arm, c.backoff, c.since = trials[0], self.explore_every, 0
            c.tried.add(arm)
            if arm:
                steps = min(steps, self.min_steps + 1)
        else:
            arm, c.since = best, c.since + 1
            below, above = [k for k in arms if k < best], [k for k in arms if k > best]
            others = sorted({0, *below[-1:], *above[:1]} - {best})
            retry = others[c.flips % len(others)]
            if c.since >= c.backoff and c.since * self.explore_budget >= self._loss(b, best, retry):
                arm, c.flips, c.retried, c.since = retry, c.flips + 1, True, 0
        c.best_before, c.arm, c.left = best, arm, steps - 1
        return arm

    def arms(self, running: int) -> list[int]:
        """The ks a step of `running` requests tells apart: plain, and each k whose rows run on another compiled shape
        than k + 1's (max_k always)."""
        shape = self.step_shape
        return [0] + [k for k in range(1, self.max_k + 1)
                      if k == self.max_k or shape(running * (1 + k)) != shape(running * (2 + k))]

    def best(self, running: int) -> int:
        """The arm measured fastest at this concurrency, a k >= 1 only at `margin` times plain's speed or more."""
        return self._best(concurrency_bucket(running))

    def record(self, k: int, running: int, tokens: int, seconds: float, verified: bool = True) -> None:
        """A decode step of `running` requests verifying up to `k` drafts each emitted `tokens` in `seconds` (the time
        since the step before it was collected); `verified`: whether any of its requests had drafts to verify."""
        if not self.adaptive or seconds <= 0 or running <= 0:
            return
        c = self._at(concurrency_bucket(running))
        if not k:
            c.plain.append(seconds)
            return
        if not verified:  # a step into speculation: what moving between plain and speculation costs
            if (relative := self.relative(running, seconds)) is not None:
                c.switch.append(relative)
            return
        self._tokens[k].append(tokens / running)
        if (relative := self.relative(running, seconds)) is not None:
            c.relative[k].append(relative)

    def relative(self, running: int, seconds: float) -> float | None:
        """A step's `seconds` over the median of the last plain decode steps at this concurrency (None: fewer than
        min_steps of them)."""
        plain = self._at(concurrency_bucket(running)).plain
        return seconds / statistics.median(plain) if len(plain) >= self.min_steps else None

    def rates(self) -> dict[int, list[float | None]]:
        """Each concurrency bucket's output tokens per second per request, per arm k (None: not measured yet): plain's
        measured, the others' as their speed relative to it."""
        out = {}
        for b, c in sorted(self._by_bucket.items()):
            plain = 1 / statistics.median(c.plain) if len(c.plain) >= self.min_steps else None
            out[b] = [plain] + [None if plain is None or (x := self._speed(b, k)) is None else x * plain
                                for k in range(1, self.max_k + 1)]
        return out

    # ------------------------------------------------------------------ estimates
    def _tokens_per_step(self, k: int) -> float | None:
        t = self._tokens[k]
        return sum(t) / len(t) if len(t) >= self.min_steps else None

    def _step_ratio(self, b: int, k: int) -> float | None:
        """Arm k's step time over plain's at this concurrency (None: fewer than min_steps measured)."""
        r = self._at(b).relative[k]
        return statistics.median(r) if len(r) >= self.min_steps else None

    def _speed(self, b: int, k: int) -> float | None:
        """Arm k's tokens per second relative to plain decoding's at this concurrency."""
        tokens, ratio = self._tokens_per_step(k), self._step_ratio(b, k)
        return None if tokens is None or ratio is None else tokens / ratio

    def _best(self, b: int) -> int:
        speeds = {k: x for k in range(1, self.max_k + 1) if (x := self._speed(b, k)) is not None}
        k = max(speeds, key=speeds.get, default=0)
        return k if k and speeds[k] > self.margin else 0

    def _loss(self, b: int, best: int, arm: int) -> float:
        """What a block of `arm` loses against a block of `best`, in blocks, by their speeds here or, unmeasured here,
        their optimistic estimates (0 where there is none), plus, between plain and speculation, the step into
        speculation (it verifies nothing, drafts, and ends async scheduling's overlap) beyond a plain step's time."""
        speed = {k: self._estimate(b, k) for k in (best, arm)}
        if None in speed.values():
            return 0.0
        switch = self._at(b).switch
        into = max(statistics.median(switch) - 1, 0.0) if (best == 0) != (arm == 0) and switch else 0.0
        return max(speed[best] / speed[arm] - 1, 0.0) + into / self.block_steps

    def _estimate(self, b: int, k: int) -> float | None:
        """Arm k's speed relative to plain here: measured, or at most its most tokens per step over its least
        relative step time. That step time is at least any measured one of an arm j <= k at this concurrency or a
        lower one (fewer rows in a step at this concurrency cost less; verification is relatively dearer with more
        rows per step); None where none is measured."""
        if k == 0:
            return 1.0
        if (speed := self._speed(b, k)) is not None:
            return speed
        ratios = [r for lower in self._by_bucket if lower <= b for j in range(1, k + 1)
                  if (lower, j) != (b, k) and (r := self._step_ratio(lower, j)) is not None]
        return self._most_tokens(k) / max(ratios) if ratios else None

    def _most_tokens(self, k: int) -> float:
        """Arm k's tokens per request per step, measured, or at most 1 + k and what the measured arms bound: an arm
        j > k accepts at least as many of the same drafts, an arm j < k at most k - j fewer."""
        if (tokens := self._tokens_per_step(k)) is not None:
            return tokens
        return min([1.0 + k] + [t + max(k - j, 0) for j in range(1, self.max_k + 1)
                                if j != k and (t := self._tokens_per_step(j)) is not None])

    def _worth_a_trial(self, b: int, k: int) -> bool:
        """Whether arm k might beat plain by the margin here and is untried (plain: whether it is untried)."""
        c = self._at(b)
        if len(c.plain) < self.min_steps:
            return k == 0 and k not in c.tried
        if k == 0 or k in c.tried or self._step_ratio(b, k) is not None:
            return False
        estimate = self._estimate(b, k)
        return estimate is None or estimate > self.margin

    def _at(self, b: int) -> _Concurrency:
        if b not in self._by_bucket:
            self._by_bucket[b] = _Concurrency(deque(maxlen=self.window),
                                              [deque(maxlen=self.window) for _ in range(self.max_k + 1)])
        return self._by_bucket[b]


def concurrency_bucket(running: int) -> int:
    """Concurrency to the power of two at or above it (1, 2, 4, ...)."""
    return 1 << max(running - 1, 0).bit_length()
