"""The kernel's cap on a process's memory maps, checked as programs are compiled.

XLA:CPU maps each compiled program's code in hundreds of pieces (counts: docs/design/measurements.md), so a
server's step programs hold tens of thousands of maps. Linux caps a process at `vm.max_map_count` (65,530
by default); past it LLVM's code allocation fails ("LLVM compilation error: Cannot allocate memory") and the
process segfaults - seen with a third such engine in one process. `MapLimitGuard.before_compile` raises a
clear error instead, while the next programs still fit.
"""

from __future__ import annotations

import threading
from pathlib import Path

MAPS = Path("/proc/self/maps")
LIMIT = Path("/proc/sys/vm/max_map_count")


def memory_maps() -> tuple[int, int] | None:
    """(maps this process holds, vm.max_map_count), or None where /proc does not say (not Linux)."""
    try:
        return MAPS.read_bytes().count(b"\n"), int(LIMIT.read_text())
    except (OSError, ValueError):
        return None


class MapLimitGuard:
    """Call `before_compile()` before each program is compiled or loaded (`GUARD`: one per process, as the limit
    is, so what earlier runners' programs took is known to the next). Reading tens of thousands of maps is not
    free (docs/design/measurements.md), so it reads again only when the programs compiled since could have used
    half the headroom at the largest per-program growth seen."""

    def __init__(self, reader=memory_maps):
        self._read, self._lock = reader, threading.Lock()
        self.per_program = 0  # the most maps a program added, measured between two readings
        self._last: int | None = None
        self._since = 0  # programs compiled since the last reading
        self._skip = 0  # readings to skip still

    def before_compile(self) -> None:
        with self._lock:
            self._check()

    def _check(self) -> None:
        self._since += 1
        if self._skip > 0:
            self._skip -= 1
            return
        got = self._read()
        if got is None:
            return
        count, limit = got
        if self._last is not None and self._since > 1:
            self.per_program = max(self.per_program, -(-(count - self._last) // (self._since - 1)))
        self._last, self._since = count, 1
        if self.per_program and count + 2 * self.per_program > limit:
            raise RuntimeError(
                f"this process holds {count:,} memory maps and a compiled program adds up to ~{self.per_program:,}; "
                f"the kernel allows vm.max_map_count = {limit:,}, past which XLA:CPU's code allocation fails and the "
                f"process crashes. Raise the limit (sudo sysctl -w vm.max_map_count=262144), compile fewer buckets "
                f"(--token-buckets, a smaller --max-num-batched-tokens) or run fewer engines in this process (in a "
                f"notebook: drop the engines you are done with, then jax.clear_caches(), which also frees programs "
                f"JAX keeps for functions nothing uses any more).")
        if self.per_program:
            self._skip = max(0, (limit - count) // (2 * self.per_program) - 1)


GUARD = MapLimitGuard()
