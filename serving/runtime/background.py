"""When a background compile may start beside the serving loop (`StepCompiler.precompile(background=True)` on a CPU
backend, where a compile and the steps share the cores).

Beside a busy loop a compile costs the steps more than its core: c=8 waves on nano-austen ran at a third to a half of
their warm rate while the background compiled (docs/benchmarks/startup.md). Not compiling costs the steps that pad
up to a larger compiled bucket. The gate weighs the two as a ski rental: a program is compiled (bought) once the steps
that wanted it have lost, by their padding, the seconds it takes to compile; until then they pad (rent). Whatever the
future load, that loses at most twice what the better of the two choices would have. An engine idle for `idle_s`
loses nothing to a compile, so then the next program starts whatever it was asked for (the most wanted first); a
server counts as busy when it becomes ready, so clients that come at once find no compile running.

A padded step's loss for want of one segment program is its seconds, halved (two segments share a step), times the
padded fraction of that program's rows. That over-estimates a step whose time is the weights' read more than its
rows (docs/design/measurements.md, `serving/runtime/compiler.py`), so a compile comes early rather than late. A
step's seconds: from its plan to the next one's, while the engine stayed busy. The sampler's padding is not counted
(its rows cost microseconds against the segments' milliseconds); its programs compile when the engine idles. A
program's compile seconds are those measured for its family (the same `Program`) in this process, else any
program's, else `DEFAULT_COMPILE_S`.

One exception to renting: the segments' decode bucket of every slot (`decode_buckets`), which the server is ready
without (`StepCompiler.essential_keys`), is bought the first time a step of more requests than the few-row decode
bucket holds (`few_rows`) fits it and pads up past it: such a decode runs at a prefill-sized program's cost, step
after step while its requests decode, and renting would have it wait out its whole compile time in padding first
(measured: docs/benchmarks/startup.md). A step of fewer requests (a prompt's last small chunk beside a few decodes)
rents as before.
"""

from __future__ import annotations

import math
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from serving.runtime.programs import BucketKey, Program

DEFAULT_COMPILE_S = 5.0  # about a segment program of the built-in model on XLA:CPU (docs/design/measurements.md)
# longer than the gaps of a client sending request after request, or an agent's think time (the CPU-scale agentic
# workload's cap, serving/bench/agentic_workload.py): an idle engine's compile delays the next request by a compile
IDLE_S = 3.0
POLL_S = 0.05
SEGMENTS = (Program.SEGMENT1, Program.SEGMENT2)


@dataclass
class _Step:
    start: float
    padded: list[tuple[BucketKey, float]] = field(default_factory=list)  # (the program it wanted, padded fraction)


class BackgroundGate:
    """Chooses the next program the background thread compiles, and when (`wait_next`). The serving thread reports
    each program a step runs (`planned`: the size it wanted, the size it got); `busy` (set by the engine) says
    whether there is work."""

    def __init__(self, *, idle_s: float = IDLE_S, clock: Callable[[], float] = time.perf_counter,
                 decode_buckets: dict[Program, int] | None = None, few_rows: int = 0):
        """`decode_buckets`: per segment, the size of its decode bucket of every slot; `few_rows`: the requests the
        essential few-row decode bucket holds (a step of more that pads up past a decode bucket makes it urgent)."""
        self.idle_s, self.clock = idle_s, clock
        self.decode_buckets, self.few_rows = dict(decode_buckets or {}), few_rows
        self.busy: Callable[[], bool] = lambda: False
        self.loss_s: dict[BucketKey, float] = defaultdict(float)  # padding seconds lost for want of each program
        self.urgent: set[BucketKey] = set()  # decode buckets of every slot a step has padded up past
        self._compile_s: dict[Program, list[float]] = defaultdict(list)
        self._last_busy = -math.inf
        self._step: _Step | None = None  # the step planned last
        self._idle_seen = True  # the engine was seen idle since the last step was planned
        self._wake = threading.Event()
        self._lock = threading.Lock()  # the compile times: written by one thread, read by both

    # ------------------------------------------------------------ the serving thread
    def planned(self, program: Program, wanted: int, used: int, requests: int = 0) -> None:
        """A step of `requests` requests (on its busiest rank) runs `program` at size `used` (compiled) for `wanted`
        (its own bucket). Segment 1 opens a step."""
        if program is Program.SEGMENT1:
            now = self.clock()
            if self._step is not None and not self._idle_seen:
                self._close(self._step, now - self._step.start)
            self._step, self._last_busy, self._idle_seen = _Step(now), now, False
        if program in SEGMENTS and self._step is not None and used != wanted:
            self._step.padded.append((program.at(wanted), (used - wanted) / used))
            slots = self.decode_buckets.get(program)
            if requests > self.few_rows and slots is not None and wanted <= slots < used:
                self.urgent.add(program.at(slots))
                self._wake.set()

    def _close(self, step: _Step, seconds: float) -> None:
        for key, fraction in step.padded:
            self.loss_s[key] += seconds / len(SEGMENTS) * fraction
            if self.due(key):
                self._wake.set()

    # ------------------------------------------------------------ the compiling thread
    def start(self) -> None:
        """The background starts (the server is about to be ready): idle from now, not from launch, so clients that
        come at once find no compile running."""
        self._last_busy = self.clock()

    def compiled(self, key: BucketKey, seconds: float) -> None:
        with self._lock:
            self._compile_s[key.program].append(seconds)

    def cost(self, key: BucketKey) -> float:
        """The seconds `key` is expected to take to compile."""
        with self._lock:
            own = list(self._compile_s.get(key.program, ()))
            every = [s for family in self._compile_s.values() for s in family]
        pick = own or every
        return sum(pick) / len(pick) if pick else DEFAULT_COMPILE_S

    def due(self, key: BucketKey) -> bool:
        """Whether the steps' padding for want of `key` has cost its compile, or it is an urgent decode bucket."""
        return key in self.urgent or self.loss_s[key] >= self.cost(key)

    def idle(self) -> bool:
        if self.busy():
            self._last_busy = self.clock()
            return False
        self._idle_seen = True
        return self.clock() - self._last_busy >= self.idle_s

    def choose(self, pending: Sequence[BucketKey]) -> BucketKey | None:
        """The program to compile now, or None (wait): the one that has lost most where it lost its compile
        seconds, else, with the engine idle, the most wanted (ties: `pending`'s order)."""
        due = [k for k in pending if self.due(k)]
        if due:
            return max(due, key=lambda k: self.loss_s[k])
        if self.idle():
            return max(pending, key=lambda k: (self.loss_s[k], -pending.index(k)))
        return None

    def wait_next(self, pending: Sequence[BucketKey]) -> BucketKey:
        while (key := self.choose(pending)) is None:
            self._wake.wait(POLL_S)
            self._wake.clear()
        return key
