"""Host memory of an XLA:CPU process: what a step frees stays in the process for the next step.

XLA:CPU mallocs each step's buffers and frees them after it. glibc hands large blocks back to the kernel (mmap
above a threshold, trimming of the heap top, per-thread arenas), so the next step faults every page in again, 4 KiB
at a time, zeroed by the kernel: a [4096, 256] x [256, 4096] float32-out product faults its 64 MiB output in on
each call, and both that product and a peer checkpoint's prefill step run faster with the memory kept
(docs/design/measurements.md). No mmap and no trimming keep it, as the caching allocators of GPU frameworks do:
the process holds its peak host memory.

Each thread keeps its own arenas (glibc's default count). One arena for the process would also keep the rare
block larger than a thread arena's 64 MiB heap, which glibc maps and unmaps whatever M_MMAP_MAX says, but XLA's
compile threads then queue on its lock, and a cold start compiles much longer (docs/design/measurements.md).

It is set before JAX starts its CPU backend, where it was measured to help: set after, when it still limited the
arenas, it left the prefill step unchanged (the backend's threads kept the arenas they had). The two settings kept
now are read at each malloc and free; a later setting was not measured again.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

# glibc <malloc.h>
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4


def keep_freed_memory() -> str | None:
    """Set glibc malloc to keep freed memory (no mmap, no trim): None when done, else why not."""
    if "jax" in sys.modules:
        from jax._src import xla_bridge

        if getattr(xla_bridge, "backends_are_initialized", lambda: True)():  # private API: unknown counts as started
            return "JAX's backends had started (set it before anything creates an array)"
    if not sys.platform.startswith("linux"):
        return f"not glibc malloc ({sys.platform})"
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # glibc only: musl's mallopt accepts and ignores these
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return "not glibc malloc"
    for param, value in ((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, -1)):  # -1: never trim (mallopt(3))
        if mallopt(param, value) != 1:
            return f"mallopt({param}, {value}) failed"
    return None


def keep_freed_memory_or_say(what: str = "host memory") -> None:
    """`keep_freed_memory()` for a benchmark or the profiler, as the server's `--keep-host-memory` does (call it
    before JAX starts), saying on stderr why not when it cannot."""
    if why := keep_freed_memory():
        print(f"{what}: freed memory is returned to the OS after each step ({why})", file=sys.stderr)
