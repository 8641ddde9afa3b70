"""mHC post + delayed-pre collapse + RMSNorm: Pallas (interpret) and XLA against the reference, the
reference bit for bit against the model's hc_post / hc_collapse / rms_norm, and CUDA lowering at V4.1 sizes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import lowering, mhc
from tests.pallas_kernels.util import assert_close, seeded_rng


def make_case(rng, T, n, D, dtype):
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    comb = jax.nn.softmax(f(T, n, n), axis=-1)
    return (f(T, n, D).astype(dtype), f(T, D).astype(dtype), 2 * jax.nn.sigmoid(f(T, n)), comb,
            jax.nn.sigmoid(f(T, n)) + 1e-6, 1 + 0.1 * f(D))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_pallas_and_xla_match_reference(dtype):
    rng, msg = seeded_rng()
    args = make_case(rng, T=11, n=4, D=96, dtype=dtype)  # T not a multiple of the token block; D = 3 x 32
    want_R, want_x = mhc.reference(*args, eps=1e-6)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == jnp.float32 else dict(rtol=1e-2, atol=1e-2)
    for impl in ("xla", "pallas"):
        fn = (lambda *a, **k: mhc.pallas(*a, block_d=32, **k)) if impl == "pallas" else mhc.xla
        R, x = fn(*args, eps=1e-6)
        assert R.dtype == dtype and x.dtype == dtype
        assert_close(R, want_R, f"{msg} {impl} streams", **tol)
        assert_close(x, want_x, f"{msg} {impl} normed input", **tol)


def test_reference_agrees_with_model():
    from dsv41.layers.mhc import HcMix

    rng, msg = seeded_rng()
    for dtype in (jnp.float32, jnp.bfloat16):  # bit for bit: the model runs the fused op under "reference"
        R, y, post, comb, pre, w = make_case(rng, T=5, n=4, D=64, dtype=dtype)
        w = w.astype(dtype)
        got_R, got_x = jax.jit(lambda *a: mhc.reference(*a, eps=1e-6))(R, y, post, comb, pre, w)
        want_R, want_x = jax.jit(lambda R, y, post, comb, pre, w: _unfused(R, HcMix(pre, post, comb), y, pre, w))(
            R, y, post, comb, pre, w)
        np.testing.assert_array_equal(np.asarray(got_R, np.float32), np.asarray(want_R, np.float32), msg)
        np.testing.assert_array_equal(np.asarray(got_x, np.float32), np.asarray(want_x, np.float32), msg)


def _unfused(R, mix, y, pre, w):
    from dsv41.layers.basic import rms_norm
    from dsv41.layers.mhc import hc_collapse, hc_post

    R_new = hc_post(R, mix, y)
    return R_new, rms_norm(hc_collapse(R_new, pre), w, 1e-6)


def test_lowers_for_cuda_at_v41_sizes():
    S = jax.ShapeDtypeStruct
    T, n, D = 64, 4, 5120
    text = lowering.lower_for_cuda(mhc.pallas, S((T, n, D), jnp.bfloat16), S((T, D), jnp.bfloat16),
                                   S((T, n), jnp.float32), S((T, n, n), jnp.float32), S((T, n), jnp.float32),
                                   S((D,), jnp.bfloat16), eps=1e-20, interpret=False)
    assert lowering.count_gpu_kernels(text) == 1
