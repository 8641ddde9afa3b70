"""Stacked routed-expert weights [E, O, In] (output rows, input channels) as the grouped matmul reads them:
float arrays, or quantized records kept in their checkpoint form and decoded where they are used.

  mxfp4  values uint8 [E, O, In/2]: two e2m1 codes per byte, low nibble = even input channel;
         scales uint8 UE8M0 [E, O, In/32]. This is the release's `ffn.experts.e.w{1,2,3}.weight` (I8
         [out, in/2]) and `.scale` (F8_E8M0 [out, in/32]) stacked over e, bytes unchanged.
  fp8    values e4m3 bytes [E, O, In]; scales uint8 UE8M0 [E, O/b0, In/b1], one per b0 x b1 block (32 x 32
         like the release's FP8 linears, or 1 x 32 for per-row blocks); partial blocks are not supported.

`decode_tile` builds float32 values with integer ops, shifts, bitcasts, broadcasts and reshapes (the
`records` decoders), so a kernel calls it on loaded tiles. `reference_dequantize` decodes through XLA's
float8 type and the e2m1 table, independently, to check it against.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels import records

KINDS = ("mxfp4", "fp8")
MXFP4_BLOCK = 32


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedExperts:
    """Quantized stacked expert weights (module docstring); build with `quantized_experts`."""

    values: jax.Array
    scales: jax.Array
    kind: str = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, int, int]:
        """The logical [E, O, In] of the decoded weights."""
        E, O, n = self.values.shape
        return (E, O, 2 * n) if self.kind == "mxfp4" else (E, O, n)

    @property
    def block(self) -> tuple[int, int]:
        """(rows, input channels) sharing one scale."""
        _, O, In = self.shape
        return (O // self.scales.shape[1], In // self.scales.shape[2])


def quantized_experts(kind: str, values: jax.Array, scales: jax.Array) -> QuantizedExperts:
    """Wrap checkpoint bytes: int8 / float8_e4m3fn values and float8_e8m0 scales are viewed as uint8."""
    if kind not in KINDS:
        raise ValueError(f"unknown expert weight kind {kind!r} (expected one of {KINDS})")
    as_u8 = lambda a: a if a.dtype == jnp.uint8 else jax.lax.bitcast_convert_type(a, jnp.uint8)
    return QuantizedExperts(as_u8(values), as_u8(scales), kind)


def check_experts(w, name: str, shape: tuple[int, int, int]) -> None:
    """Raise naming `name` unless w is a float [E, O, In] array or a consistent QuantizedExperts of `shape`."""
    if not isinstance(w, QuantizedExperts):
        if w.shape != shape or not jnp.issubdtype(w.dtype, jnp.floating) or jnp.dtype(w.dtype).itemsize < 2:
            raise ValueError(f"{name}: expected float weights (16 or 32 bit; fp8 goes through quantized_experts) "
                             f"of shape {list(shape)}, got {w.dtype} {list(w.shape)}")
        return
    if w.kind not in KINDS or w.values.dtype != jnp.uint8 or w.scales.dtype != jnp.uint8:
        raise ValueError(f"{name}: quantized values and scales must be uint8 bytes of a kind in {KINDS} "
                         f"(use quantized_experts), got {w.kind!r} {w.values.dtype} / {w.scales.dtype}")
    E, O, In = shape
    if w.shape != shape:
        raise ValueError(f"{name}: {w.kind} values {list(w.values.shape)} decode to {list(w.shape)}, "
                         f"expected {list(shape)}")
    if w.kind == "mxfp4":
        if In % MXFP4_BLOCK or w.scales.shape != (E, O, In // MXFP4_BLOCK):
            raise ValueError(f"{name}: mxfp4 scales must be [{E}, {O}, {In}/32], got {list(w.scales.shape)}")
    elif (w.scales.ndim != 3 or w.scales.shape[0] != E or O % w.scales.shape[1] or In % w.scales.shape[2]):
        raise ValueError(f"{name}: fp8 scales {list(w.scales.shape)} are not whole blocks of [{E}, {O}, {In}]")


def expand_rows(s: jax.Array, block: int) -> jax.Array:
    """[..., r, c] -> [..., r * block, c], each row repeated over its block."""
    if block == 1:
        return s
    *lead, r, c = s.shape
    return jnp.broadcast_to(s[..., None, :], (*lead, r, block, c)).reshape(*lead, r * block, c)


def decode_tile(kind: str, values_u8: jax.Array, scales_u8: jax.Array, block: tuple[int, int]) -> jax.Array:
    """float32 [..., o, in] from a tile's value bytes [..., o, in(/2)] and its scale bytes [..., o/b0, in/b1]."""
    if kind == "mxfp4":
        return records.decode("mxfp4", values_u8, scales_u8)
    s = expand_rows(records.ue8m0_to_f32(scales_u8), block[0])
    return records.e4m3_to_f32(values_u8) * records.expand_blocks(s, block[1])


def reference_dequantize(w) -> jax.Array:
    """All experts [E, O, In] as float32, decoded through XLA's float8_e4m3fn and the e2m1 table."""
    if not isinstance(w, QuantizedExperts):
        return w.astype(jnp.float32)
    E, O, In = w.shape
    if w.kind == "mxfp4":
        codes = jnp.stack([w.values & 15, w.values >> 4], axis=-1).reshape(E, O, In).astype(jnp.int32)
        v = jnp.asarray(records.E2M1_GRID, jnp.float32)[codes & 7] * jnp.where(codes >= 8, -1.0, 1.0)
    else:
        v = jax.lax.bitcast_convert_type(w.values, jnp.float8_e4m3fn).astype(jnp.float32)
    b0, b1 = w.block
    s = jnp.ldexp(jnp.float32(1.0), w.scales.astype(jnp.int32) - 127)
    return v * jnp.repeat(jnp.repeat(s, b0, axis=1), b1, axis=2)
