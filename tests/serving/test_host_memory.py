"""`serving.runtime.host_memory`: freed host memory stays in the process (no page faults when it is used again), and the
setting refuses to claim success once JAX's backends have started. Each case runs in a fresh interpreter."""

import subprocess
import sys

import pytest

_REUSE = """
import ctypes, ctypes.util, resource, sys, threading
from serving.runtime.host_memory import keep_freed_memory
why = keep_freed_memory() if sys.argv[1] == "keep" else "not asked"
libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
libc.malloc.restype = ctypes.c_void_p
def touch(n):  # what an XLA:CPU step does with its buffers: malloc, write, free
    p = libc.malloc(ctypes.c_size_t(n))
    ctypes.memset(p, 1, n)
    libc.free(ctypes.c_void_p(p))
def faults(n, out):  # the second use of a freed block
    touch(n)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    touch(n)
    out.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
main, other = [], []
faults(64 << 20, main)
thread = threading.Thread(target=faults, args=(48 << 20, other))  # a thread's arena (XLA's threads run the steps)
thread.start()
thread.join()
libc.fopen.restype = ctypes.c_void_p
fp = ctypes.c_void_p(libc.fopen(sys.argv[2].encode(), b"w"))
libc.malloc_info(0, fp)
libc.fclose(fp)
arenas = open(sys.argv[2]).read().count("<heap nr=")
print(why, main[0], other[0], arenas)
"""


def _run(code: str, *args: str) -> str:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=True).stdout


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc")
def test_freed_memory_is_used_again_without_page_faults(tmp_path):
    """In the main thread and in another one, which keeps an arena of its own: one arena for every thread made XLA's
    compile threads queue on its lock (a cold start's compiles slowed down, docs/design/measurements.md)."""
    why, main, thread, arenas = _run(_REUSE, "keep", str(tmp_path / "info.xml")).rsplit(" ", 3)
    assert why == "None" and int(main) < 1000 and int(thread) < 1000  # 64 MiB is 16,384 pages of 4 KiB
    assert int(arenas) >= 2, arenas
    _, main, thread, _ = _run(_REUSE, "default", str(tmp_path / "info.xml")).rsplit(" ", 3)
    # glibc's default: the block is mmapped, unmapped on free, faulted in again
    assert int(main) > 8000 and int(thread) > 4000


def test_too_late_once_jax_has_started():
    out = _run("import jax; jax.devices(); from serving.runtime.host_memory import keep_freed_memory; "
               "print(keep_freed_memory())")
    assert "backends had started" in out


def test_benchmarks_say_why_not_on_stderr():
    """What the benchmarks and the profiler call: nothing said when it holds, the reason on stderr when it cannot."""
    code = ("import sys; from serving.runtime.host_memory import keep_freed_memory_or_say\n"
            "if sys.argv[1] == 'late': import jax; jax.devices()\n"
            "keep_freed_memory_or_say('bare steps')")
    late = subprocess.run([sys.executable, "-c", code, "late"], capture_output=True, text=True, check=True)
    assert "bare steps: freed memory is returned" in late.stderr and "backends had started" in late.stderr
    if sys.platform.startswith("linux"):
        early = subprocess.run([sys.executable, "-c", code, "early"], capture_output=True, text=True, check=True)
        assert early.stderr == ""
