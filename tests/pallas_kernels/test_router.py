"""Router: Pallas (interpret) and XLA against the spec reference (ties included), the reference against the
model's Router, and the kernel lowered for CUDA at V4.1-Flash sizes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import lowering, router
from tests.pallas_kernels.util import assert_close, seeded_rng


def make_case(rng, T, E, D, ties: bool):
    x = rng.standard_normal((T, D)).astype(np.float32)
    w = (rng.standard_normal((E, D)) / np.sqrt(D)).astype(np.float32)
    bias = (0.1 * rng.standard_normal(E)).astype(np.float32)
    if ties:  # duplicated experts: equal scores and equal biases, so selection ties are exact
        w[1::3] = w[0::3][: len(w[1::3])]
        bias[1::3] = bias[0::3][: len(bias[1::3])]
    return jnp.asarray(x), jnp.asarray(w), jnp.asarray(bias)


@pytest.mark.parametrize("ties", [False, True])
def test_pallas_and_xla_match_reference(ties):
    rng, msg = seeded_rng()
    x, w, b = make_case(rng, T=19, E=48, D=96, ties=ties)  # T not a multiple of the token block, E = 3 tiles
    ids, wts = router.reference(x, w, b, top_k=6, scaling=1.5)
    for impl in ("xla", "pallas"):
        gi, gw = router.route(x, w, b, top_k=6, scaling=1.5, impl=impl)
        np.testing.assert_array_equal(np.asarray(gi), np.asarray(ids), err_msg=f"{msg} {impl}")
        assert_close(gw, wts, f"{msg} {impl}", rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(wts).sum(-1), 1.5, rtol=1e-5, err_msg=msg)


def test_reference_agrees_with_model_router():
    from dsv41.layers.moe import Router

    rng, msg = seeded_rng()
    x, w, b = make_case(rng, T=7, E=16, D=32, ties=False)
    m = Router(32, 16, 4, 2.5, hash_vocab=None, dtype=jnp.float32)
    m.weight[...] = w
    m.bias[...] = b
    mi, mw = m(x, jnp.zeros(7, jnp.int32))
    ids, wts = router.reference(x, w, b, top_k=4, scaling=2.5)
    np.testing.assert_array_equal(np.asarray(mi), np.asarray(ids), err_msg=msg)
    assert_close(wts, mw, msg)


def test_bad_shapes_named():
    x = jnp.zeros((4, 8))
    with pytest.raises(ValueError, match="bias_E"):
        router.route(x, jnp.zeros((16, 8)), jnp.zeros(15), top_k=2, scaling=1.0, impl="xla")


def test_lowers_for_cuda_at_v41_sizes():
    S = jax.ShapeDtypeStruct
    text = lowering.lower_for_cuda(router.pallas, S((64, 5120), jnp.bfloat16), S((384, 5120), jnp.bfloat16),
                                   S((384,), jnp.float32), top_k=6, scaling=1.5, interpret=False)
    assert lowering.count_gpu_kernels(text) == 1
