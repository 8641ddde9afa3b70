"""The model's router through pallas_kernels: switching the implementation changes the logits of the
tiny model by no more than float32 rounding."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

import dsv41
from dsv41.layers.moe import Router, set_kernel_impl
from dsv41.model import forward
from tests.pallas_kernels.util import fresh_rng


@pytest.fixture(scope="module")
def tiny():
    return dsv41.random_model("tiny", seed=3)


def _logits(model, ids, impl):
    set_kernel_impl(model.module, impl)
    graphdef, state = nnx.split(model.module)
    hashes = model.engram_hashes(ids)
    fn = jax.jit(lambda s, i, h: forward(nnx.merge(graphdef, s), i, h, fake_quant=False))
    return np.asarray(fn(state, ids, None if hashes is None else jax.numpy.asarray(hashes)))


def test_logits_agree_across_router_impls(tiny):
    rng, msg = fresh_rng()
    ids = rng.integers(3, 500, 13).astype(np.int32)
    ref = _logits(tiny, ids, "reference")
    for impl in ("xla", "pallas"):
        got = _logits(tiny, ids, impl)
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4, err_msg=f"{msg} {impl}")
    set_kernel_impl(tiny.module, "auto")
    assert all(m.kernel_impl == "auto" for _, m in nnx.iter_modules(tiny.module) if isinstance(m, Router))


def test_unknown_impl_refused(tiny):
    with pytest.raises(ValueError, match="impl must be one of"):
        set_kernel_impl(tiny.module, "cuda")
