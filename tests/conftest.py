"""Shared pytest setup: CPU only, 8 virtual devices for sharding tests, the live-oracle option."""

import os

# XLA:CPU spends most of a compilation in LLVM's optimisation of the generated code, and the suite compiles
# hundreds of small programs it runs a few times each: it compiles them at LLVM -O0 (HLO passes unchanged, so
# the HLO checks still see the serving programs; tiny's runtime precompile measured 63 s -> 39 s, results
# within every test's tolerance and the bitwise ones still bitwise). Subprocesses get it through `xla_env`.
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count="


def caller_xla_flags(flags: str) -> str:
    """The flags of an inherited XLA_FLAGS that are not the suite's own. They follow the suite's flags in this
    process and every subprocess (a later flag wins), so `XLA_FLAGS=--xla_cpu_max_isa=AVX2 make test` runs the whole
    suite on XLA code for an AVX2 machine; a device count is dropped (each test sets the one it needs)."""
    ours = set(TEST_XLA_FLAGS.split())
    return " ".join(f for f in flags.split() if f not in ours and not f.startswith(DEVICE_COUNT_FLAG))


CALLER_XLA_FLAGS = caller_xla_flags(os.environ.get("XLA_FLAGS", ""))


def xla_env(devices: int = 8) -> dict[str, str]:
    """os.environ for a subprocess on `devices` virtual CPU devices with the suite's XLA flags, then the caller's."""
    flags = f"{DEVICE_COUNT_FLAG}{devices} {TEST_XLA_FLAGS} {CALLER_XLA_FLAGS}".strip()
    return {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags}


os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = xla_env()["XLA_FLAGS"]

import gc
import tempfile
from pathlib import Path

import jax
import pytest

from serving.runtime.map_limit import memory_maps
from serving.runtime.compiler import enable_compilation_cache

# Tests that build the same engine configuration in several processes (xdist workers, server subprocesses,
# reruns) load compiled buckets from disk instead of recompiling them.
XLA_CACHE = Path(tempfile.gettempdir()) / "dsv41-jax-tests-xla"
# Subprocess and readiness limits are hang guards, not latency bounds: a loaded 2-core machine takes several times
# an idle one (the equivalence worker passed 900 s there), so they are an hour.
HANG_TIMEOUT_S = 3600
enable_compilation_cache(str(XLA_CACHE))
# Tracing a model allocates millions of short-lived objects, and the default thresholds (700, 10, 10) run the
# cycle collector every 700 of them: tiny's runtime precompile measured tracing 3.3 -> 2.5 s and lowering
# 1.6 -> 1.3 s with these (7 alternated runs each). Cycles are still collected, less often.
gc.set_threshold(20_000, 20, 20)


def pytest_addoption(parser):
    parser.addoption("--oracle-python", default=None,
                     help="a Python with torch 2.13 + transformers 5.24: run the HF oracle live")
    parser.addoption("--kernel-seed", type=int, default=None,
                     help="seed of the kernel tests' random inputs (default 0; failures name the seed they ran)")
    parser.addoption("--server-processes", type=int, default=1,
                     help="the agent-client tests' server as this many processes (serving.launch, tensor parallel "
                          "over one CPU device each) instead of one")
    parser.addoption("--full-size-lowering", action="store_true",
                     help="also lower v41-flash's serving steps on an abstract mesh and compile tiny's on a CPU "
                          "device (minutes; nothing allocated)")


def pytest_configure(config):
    from tests.pallas_kernels.util import DEFAULT_SEED, set_seed

    seed = config.getoption("--kernel-seed")
    set_seed(DEFAULT_SEED if seed is None else seed)


def pytest_report_header(config):
    from tests.pallas_kernels import util

    return f"kernel tests seed: {util._seed}"


def release_compiled_programs(fraction: float = 0.25, reader=memory_maps) -> bool:
    """Drop JAX's in-memory caches of compiled programs when this process holds over `fraction` of the kernel's
    memory maps; True when it did. XLA:CPU maps each program's code in hundreds of pieces and JAX's caches keep
    programs of functions no test still holds: an xdist worker that ran ~half the suite reached 64,401 of 65,530
    maps, where the runtime's guard (serving/runtime/map_limit.py) stops compiling rather than let the process
    crash. Clearing gave a toy run's 1,921 maps back down to 493; later files compile again what they use (the
    persistent cache serves the larger programs)."""
    got = reader()
    if got is None or got[0] <= got[1] * fraction:
        return False
    jax.clear_caches()
    gc.collect()
    return True


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After a test file's last test (its fixtures torn down): `release_compiled_programs`."""
    yield
    if nextitem is None or getattr(nextitem, "module", None) is not getattr(item, "module", None):
        release_compiled_programs()


@pytest.fixture(scope="session")
def oracle_python(request):
    return request.config.getoption("--oracle-python")
