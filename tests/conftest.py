"""Shared pytest setup: CPU only, 8 virtual devices for sharding tests, the live-oracle option."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from serving.runtime.runner import enable_compilation_cache  # noqa: E402

# Tests that build the same engine configuration in several processes (xdist workers, server subprocesses,
# reruns) load compiled buckets from disk instead of recompiling them.
XLA_CACHE = Path(tempfile.gettempdir()) / "dsv41-jax-tests-xla"
# Subprocess and readiness limits are hang guards, not latency bounds: a loaded 2-core machine takes several times
# an idle one (the equivalence worker passed 900 s there), so they are an hour.
HANG_TIMEOUT_S = 3600
enable_compilation_cache(str(XLA_CACHE))


def pytest_addoption(parser):
    parser.addoption("--oracle-python", default=None,
                     help="a Python with torch 2.13 + transformers 5.24: run the HF oracle live")
    parser.addoption("--kernel-seed", type=int, default=None,
                     help="seed of the kernel tests' random inputs (default 0; failures name the seed they ran)")


def pytest_configure(config):
    from tests.pallas_kernels.util import DEFAULT_SEED, set_seed

    seed = config.getoption("--kernel-seed")
    set_seed(DEFAULT_SEED if seed is None else seed)


def pytest_report_header(config):
    from tests.pallas_kernels import util

    return f"kernel tests seed: {util._seed}"


@pytest.fixture(scope="session")
def oracle_python(request):
    return request.config.getoption("--oracle-python")
