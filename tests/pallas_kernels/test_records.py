"""Record decoding: the kernel-safe bit decoders, the float8-based reference and the model's decoders agree
on every byte value and on random encoded rows."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from dsv41 import quant
from pallas_kernels import records
from tests.pallas_kernels.util import assert_close, seeded_rng


def test_every_byte_value():
    b = jnp.arange(256, dtype=jnp.uint8)
    e4m3 = np.asarray(b).view(np.uint8).astype(np.uint8)
    want = np.asarray(jnp.asarray(e4m3).view(jnp.float8_e4m3fn).astype(jnp.float32))
    finite = np.isfinite(want)  # 0x7f / 0xff are NaN in e4m3fn; the encoders never emit them
    np.testing.assert_array_equal(np.asarray(records.e4m3_to_f32(b))[finite], want[finite])
    ue = np.asarray(records.ue8m0_to_f32(b))
    np.testing.assert_array_equal(ue[1:255], np.ldexp(1.0, np.arange(1, 255) - 127).astype(np.float32))
    codes = jnp.arange(16)
    grid = np.array(records.E2M1_GRID, np.float32)
    np.testing.assert_array_equal(np.asarray(records.e2m1_to_f32(codes)), np.concatenate([grid, -grid]))


@pytest.mark.parametrize("kind,d", [("fp8", 512), ("nvfp4", 512), ("mxfp4", 128), ("fp8", 16), ("nvfp4", 8)])
def test_decoders_agree_with_model(kind, d):
    rng, msg = seeded_rng()
    x = jnp.asarray(rng.standard_normal((6, d)) * rng.uniform(1e-3, 1e3, (6, 1)), jnp.float32)
    enc, dec = {"fp8": (quant.encode_fp8_record, quant.decode_fp8_record),
                "nvfp4": (quant.encode_nvfp4_record, quant.decode_nvfp4_record),
                "mxfp4": (quant.encode_mxfp4_record, quant.decode_mxfp4_record)}[kind]
    raw = enc(x)
    assert raw.shape[-1] == records.record_bytes(kind, d), msg
    want = dec(raw, d)
    assert_close(records.decode_rows(kind, raw, d), want, msg, rtol=0, atol=0)
    assert_close(records.reference_decode(kind, raw, d), want, msg, rtol=0, atol=0)


def test_record_width_checked():
    with pytest.raises(ValueError, match="rows_x: a nvfp4 record of a 512-channel row is 288 bytes"):
        records.check_record("nvfp4", 512, 528, "rows_x")
