"""The suite's XLA flags (tests/conftest.py): its own first, then whatever the caller's XLA_FLAGS add."""

import os

import jax

from tests.conftest import CALLER_XLA_FLAGS, TEST_XLA_FLAGS, caller_xla_flags, xla_env


def test_a_callers_flags_are_kept_and_the_suites_own_dropped():
    inherited = f"--xla_force_host_platform_device_count=2 {TEST_XLA_FLAGS} --xla_cpu_max_isa=AVX2 --xla_dump_to=d"
    assert caller_xla_flags(inherited) == "--xla_cpu_max_isa=AVX2 --xla_dump_to=d"
    assert caller_xla_flags("") == ""
    assert caller_xla_flags("--xla_backend_optimization_level=2") == "--xla_backend_optimization_level=2"


def test_this_process_and_subprocesses_get_the_suites_flags_then_the_callers():
    assert jax.device_count() == 8
    here = os.environ["XLA_FLAGS"]
    assert here.startswith(f"--xla_force_host_platform_device_count=8 {TEST_XLA_FLAGS}")
    assert here.endswith(CALLER_XLA_FLAGS)
    sub = xla_env(4)["XLA_FLAGS"].split()
    assert sub[0] == "--xla_force_host_platform_device_count=4"
    assert [f for f in sub if f.startswith("--xla_force_host_platform_device_count=")] == [sub[0]]
    assert TEST_XLA_FLAGS in sub
