"""Shared pytest setup: CPU only, 8 virtual devices for sharding tests, the live-oracle option."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import pytest  # noqa: E402


def pytest_addoption(parser):
    parser.addoption("--oracle-python", default=None,
                     help="a Python with torch 2.13 + transformers 5.24: run the HF oracle live")


@pytest.fixture(scope="session")
def oracle_python(request):
    return request.config.getoption("--oracle-python")
