"""The impl switch: auto resolves by backend, unknown names are refused."""

import jax
import pytest

from pallas_kernels import resolve_impl


def test_auto_resolves_by_backend():
    want = "pallas" if jax.default_backend() == "gpu" else "xla"
    assert resolve_impl("auto") == want
    for impl in ("reference", "xla", "pallas"):
        assert resolve_impl(impl) == impl


def test_unknown_impl_refused():
    with pytest.raises(ValueError, match="impl must be one of"):
        resolve_impl("triton")
