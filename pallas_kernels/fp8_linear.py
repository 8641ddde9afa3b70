"""A linear layer whose weight stays in the release's FP8 format: y [T, O] = x [T, I] @ dequant(w)^T.

Weight: e4m3 values [O, I] (float8_e4m3fn or its bytes as uint8) and UE8M0 exponent bytes [ceil(O/b0),
ceil(I/b1)] (32 x 32 blocks in V4.1, 128 x 128 in V4). Numerics as `dsv41.layers.basic.dense`: the weight is
decoded to the compute dtype (exact: a power-of-two scale of an e4m3 value), x is cast to it, float32
accumulation, HIGHEST precision in float32.

  reference  decodes through XLA's float8 type, then one dot (the spec); it is also the `xla` path: the decode
             is the dot's operand, which XLA fuses into the dot's producer where it can, a temporary of that
             op otherwise (never a resident full-precision weight)
  pallas     a Triton kernel over (row tile, output block) walking the input in chunks; each weight tile is
             loaded as bytes with its scale bytes and decoded in registers (`expert_weights.decode_tile`),
             so HBM traffic is the FP8 bytes. Tiles must hold whole scale blocks and divide the weight;
             a weight that does not (partial blocks of test-size models) takes the xla path.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.common import product_precision
from pallas_kernels.dispatch import interpret_default, resolve_impl
from pallas_kernels.expert_weights import decode_tile
from pallas_kernels.tile_table import KernelChoice, Tiles

MIN_DOT = 16  # Triton's smallest dot dimension
# auto runs the kernel for at most this many rows: on an H200 it was no faster than XLA's decode + cuBLAS dot at 1 row
# (both dispatch-bound) and several times slower at 8,192 rows (docs/design/measurements.md)
AUTO_MAX_ROWS = 64


def _as_bytes(w: jax.Array) -> jax.Array:
    return w if w.dtype == jnp.uint8 else jax.lax.bitcast_convert_type(w, jnp.uint8)


def decode(w_OI: jax.Array, scale: jax.Array, block: tuple[int, int], dtype) -> jax.Array:
    """[O, I] in `dtype` from e4m3 values and UE8M0 bytes per block (XLA's float8 type)."""
    O, I = w_OI.shape
    v = jax.lax.bitcast_convert_type(_as_bytes(w_OI), jnp.float8_e4m3fn).astype(jnp.float32)
    s = jnp.ldexp(jnp.float32(1.0), scale.astype(jnp.int32) - 127)
    s = jnp.repeat(jnp.repeat(s, block[0], axis=0), block[1], axis=1)[:O, :I]
    return (v * s).astype(dtype)


def _dot(x, w, dtype, out_dtype):
    y = jnp.einsum("...i,oi->...o", x.astype(dtype), w, preferred_element_type=jnp.float32,
                   precision=product_precision(dtype))
    return y.astype(out_dtype)


def reference(x_TI, w_OI, scale, *, block: tuple[int, int], dtype, out_dtype):
    return _dot(x_TI, decode(w_OI, scale, block, dtype), dtype, out_dtype)


xla = reference  # the spec's form is already the CPU path (module docstring)


def _pow2_divisor(n: int, cap: int) -> int:
    b = 1
    while b * 2 <= cap and n % (b * 2) == 0:
        b *= 2
    return b


def tiles_for(O: int, I: int, block: tuple[int, int], block_n: int = 64, block_k: int = 128) -> tuple[int, int] | None:
    """(output rows, input chunk) per program: powers of two dividing the weight and holding whole scale blocks;
    None when the weight allows none (then `fp8_linear` uses the xla path)."""
    bn = _pow2_divisor(O, max(block_n, block[0]))
    bk = _pow2_divisor(I, max(block_k, block[1]))
    if bn % block[0] or bk % block[1] or min(bn, bk) < MIN_DOT:
        return None
    return bn, bk


def _kernel(x_ref, v_ref, s_ref, y_ref, *, block, bn, bk, dtype, prec):
    j = pl.program_id(1)
    b0, b1 = block

    def chunk(c, acc):
        v = v_ref[pl.ds(j * bn, bn), pl.ds(c * bk, bk)]
        s = s_ref[pl.ds(j * (bn // b0), bn // b0), pl.ds(c * (bk // b1), bk // b1)]
        w = decode_tile("fp8", v, s, block).astype(dtype)
        xc = x_ref[:, pl.ds(c * bk, bk)].astype(dtype)
        return acc + jax.lax.dot_general(xc, w, (((1,), (1,)), ((), ())), precision=prec,
                                         preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, x_ref.shape[1] // bk, chunk, jnp.zeros((x_ref.shape[0], bn), jnp.float32))
    y_ref[...] = acc.astype(y_ref.dtype)


def pallas(x_TI, w_OI, scale, *, block: tuple[int, int], dtype, out_dtype, block_m: int | None = None,
           block_n: int = 64, block_k: int = 128, num_warps: int = 4, num_stages: int = 2,
           interpret: bool | None = None):
    """The Triton kernel (module docstring); rows padded to `block_m` (16 for decode batches, up to 64)."""
    *lead, I = x_TI.shape
    O = w_OI.shape[0]
    t = tiles_for(O, I, block, block_n, block_k)
    if t is None:
        raise ValueError(f"fp8 linear [{O}, {I}] with {block} blocks has no whole-block power-of-two tile")
    bn, bk = t
    x = x_TI.reshape(-1, I)
    T = x.shape[0]
    bm = block_m or min(64, max(MIN_DOT, 1 << max(0, (T - 1).bit_length())))
    Tp = -(-T // bm) * bm
    x = jnp.pad(x, ((0, Tp - T), (0, 0)))
    v, s = _as_bytes(w_OI), scale.astype(jnp.uint8)
    whole = lambda a: pl.BlockSpec(a.shape, lambda i, j: (0,) * a.ndim)
    y = pl.pallas_call(
        functools.partial(_kernel, block=tuple(block), bn=bn, bk=bk, dtype=jnp.dtype(dtype),
                          prec=product_precision(dtype)),
        grid=(Tp // bm, O // bn), out_shape=jax.ShapeDtypeStruct((Tp, O), out_dtype),
        in_specs=[pl.BlockSpec((bm, I), lambda i, j: (i, 0)), whole(v), whole(s)],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        interpret=interpret_default() if interpret is None else interpret, name="fp8_linear",
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages))(x, v, s)
    return y[:T].reshape(*lead, O)


def fp8_linear(x_TI, w_OI, scale, *, block: tuple[int, int], dtype, out_dtype=None, impl: str = "auto",
               choice: KernelChoice | None = None):
    """x [..., I] @ dequant(w [O, I])^T -> [..., O] in `out_dtype` (default `dtype`), through `impl`; the
    Pallas path falls back to xla for weights without a whole-block tile. auto takes a tuned `choice` (a device's
    tile table, `KernelConfig.choice`) where given, else the kernel only for decode-sized inputs
    (`AUTO_MAX_ROWS`); an explicit "pallas" takes only a choice's tiles."""
    out_dtype = out_dtype or dtype
    rows = math.prod(x_TI.shape[:-1])
    if impl == "auto" and choice is not None:
        impl = choice.impl
    impl = resolve_impl(impl if impl != "auto" or rows <= AUTO_MAX_ROWS else "xla")
    tiles = choice.tiles if choice is not None and choice.impl == "pallas" else Tiles()
    if impl == "pallas" and tiles_for(*w_OI.shape, tuple(block), tiles.block_n, tiles.block_k) is None:
        impl = "xla"
    if impl == "pallas":
        return pallas(x_TI, w_OI, scale, block=tuple(block), dtype=dtype, out_dtype=out_dtype, **tiles.kwargs())
    fn = {"reference": reference, "xla": xla}[impl]
    return fn(x_TI, w_OI, scale, block=tuple(block), dtype=dtype, out_dtype=out_dtype)
