"""Decoding of the V4.1 cache records (spec §4.1), in two independent forms.

Records: values first, then one scale byte per block.
  fp8    SWA row       [d + d/32]: e4m3 values, UE8M0 exponent per 32   (528 B at d = 512)
  nvfp4  global row    [d/2 + d/16]: packed e2m1 pairs (low nibble = even channel), e4m3 scale per 16 (288 B)
  mxfp4  index key     [d/2 + d/32]: packed e2m1 pairs, UE8M0 exponent per 32                (68 B at d = 128)
A row shorter than the block (tiny test models) is one block.

`decode_*` build float32 values from the bits with integer ops, shifts, a same-width bitcast, stack-of-2 and
reshape: every one has a Pallas Triton lowering, so kernels call them on loaded tiles (`load`). `reference_decode`
goes through XLA's float8 type and a lookup table, written straight from the spec, to check them against.
UE8M0 byte 0 (2**-127, a float32 denormal) decodes to 0 in the kernel form; the encoders never emit it for
values above 1e-30.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

KINDS = ("fp8", "nvfp4", "mxfp4")
BLOCK = {"fp8": 32, "nvfp4": 16, "mxfp4": 32}
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def block_size(kind: str, d: int) -> int:
    return min(BLOCK[kind], d)


def value_bytes(kind: str, d: int) -> int:
    return d if kind == "fp8" else d // 2


def record_bytes(kind: str, d: int) -> int:
    return value_bytes(kind, d) + d // block_size(kind, d)


def check_record(kind: str, d: int, width: int, name: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"{name}: unknown record kind {kind!r} (expected one of {KINDS})")
    if width != record_bytes(kind, d):
        raise ValueError(f"{name}: a {kind} record of a {d}-channel row is {record_bytes(kind, d)} bytes, "
                         f"got rows of {width}")


# ------------------------------------------------------------------ kernel-safe bit decoding
def _f32_from_bits(bits_i32: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(bits_i32, jnp.float32)


def e4m3_to_f32(b: jax.Array) -> jax.Array:
    """float8 e4m3fn bytes (uint8) -> float32 (NaN bytes are not produced by the encoders)."""
    b = b.astype(jnp.int32)
    e, m = (b >> 3) & 15, b & 7
    normal = _f32_from_bits(((b >> 7) << 31) | ((e + 120) << 23) | (m << 20))
    sub = m.astype(jnp.float32) * (2.0 ** -9)
    return jnp.where(e == 0, jnp.where(b >= 128, -sub, sub), normal)


def ue8m0_to_f32(b: jax.Array) -> jax.Array:
    """UE8M0 exponent bytes -> 2**(b - 127) as float32."""
    return _f32_from_bits(b.astype(jnp.int32) << 23)


def e2m1_to_f32(code: jax.Array) -> jax.Array:
    """4-bit e2m1 codes (sign = bit 3) in an integer array -> float32."""
    c = code.astype(jnp.int32)
    e, m = (c >> 1) & 3, c & 1
    mag = jnp.where(e == 0, m.astype(jnp.float32) * 0.5, _f32_from_bits(((e + 126) << 23) | (m << 22)))
    return jnp.where((c & 8) != 0, -mag, mag)


def unpack_nibbles(packed: jax.Array) -> jax.Array:
    """[..., n] uint8 -> [..., 2n] int32 codes, low nibble first."""
    p = packed.astype(jnp.int32)
    return jnp.stack([p & 15, p >> 4], axis=-1).reshape(*p.shape[:-1], 2 * p.shape[-1])


def expand_blocks(scale: jax.Array, block: int) -> jax.Array:
    """[..., nb] -> [..., nb * block], each scale repeated over its block."""
    return jnp.broadcast_to(scale[..., None], (*scale.shape, block)).reshape(*scale.shape[:-1], -1)


def decode(kind: str, values_u8: jax.Array, scales_u8: jax.Array) -> jax.Array:
    """Float32 rows [..., d] from a record's value bytes and scale bytes (loaded separately in kernels)."""
    if kind == "fp8":
        v = e4m3_to_f32(values_u8)
    else:
        v = e2m1_to_f32(unpack_nibbles(values_u8))
    s = e4m3_to_f32(scales_u8) if kind == "nvfp4" else ue8m0_to_f32(scales_u8)
    return v * expand_blocks(s, v.shape[-1] // scales_u8.shape[-1])


def load(kind: str, ref, index: tuple, d: int) -> jax.Array:
    """Float32 rows [..., d] at ref[index] inside a Pallas kernel: a uint8 record's value and scale bytes are loaded
    apart (Triton loads power-of-two widths, and a record is not one); float rows are cast."""
    if ref.dtype != jnp.uint8:
        return ref[(*index, slice(None))].astype(jnp.float32)
    nv = value_bytes(kind, d)
    return decode(kind, ref[(*index, pl.ds(0, nv))], ref[(*index, pl.ds(nv, d // block_size(kind, d)))])


def decode_rows(kind: str, raw: jax.Array, d: int) -> jax.Array:
    """Whole records [..., record_bytes] -> float32 [..., d]; float (unquantized) rows pass through."""
    if raw.dtype != jnp.uint8:
        return raw.astype(jnp.float32)
    nv = value_bytes(kind, d)
    return decode(kind, raw[..., :nv], raw[..., nv:])


# ----------------------------------------------------------------------- reference decoding
def reference_decode(kind: str, raw: jax.Array, d: int) -> jax.Array:
    """The spec's decoding through XLA's float8_e4m3fn and the e2m1 table: [..., record] -> [..., d]."""
    if raw.dtype != jnp.uint8:
        return raw.astype(jnp.float32)
    nv, b = value_bytes(kind, d), block_size(kind, d)
    vals, sc = raw[..., :nv], raw[..., nv:]
    if kind == "fp8":
        v = jax.lax.bitcast_convert_type(vals, jnp.float8_e4m3fn).astype(jnp.float32)
    else:
        codes = jnp.stack([vals & 15, vals >> 4], axis=-1).reshape(*vals.shape[:-1], d).astype(jnp.int32)
        v = jnp.asarray(E2M1_GRID, jnp.float32)[codes & 7] * jnp.where(codes >= 8, -1.0, 1.0)
    if kind == "nvfp4":
        s = jax.lax.bitcast_convert_type(sc, jnp.float8_e4m3fn).astype(jnp.float32)
    else:
        s = jnp.ldexp(jnp.float32(1.0), sc.astype(jnp.int32) - 127)
    return (v.reshape(*v.shape[:-1], d // b, b) * s[..., None]).reshape(v.shape)
