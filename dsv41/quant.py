"""FP8 / MXFP4 / NVFP4 / UE8M0 encodings (spec §2.1, §4.1, §6.1).

Two groups of functions:
* checkpoint formats, NumPy (host side, exact): FP8 e4m3 linears with UE8M0 block scales, packed MXFP4
  experts, FP8 Engram rows. UE8M0 scales are kept as their raw exponent bytes (uint8): 2**(byte - 127).
* activation fake-quantization, JAX (inside the forward): what the reference applies to SWA KV (FP8 per
  32), global KV (NVFP4-style: e2m1 with an e4m3 scale per 16) and indexer q/k (MXFP4: e2m1 with UE8M0
  per 32). Storing those rows in the release cache records is then lossless.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

E4M3_MAX = 448.0
FP4_MAX = 6.0
FP4_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # e2m1 magnitudes by 3-bit code
UE8M0_BIAS = 127


# ====================================================================== NumPy: bit-exact helpers
def _pow2_ceil_exponent_np(x: np.ndarray) -> np.ndarray:
    """ceil(log2(x)) for positive normal float32 x, from the bits (no log rounding)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.int32)
    return ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).astype(np.int32)


def ue8m0_to_float(scale_bytes: np.ndarray) -> np.ndarray:
    if np.any(scale_bytes == 255):
        raise ValueError("UE8M0 scale byte 255 encodes NaN")
    return np.ldexp(np.float32(1.0), scale_bytes.astype(np.int32) - UE8M0_BIAS).astype(np.float32)


def fp4_codes_np(x: np.ndarray) -> np.ndarray:
    """Round x (already divided by its scale, |x| <= 6) to e2m1, round-half-even; 4-bit codes, sign = bit 3."""
    a = np.abs(x).astype(np.float32)
    grid = np.asarray(FP4_GRID, np.float32)
    idx = np.clip(np.searchsorted(grid, a, side="right") - 1, 0, 7)
    lo, hi = grid[idx], grid[np.minimum(idx + 1, 7)]
    mid = 0.5 * (lo + hi)
    up = (a > mid) | ((a == mid) & (idx % 2 == 1))
    code = np.where(up, np.minimum(idx + 1, 7), idx)
    code = np.where(a >= FP4_MAX, 7, code)
    return (code + np.where(x < 0, 8, 0)).astype(np.uint8)


def fp4_decode_np(codes: np.ndarray) -> np.ndarray:
    mag = np.asarray(FP4_GRID, np.float32)[codes & 7]
    return np.where(codes & 8, -mag, mag).astype(np.float32)


# ==================================================================== NumPy: FP8 block linears
def _pad_to(x: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    r, c = x.shape
    pr, pc = -r % block[0], -c % block[1]
    return np.pad(x, ((0, pr), (0, pc))) if pr or pc else x


def quantize_fp8_blocks(w: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """w [out, in] -> (e4m3 [out, in], UE8M0 bytes [ceil(out/b0), ceil(in/b1)]).

    The release rule: per tile exp = ceil(log2(max(amax, 1e-4) / 448)), q = e4m3(clamp(w / 2**exp, +-448)).
    """
    if w.ndim != 2:
        raise ValueError(f"FP8 block quantization needs a 2-D weight, got shape {w.shape}")
    out, inn = w.shape
    b0, b1 = block
    wp = _pad_to(w.astype(np.float32), block)
    tiles = wp.reshape(wp.shape[0] // b0, b0, wp.shape[1] // b1, b1)
    amax = np.maximum(np.abs(tiles).max(axis=(1, 3)), 1e-4).astype(np.float32)
    exp = _pow2_ceil_exponent_np(amax / np.float32(E4M3_MAX))
    scale = np.ldexp(np.float32(1.0), exp).astype(np.float32)
    q = np.clip(tiles / scale[:, None, :, None], -E4M3_MAX, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn)
    q = q.reshape(wp.shape)[:out, :inn]
    return np.ascontiguousarray(q), (exp + UE8M0_BIAS).astype(np.uint8)


def dequantize_fp8_blocks(q: np.ndarray, scale_bytes: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    out, inn = q.shape
    want = (-(-out // block[0]), -(-inn // block[1]))
    if scale_bytes.shape != want:
        raise ValueError(f"scale shape {scale_bytes.shape} does not match weight {q.shape} with {block} blocks "
                         f"(expected {want})")
    s = ue8m0_to_float(scale_bytes)
    s = np.repeat(np.repeat(s, block[0], axis=0), block[1], axis=1)[:out, :inn]
    return q.astype(np.float32) * s


# ================================================================== NumPy: MXFP4 packed experts
def quantize_mxfp4(w: np.ndarray, block: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """w [out, in] -> (int8 [out, in/2] two e2m1 codes per byte, low nibble = even column; UE8M0 [out, in/32])."""
    out, inn = w.shape
    if inn % block or inn % 2:
        raise ValueError(f"MXFP4 needs the input dimension ({inn}) to be a multiple of {block}")
    z = w.astype(np.float32).reshape(out, inn // block, block)
    amax = np.maximum(np.abs(z).max(-1), np.float32(FP4_MAX * 2.0**-126))
    exp = _pow2_ceil_exponent_np(amax / np.float32(FP4_MAX))
    scale = np.ldexp(np.float32(1.0), exp).astype(np.float32)
    codes = fp4_codes_np(np.clip(z / scale[..., None], -FP4_MAX, FP4_MAX)).reshape(out, inn)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8).view(np.int8)
    return packed, (exp + UE8M0_BIAS).astype(np.uint8)


def dequantize_mxfp4(packed: np.ndarray, scale_bytes: np.ndarray, block: int = 32) -> np.ndarray:
    out, half = packed.shape
    inn = half * 2
    if scale_bytes.shape != (out, inn // block):
        raise ValueError(f"MXFP4 scale shape {scale_bytes.shape} does not match packed weight {packed.shape} "
                         f"(expected {(out, inn // block)})")
    b = packed.view(np.uint8)
    codes = np.empty((out, inn), np.uint8)
    codes[:, 0::2] = b & 0xF
    codes[:, 1::2] = b >> 4
    vals = fp4_decode_np(codes).reshape(out, inn // block, block)
    return (vals * ue8m0_to_float(scale_bytes)[..., None]).reshape(out, inn)


# ============================================================= JAX: activation fake-quantization
def _pow2_ceil(x: jax.Array) -> jax.Array:
    """2**ceil(log2(x)) for positive float32 x, from the bits like the reference's fast_round_scale."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    exp = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).astype(jnp.int32)
    return jnp.ldexp(jnp.ones_like(x, jnp.float32), exp)


def _round_fp4(x: jax.Array) -> jax.Array:
    """Round to the e2m1 grid, ties to the even code (|x| <= 6 assumed)."""
    a = jnp.abs(x)
    grid = jnp.asarray(FP4_GRID, jnp.float32)
    idx = jnp.sum(a[..., None] >= grid[1:], axis=-1)  # index of the largest grid point <= a
    lo, hi = grid[idx], grid[jnp.minimum(idx + 1, 7)]
    mid = 0.5 * (lo + hi)
    up = (a > mid) | ((a == mid) & (idx % 2 == 1))
    r = jnp.where(a >= FP4_MAX, FP4_MAX, jnp.where(up, hi, lo))
    return jnp.copysign(r, x)


def _blocks(x: jax.Array, block: int) -> jax.Array:
    """[..., C] -> [..., C / block, block]; a row shorter than the block (tiny test models) is one block."""
    block = min(block, x.shape[-1])
    if x.shape[-1] % block:
        raise ValueError(f"fake-quant block {block} does not divide the last dimension {x.shape[-1]}")
    return x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // block, block)


def fake_quant_fp8(x: jax.Array, block: int = 32) -> jax.Array:
    """FP8 e4m3 with a power-of-two (UE8M0) scale per `block` values: the SWA KV record."""
    z = _blocks(x, block)
    amax = jnp.maximum(jnp.max(jnp.abs(z), -1, keepdims=True), 1e-4)
    s = _pow2_ceil(amax * (1.0 / E4M3_MAX))
    q = jnp.clip(z / s, -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn).astype(jnp.float32) * s
    return q.reshape(x.shape).astype(x.dtype)


def fake_quant_mxfp4(x: jax.Array, block: int = 32) -> jax.Array:
    """e2m1 with a UE8M0 scale per `block` values: indexer queries and keys."""
    z = _blocks(x, block)
    amax = jnp.maximum(jnp.max(jnp.abs(z), -1, keepdims=True), FP4_MAX * 2.0**-126)
    s = _pow2_ceil(amax * (1.0 / FP4_MAX))
    q = _round_fp4(jnp.clip(z / s, -FP4_MAX, FP4_MAX)) * s
    return q.reshape(x.shape).astype(x.dtype)


def fake_quant_nvfp4(x: jax.Array, block: int = 16) -> jax.Array:
    """e2m1 with an e4m3 scale per `block` values: the global (compressed) KV record."""
    z = _blocks(x, block)
    amax = jnp.maximum(jnp.max(jnp.abs(z), -1, keepdims=True), FP4_MAX * 2.0**-9)
    s = jnp.minimum(amax / FP4_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn).astype(jnp.float32)
    q = _round_fp4(jnp.clip(z / s, -FP4_MAX, FP4_MAX)) * s
    return q.reshape(x.shape).astype(x.dtype)


# ======================================================== JAX: KV-cache record encode / decode
# Byte layouts of the release KV records (spec §4.1): values first, then one scale byte per block.
# Encoding an already fake-quantized row is lossless; encoding any other row quantizes it.
def _fp4_code(x: jax.Array) -> jax.Array:
    """e2m1 code (sign = bit 3) of x already on the e2m1 grid."""
    a = jnp.abs(x)
    grid = jnp.asarray(FP4_GRID, jnp.float32)
    mag = jnp.argmin(jnp.abs(a[..., None] - grid), axis=-1).astype(jnp.uint8)
    return mag | jnp.where(x < 0, jnp.uint8(8), jnp.uint8(0))


def _fp4_value(code: jax.Array) -> jax.Array:
    mag = jnp.asarray(FP4_GRID, jnp.float32)[(code & 7).astype(jnp.int32)]
    return jnp.where(code & 8, -mag, mag)


def _pack_nibbles(codes: jax.Array) -> jax.Array:
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def _unpack_nibbles(packed: jax.Array) -> jax.Array:
    return jnp.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)


def fp8_record_bytes(d: int, block: int = 32) -> int:
    return d + d // min(block, d)


def encode_fp8_record(x: jax.Array, block: int = 32) -> jax.Array:
    """[..., d] -> [..., d + d/32] uint8: e4m3 values, then UE8M0 exponents (the SWA record)."""
    z = _blocks(x, block)
    amax = jnp.maximum(jnp.max(jnp.abs(z), -1, keepdims=True), 1e-4)
    s = _pow2_ceil(amax * (1.0 / E4M3_MAX))
    q = jnp.clip(z / s, -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)
    vals = jax.lax.bitcast_convert_type(q, jnp.uint8).reshape(*x.shape[:-1], -1)
    exps = (jnp.frexp(s[..., 0])[1] - 1 + UE8M0_BIAS).astype(jnp.uint8)
    return jnp.concatenate([vals, exps], axis=-1)


def decode_fp8_record(r: jax.Array, d: int, block: int = 32) -> jax.Array:
    b = min(block, d)
    vals = jax.lax.bitcast_convert_type(r[..., :d], jnp.float8_e4m3fn).astype(jnp.float32)
    s = jnp.ldexp(1.0, r[..., d:].astype(jnp.int32) - UE8M0_BIAS)
    return (vals.reshape(*vals.shape[:-1], d // b, b) * s[..., None]).reshape(vals.shape)


def nvfp4_record_bytes(d: int, block: int = 16) -> int:
    return d // 2 + d // min(block, d)


def encode_nvfp4_record(x: jax.Array, block: int = 16) -> jax.Array:
    """[..., d] -> [..., d/2 + d/16] uint8: packed e2m1 pairs (low nibble = even index), e4m3 scales."""
    z = _blocks(x, block)
    amax = jnp.maximum(jnp.max(jnp.abs(z), -1, keepdims=True), FP4_MAX * 2.0**-9)
    s8 = jnp.minimum(amax / FP4_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)
    codes = _fp4_code(_round_fp4(jnp.clip(z / s8.astype(jnp.float32), -FP4_MAX, FP4_MAX)))
    packed = _pack_nibbles(codes.reshape(*x.shape[:-1], -1))
    return jnp.concatenate([packed, jax.lax.bitcast_convert_type(s8[..., 0], jnp.uint8)], axis=-1)


def decode_nvfp4_record(r: jax.Array, d: int, block: int = 16) -> jax.Array:
    b = min(block, d)
    vals = _fp4_value(_unpack_nibbles(r[..., : d // 2]))
    s = jax.lax.bitcast_convert_type(r[..., d // 2:], jnp.float8_e4m3fn).astype(jnp.float32)
    return (vals.reshape(*vals.shape[:-1], d // b, b) * s[..., None]).reshape(vals.shape)


def mxfp4_record_bytes(d: int, block: int = 32) -> int:
    return d // 2 + d // min(block, d)


def encode_mxfp4_record(x: jax.Array, block: int = 32) -> jax.Array:
    """[..., d] -> [..., d/2 + d/32] uint8: packed e2m1 pairs, UE8M0 exponents (the index-key record)."""
    z = _blocks(x, block)
    amax = jnp.maximum(jnp.max(jnp.abs(z), -1, keepdims=True), FP4_MAX * 2.0**-126)
    s = _pow2_ceil(amax * (1.0 / FP4_MAX))
    codes = _fp4_code(_round_fp4(jnp.clip(z / s, -FP4_MAX, FP4_MAX)))
    packed = _pack_nibbles(codes.reshape(*x.shape[:-1], -1))
    exps = (jnp.frexp(s[..., 0])[1] - 1 + UE8M0_BIAS).astype(jnp.uint8)
    return jnp.concatenate([packed, exps], axis=-1)


def decode_mxfp4_record(r: jax.Array, d: int, block: int = 32) -> jax.Array:
    b = min(block, d)
    vals = _fp4_value(_unpack_nibbles(r[..., : d // 2]))
    s = jnp.ldexp(1.0, r[..., d // 2:].astype(jnp.int32) - UE8M0_BIAS)
    return (vals.reshape(*vals.shape[:-1], d // b, b) * s[..., None]).reshape(vals.shape)
