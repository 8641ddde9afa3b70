"""The FP8 linear (`pallas_kernels.fp8_linear`): the Pallas kernel (interpreted) and the XLA path against the
reference for V4.1 (32 x 32) and V4 (128 x 128) blocks, the fallback for partial blocks, the model's Linear
through it, and the Triton kernel lowered for CUDA at V4.1-Flash sizes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41 import quant
from dsv41.layers.basic import Linear, with_kernels
from pallas_kernels import fp8_linear, lowering
from pallas_kernels.kernel_config import KernelConfig
from tests.pallas_kernels.util import seeded_rng


def _weight(rng, O, I, block):
    q, s = quant.quantize_fp8_blocks(rng.standard_normal((O, I)).astype(np.float32) / np.sqrt(I), block)
    return jnp.asarray(q), jnp.asarray(s)


@pytest.mark.parametrize("T, O, I, block, dtype", [
    (5, 64, 128, (32, 32), jnp.float32), (17, 96, 64, (32, 32), jnp.float32),
    (20, 128, 256, (128, 128), jnp.bfloat16), (1, 256, 512, (32, 32), jnp.bfloat16)])
def test_pallas_and_xla_match_the_reference(T, O, I, block, dtype):
    rng, seed = seeded_rng()
    w, s = _weight(rng, O, I, block)
    x = jnp.asarray(rng.standard_normal((T, I)), dtype)
    kw = dict(block=block, dtype=dtype, out_dtype=jnp.float32)
    want = fp8_linear.reference(x, w, s, **kw)  # also the xla path
    dequant = quant.dequantize_fp8_blocks(np.asarray(w), np.asarray(s), block)  # NumPy's decode, independent
    oracle = np.asarray(x, np.float64) @ dequant.astype(np.float64).T
    tol = 1e-5 if dtype == jnp.float32 else 2e-2  # bf16 rounding / accumulation order of the input chunks
    np.testing.assert_allclose(want, oracle, rtol=0, atol=tol * float(np.abs(oracle).max()), err_msg=seed)
    got = fp8_linear.pallas(x, w, s, **kw, interpret=True)
    np.testing.assert_allclose(got, want, rtol=0, atol=tol * float(jnp.abs(want).max()), err_msg=seed)


def test_partial_blocks_take_the_xla_path():
    rng, _ = seeded_rng()
    w, s = _weight(rng, 40, 48, (32, 32))  # 40 rows: no power-of-two tile of whole blocks
    x = jnp.asarray(rng.standard_normal((3, 48)), jnp.float32)
    assert fp8_linear.tiles_for(40, 48, (32, 32)) is None
    got = fp8_linear.fp8_linear(x, w, s, block=(32, 32), dtype=jnp.float32, impl="pallas")
    np.testing.assert_array_equal(got, fp8_linear.reference(x, w, s, block=(32, 32), dtype=jnp.float32,
                                                            out_dtype=jnp.float32))


def test_the_model_linear_runs_the_kernel_it_is_set_to():
    rng, _ = seeded_rng()
    lin = Linear(128, 64, dtype=jnp.float32)
    lin.store_fp8((32, 32))
    w, s = _weight(rng, 64, 128, (32, 32))
    lin.weight.set_value(w)
    lin.scale.set_value(s)
    x = jnp.asarray(rng.standard_normal((6, 128)), jnp.float32)
    want = x @ fp8_linear.decode(w, s, (32, 32), jnp.float32).T
    for impl in ("xla", "pallas"):
        held = with_kernels(lin, KernelConfig(impl=impl))
        assert held.kernel_impl == impl and lin.kernel_impl == "auto"
        np.testing.assert_allclose(held(x), want, rtol=0, atol=1e-5 * float(jnp.abs(want).max()))


@pytest.mark.parametrize("T", [64, 8192])
def test_lowers_for_cuda_at_v41_flash_sizes(T):
    x = jax.ShapeDtypeStruct((T, 1280), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((32768, 1280), jnp.float8_e4m3fn)
    s = jax.ShapeDtypeStruct((1024, 40), jnp.uint8)
    text = lowering.lower_for_cuda(fp8_linear.pallas, x, w, s, block=(32, 32), dtype=jnp.bfloat16,
                                   out_dtype=jnp.bfloat16, interpret=False)
    assert lowering.count_gpu_kernels(text) == 1


def test_auto_runs_the_kernel_for_decode_sized_inputs_only(monkeypatch):
    """On a GPU backend, auto takes the Pallas kernel up to AUTO_MAX_ROWS rows (leading axes multiplied) and XLA's
    decode + dot above (measured 4.3x faster at 8,192 rows on an H200); explicit impls are obeyed."""
    import pallas_kernels.dispatch as dispatch

    ran = []
    monkeypatch.setattr(dispatch.jax, "default_backend", lambda: "gpu")
    for name in ("pallas", "xla"):
        monkeypatch.setattr(fp8_linear, name, lambda *a, name=name, **k: ran.append(name))
    w, s = jnp.zeros((64, 64), jnp.uint8), jnp.zeros((2, 2), jnp.uint8)
    n = fp8_linear.AUTO_MAX_ROWS
    for shape, impl in (((n, 64), "auto"), ((2, n // 2, 64), "auto"), ((n + 1, 64), "auto"), ((n + 1, 64), "pallas"),
                        ((1, 64), "xla")):
        fp8_linear.fp8_linear(jnp.zeros(shape), w, s, block=(32, 32), dtype=jnp.float32, impl=impl)
    assert ran == ["pallas", "pallas", "xla", "pallas", "xla"]
