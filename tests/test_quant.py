"""FP8 / MXFP4 / NVFP4 encodings against the spec's rules, evaluated independently in float64."""

import ml_dtypes
import numpy as np
import pytest

from dsv41 import quant

GRID = np.array(quant.FP4_GRID)


def _fp4_reference(a: float) -> float:
    """Nearest e2m1 magnitude, ties to the even code, by brute force."""
    d = np.abs(GRID - abs(a))
    best = np.flatnonzero(d == d.min())
    code = best[0] if len(best) == 1 else best[best % 2 == 0][0]
    return float(np.copysign(GRID[code], a))


def test_fp4_rounding_ties_and_saturation():
    xs = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.75, 0.1, 5.9, 6.0, -6.0, 0.0, 2.9, 4.4])
    want = np.array([_fp4_reference(x) for x in xs])
    np.testing.assert_array_equal(quant.fp4_decode_np(quant.fp4_codes_np(xs)), want)
    np.testing.assert_array_equal(np.asarray(quant._round_fp4(xs.astype(np.float32))), want)


def test_fp8_block_quantization_rule_and_round_trip():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((70, 100)).astype(np.float32) * np.float32(3.0)
    w[:32, :32] *= 1e-6  # a tile whose amax is below the 1e-4 floor
    q, s = quant.quantize_fp8_blocks(w, (32, 32))
    assert q.dtype == ml_dtypes.float8_e4m3fn and s.shape == (3, 4) and s.dtype == np.uint8
    for i in range(3):
        for j in range(4):
            tile = w[32 * i:32 * i + 32, 32 * j:32 * j + 32]
            exp = int(np.ceil(np.log2(max(np.abs(tile).max(), 1e-4) / 448.0)))
            assert s[i, j] == exp + 127
    deq = quant.dequantize_fp8_blocks(q, s, (32, 32))
    scale = np.repeat(np.repeat(2.0 ** (s.astype(np.float64) - 127), 32, 0), 32, 1)[:70, :100]
    assert np.all(np.abs(deq - w) <= scale * 16 + 1e-30)  # e4m3 step at 448 is 32 -> half-step 16
    # Re-quantizing the dequantized weight gives the same bytes (the ceil-exponent rule is idempotent).
    q2, s2 = quant.quantize_fp8_blocks(deq, (32, 32))
    assert q2.tobytes() == q.tobytes() and s2.tobytes() == s.tobytes()


def test_mxfp4_pack_layout_and_values():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((8, 64)).astype(np.float32)
    packed, s = quant.quantize_mxfp4(w)
    assert packed.shape == (8, 32) and packed.dtype == np.int8 and s.shape == (8, 2)
    deq = quant.dequantize_mxfp4(packed, s)
    scale = 2.0 ** (s.astype(np.float64) - 127)
    for r in range(8):
        for b in range(2):
            blk = w[r, 32 * b:32 * b + 32]
            assert scale[r, b] == 2.0 ** np.ceil(np.log2(np.abs(blk).max() / 6.0))
            want = [_fp4_reference(x / scale[r, b]) * scale[r, b] for x in blk]
            np.testing.assert_array_equal(deq[r, 32 * b:32 * b + 32], want)
    # Low nibble = even column.
    b0 = packed.view(np.uint8)[0, 0]
    assert quant.fp4_decode_np(np.array([b0 & 15]))[0] * scale[0, 0] == deq[0, 0]
    assert quant.fp4_decode_np(np.array([b0 >> 4]))[0] * scale[0, 0] == deq[0, 1]


@pytest.mark.parametrize("kind", ["fp8", "mxfp4", "nvfp4"])
def test_fake_quant_matches_rule_and_is_idempotent(kind):
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((5, 64)) * rng.uniform(0.01, 100, (5, 1))).astype(np.float32)
    fq = {"fp8": quant.fake_quant_fp8, "mxfp4": quant.fake_quant_mxfp4, "nvfp4": quant.fake_quant_nvfp4}[kind]
    y = np.asarray(fq(x))
    block = 16 if kind == "nvfp4" else 32
    for row in range(5):
        for b in range(64 // block):
            blk = x[row, b * block:(b + 1) * block].astype(np.float64)
            amax = np.abs(blk).max()
            if kind == "fp8":
                s = 2.0 ** np.ceil(np.log2(max(amax, 1e-4) / 448))
                want = (blk / s).astype(np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * s
            else:
                s = (2.0 ** np.ceil(np.log2(max(amax, 6 * 2.0 ** -126) / 6)) if kind == "mxfp4" else
                     float(np.float32(max(amax, 6 * 2.0 ** -9) / 6).astype(ml_dtypes.float8_e4m3fn)))
                want = np.array([_fp4_reference(v) for v in np.clip(blk / s, -6, 6)]) * s
            np.testing.assert_allclose(y[row, b * block:(b + 1) * block], want, rtol=1e-6, atol=1e-30)
    np.testing.assert_array_equal(np.asarray(fq(y)), y)  # values on the grid stay there
