"""Sparse MLA attention: Pallas (interpret) and XLA paths against the spec reference (with and without a
tile plan, and for queries on a subset of the call's rows), the reference against the model's attention,
and the Triton kernel lowered for CUDA at V4.1-Flash sizes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41 import quant
from pallas_kernels import lowering
from pallas_kernels import sparse_attention as sa
from pallas_kernels.tiles import plan_tiles
from tests.jaxpr_walk import equations
from tests.pallas_kernels.util import assert_close, seeded_rng

H, D, DR, W = 16, 64, 16, 16


LENS = [5, 4, 3]


def make_case(rng, *, quantized: bool, K: int = 40, rpb: int = 8, n_blocks: int = 12):
    """Three requests: one starting at position 0 (window clipped at 0), one with a replay floor above its
    window start, one deep into its context (ring fully used); a query row with no top-k rows at all."""
    lens, starts, floors = LENS, [0, 37, 200], [0, 30, 0]
    pos = np.concatenate([s + np.arange(n) for s, n in zip(starts, lens)])
    req = np.repeat(np.arange(3), lens)
    T = len(pos)
    f32 = lambda *s: rng.standard_normal(s).astype(np.float32)
    kv = f32(T, D)
    ring_rows = f32(4, W, D)
    rows = f32(n_blocks, rpb, D)
    ring = quant.encode_fp8_record(jnp.asarray(ring_rows)) if quantized else jnp.asarray(ring_rows)
    cache = quant.encode_nvfp4_record(jnp.asarray(rows)) if quantized else jnp.asarray(rows)
    bt = np.stack([rng.permutation(n_blocks)[:6] for _ in range(3)]).astype(np.int32)
    topk = np.full((T, K), -1, np.int32)
    for t in range(T):
        n = int(rng.integers(0, K + 1)) if t != 1 else 0
        topk[t, :n] = rng.choice(6 * rpb, n, replace=False)
    meta = sa.AttnMeta(jnp.asarray(pos, jnp.int32), jnp.asarray(req, jnp.int32), jnp.asarray([2, 0, 3], jnp.int32),
                       jnp.asarray(starts, jnp.int32), jnp.asarray(floors, jnp.int32), jnp.asarray(bt))
    theta = pos[:, None] * (10000.0 ** -(np.arange(DR // 2) / (DR // 2)))
    args = (jnp.asarray(f32(T, H, D)), jnp.asarray(np.cos(theta), jnp.float32), jnp.asarray(np.sin(theta), jnp.float32),
            jnp.asarray(f32(H)), jnp.asarray(kv), ring, meta, cache, jnp.asarray(topk))
    return args


def with_plan(args, size):
    """The case's meta with a tile plan of `size` rows (each request's rows are consecutive)."""
    first = np.cumsum([0] + LENS[:-1])
    tiles = plan_tiles(first, np.array(LENS), size, -(-sum(LENS) // size) + len(LENS))
    return (*args[:6], args[6]._replace(tiles=tiles), *args[7:])


@pytest.mark.parametrize("quantized", [True, False])
@pytest.mark.parametrize("tile", [None, 2, 4])
def test_xla_equals_reference(quantized, tile):
    rng, msg = seeded_rng()
    args = make_case(rng, quantized=quantized)
    if tile:
        args = with_plan(args, tile)
    assert_close(sa.xla(*args), sa.reference(*args), f"{msg} tile={tile}")
    assert_close(sa.xla(*args[:7]), sa.reference(*args[:7]), f"{msg} tile={tile} (SWA only)")


@pytest.mark.parametrize("impl", ["xla", "reference"])
@pytest.mark.parametrize("tile", [None, 4])
def test_out_dtype_is_the_float32_output_rounded_once(impl, tile):
    """`out_dtype` (the consumer's dtype): the XLA path rounds each tile's float32 output itself (no float32
    [T, H, d] written); the values are the float32 output's, rounded to bfloat16 (within one of its ulps: the
    two programs may contract the inverse RoPE into FMAs differently)."""
    rng, msg = seeded_rng()
    args = make_case(rng, quantized=False)
    if tile:
        args = with_plan(args, tile)
    f32 = np.asarray(sa.sparse_mla(*args, impl=impl))
    bf16 = sa.sparse_mla(*args, impl=impl, out_dtype=jnp.bfloat16)
    assert bf16.dtype == jnp.bfloat16 and f32.dtype == np.float32
    np.testing.assert_allclose(np.asarray(bf16, np.float32), f32, rtol=2.0 ** -7, atol=1e-6, err_msg=msg)


@pytest.mark.parametrize("quantized", [True, False])
def test_xla_reads_a_ring_decoded_up_front_as_one_decoded_per_tile(quantized):
    """The XLA path decodes each request's SWA ring once when its tiles would decode more records than the rings
    hold, else per tile what the tile reads: padding the call with unused requests (more rings than rows, as a
    decode step of a few requests in a large max_num_seqs) switches form, and the output stays bit-equal."""
    rng, msg = seeded_rng()
    args = make_case(rng, quantized=quantized)
    meta, extra = args[6], 10  # 3 + 10 rings of W records > 12 one-row tiles of W records
    pad = lambda a: jnp.concatenate([a, jnp.zeros((extra, *a.shape[1:]), a.dtype)])  # noqa: E731
    padded = meta._replace(slot_R=pad(meta.slot_R), start_R=pad(meta.start_R), floor_R=pad(meta.floor_R),
                           block_table_RM=pad(meta.block_table_RM))
    once, per_tile = sa.xla(*args), sa.xla(*args[:6], padded, *args[7:])
    np.testing.assert_array_equal(np.asarray(per_tile), np.asarray(once), err_msg=msg)


@pytest.mark.parametrize("quantized", [True, False])
@pytest.mark.parametrize("scan_rows", [8, 32, 128])  # 1, 4 (a last step past the table) or all 6 blocks a step
def test_xla_decodes_a_prefills_block_rows_once_up_front_as_per_tile(monkeypatch, quantized, scan_rows):
    """Where a request's tiles would decode more blocks in their scans than its whole table holds (a prefill), the
    XLA path decodes each request's table once, up front ([requests, blocks, rows, record] in one decode), else in
    each tile's scan step ([blocks of a step, rows, record]): 9 tiles of 3 requests with 6 blocks each decode them
    up front at 4 or 6 blocks a step (3 x 8 <= 9 x 4, 3 x 6 <= 9 x 6), per tile at 1 (3 x 6 > 9 x 1). Forced to
    decode per tile (no room up front), the output is bit-equal."""
    monkeypatch.setattr(sa, "SCAN_ROWS", scan_rows)
    rng, msg = seeded_rng()
    args = with_plan(make_case(rng, quantized=quantized), 2)  # 3 + 2 + 2 tiles (+ 2 padding) of 3 requests
    assert args[6].tiles.count == 9 and args[6].block_table_RM.shape == (3, 6)
    rpb, c = args[7].shape[1], min(6, max(1, scan_rows // 8))
    shapes = []
    decode = sa.records.decode_rows

    def spy(kind, raw, d):
        if kind == "nvfp4":
            shapes.append(raw.shape[:-1])
        return decode(kind, raw, d)

    monkeypatch.setattr(sa.records, "decode_rows", spy)
    once = jax.jit(lambda *a: sa.xla(*a))(*args)
    per_step = {(c, rpb)}
    assert set(shapes) == per_step if c == 1 else shapes == [(3, -(-6 // c) * c, rpb)], shapes
    monkeypatch.setattr(sa, "SCAN_DECODED_BYTES", 0)
    shapes.clear()
    per_tile = jax.jit(lambda *a: sa.xla(*a))(*args)
    assert set(shapes) == per_step, shapes
    np.testing.assert_array_equal(np.asarray(per_tile), np.asarray(once), err_msg=msg)


@pytest.mark.parametrize("tile", [None, 4])
def test_xla_in_bfloat16_multiplies_in_bfloat16(tile):
    """bf16 queries and rows: the XLA path's products take bf16 operands with float32 sums (as the Pallas kernel;
    XLA:CPU runs them on AMX where the CPU has it), within bf16 rounding of the float32 reference; float32 inputs
    keep float32 products."""
    rng, msg = seeded_rng()
    args = make_case(rng, quantized=True)
    args = with_plan(args, tile) if tile else args
    bf16 = (args[0].astype(jnp.bfloat16), *args[1:4], args[4].astype(jnp.bfloat16), *args[5:])
    want = sa.reference(*bf16)  # the bf16 inputs, every product in float32
    err = assert_close(sa.xla(*bf16), want, f"{msg} tile={tile}", rtol=3e-2, atol=3e-2)
    assert err > 1e-5, "no bf16 rounding at all: the products ran in float32"

    assert _dot_operand_dtypes(sa.xla, bf16) == {"bfloat16"}
    assert _dot_operand_dtypes(sa.xla, args) == {"float32"}


def _dot_operand_dtypes(fn, args) -> set[str]:
    """The operand dtypes of every dot_general in fn's jaxpr, loops and conditionals included."""
    return {str(v.aval.dtype) for e in equations(jax.make_jaxpr(fn)(*args)) if e.primitive.name == "dot_general"
            for v in e.invars}


@pytest.mark.parametrize("scan_rows", [8, 16, 32, 128])  # 1, 2, 4, all 6 blocks of 8 rows per scan step
def test_xla_block_scan_stops_at_n_blocks(monkeypatch, scan_rows):
    """The XLA path's per-tile block scan (a table of at most size x k rows), SCAN_ROWS rows a step: over the whole
    table (a last step past it: 6 blocks in steps of 4) it is the reference; it reads only `meta.n_blocks` blocks
    (a bound inside a step too): with every selected row below that bound the result is the reference's, a bound
    below a selected row's block drops that row (so the bound is really used)."""
    monkeypatch.setattr(sa, "SCAN_ROWS", scan_rows)
    rng, msg = seeded_rng()
    case = with_plan(make_case(rng, quantized=True), 4)
    assert_close(sa.xla(*case), sa.reference(*case), msg)
    q, cos, sin, sink, kv, ring, meta, rows, topk = with_plan(make_case(rng, quantized=False), 4)
    topk = jnp.where(topk < 3 * 8, topk, -1)  # rows of the first 3 blocks of each request
    args = (q, cos, sin, sink, kv, ring, meta._replace(n_blocks=jnp.int32(3)), rows, topk)
    assert_close(sa.xla(*args), sa.reference(*args), msg)
    short = (*args[:6], meta._replace(n_blocks=jnp.int32(2)), rows, topk)
    assert not np.allclose(np.asarray(sa.xla(*short)), np.asarray(sa.reference(*args)), atol=1e-3)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_queries_on_a_subset_of_the_rows(impl):
    """A layer that runs only some of a call's rows (the cut layer after decoder trimming) still reads
    the window rows of all of them: queries at kv_row_T give the rows' results of a call over every row."""
    rng, msg = seeded_rng()
    args = make_case(rng, quantized=True)
    q, cos, sin, sink, kv, ring, meta, rows, topk = args
    want = np.asarray(sa.reference(*args))
    keep = np.array([3, 4, 7, 8, 11])  # the last rows of each request (the second ends at 8)
    sub = meta._replace(pos_T=meta.pos_T[keep], req_T=meta.req_T[keep], kv_row_T=jnp.asarray(keep, jnp.int32))
    if impl == "xla":
        sub = sub._replace(tiles=plan_tiles(np.array([0, 2, 4]), np.array([2, 2, 1]), 2, 4))
    sub_args = (q[keep], cos[keep], sin[keep], sink, kv, ring, sub, rows, topk[keep])
    got = sa.sparse_mla(*sub_args, impl=impl) if impl == "xla" else sa.pallas(*sub_args, block_k=16, interpret=True)
    assert_close(got, want[keep], f"{msg} {impl}", rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("form", ["prefill", "decode_splits"])
def test_pallas_interpret_matches_reference(form):
    rng, msg = seeded_rng()
    args = make_case(rng, quantized=True)
    want = sa.reference(*args)
    if form == "prefill":
        got = sa.pallas(*args, block_h=8, block_k=16, interpret=True)
    else:
        got = sa.pallas(*args, splits=3, block_k=16, interpret=True)
    assert_close(got, want, f"{msg} {form}", rtol=2e-5, atol=2e-5)


def test_pallas_interpret_swa_only_float_ring():
    rng, msg = seeded_rng()
    args = make_case(rng, quantized=False)
    assert_close(sa.pallas(*args[:7], block_k=8, interpret=True), sa.reference(*args[:7]), msg, rtol=2e-5, atol=2e-5)


def test_pallas_fp8_output_matches_reference_cast():
    rng, msg = seeded_rng()
    args = make_case(rng, quantized=True)
    o8, s = sa.pallas(*args, out_fp8=True, block_k=16, interpret=True)
    r8, rs = sa.reference(*args, out_fp8=True)
    T = args[0].shape[0]
    assert o8.dtype == jnp.float8_e4m3fn and o8.shape == (T, H * D) and s.shape == (T, H * D // D)
    deq = np.asarray(o8, np.float32).reshape(T, -1, D) * np.asarray(s)[..., None]
    ref = np.asarray(sa.reference(*args)).reshape(T, -1, D)
    # e4m3 keeps 3 mantissa bits: half an ulp relative, plus the smallest subnormal step of the scale
    np.testing.assert_array_less(np.abs(deq - ref), np.abs(ref) / 16 + np.asarray(s)[..., None] * 2.0 ** -9 + 1e-6,
                                 err_msg=msg)
    same = np.mean(np.asarray(o8, np.float32) == np.asarray(r8, np.float32))
    assert same > 0.99, f"{msg}: only {same:.3f} of fp8 codes equal the reference cast"
    assert_close(s, rs, msg)


def test_reference_agrees_with_model_attention():
    """Spec reference == dsv41 masked_attention (+ inverse RoPE) for one request from position 0."""
    from dsv41.layers.attention import masked_attention
    from dsv41.layers.indexer import topk_row_mask
    from dsv41.layers.rope import apply_rope

    rng, msg = seeded_rng()
    T, rpb, nb = 11, 4, 5
    f32 = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    q, kv, rows, sink = f32(T, H, D), f32(T, D), f32(nb, rpb, D), f32(H)
    pos = jnp.arange(T, dtype=jnp.int32)
    theta = pos[:, None] * (10000.0 ** -(jnp.arange(DR // 2) / (DR // 2)))
    cos, sin = jnp.cos(theta), jnp.sin(theta)
    topk = jnp.asarray(np.stack([np.concatenate([rng.choice(nb * rpb, 6, replace=False), [-1, -1]]) for _ in range(T)]),
                       jnp.int32)
    meta = sa.AttnMeta(pos, jnp.zeros(T, jnp.int32), jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32),
                       jnp.zeros(1, jnp.int32), jnp.arange(nb, dtype=jnp.int32)[None])
    got = sa.reference(q, cos, sin, sink, kv, jnp.zeros((1, W, D)), meta, rows, topk)
    swa_mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - W)
    o = masked_attention(apply_rope(q, cos[:, None], sin[:, None]), kv, swa_mask, sink, rows.reshape(-1, D),
                         topk_row_mask(topk, nb * rpb))
    assert_close(got, apply_rope(o, cos[:, None], sin[:, None], inverse=True), msg)


@pytest.mark.parametrize("form", ["prefill", "decode", "decode_fp8"])
def test_lowers_for_cuda_at_v41_sizes(form):
    """The Triton kernel at H=64, d=512, d_r=64, W=128, top-512, NVFP4 rows and FP8 ring lowers for an
    abstract H200 (shape/layout errors of the Triton lowering fail here)."""
    T, R, Hf, d, K, rpb, nb = 8, 2, 64, 512, 512, 64, 32
    S = jax.ShapeDtypeStruct
    i32 = lambda *s: S(s, jnp.int32)
    meta = sa.AttnMeta(i32(T), i32(T), i32(R), i32(R), i32(R), i32(R, 16))
    args = (S((T, Hf, d), jnp.bfloat16), S((T, 32), jnp.float32), S((T, 32), jnp.float32), S((Hf,), jnp.float32),
            S((T, d), jnp.bfloat16), S((R, 128, 528), jnp.uint8), meta, S((nb, rpb, 288), jnp.uint8), i32(T, K))
    kw = {"prefill": dict(block_h=16), "decode": dict(splits=4), "decode_fp8": dict(out_fp8=True)}[form]
    text = lowering.lower_for_cuda(sa.pallas, *args, interpret=False, **kw)
    assert lowering.count_gpu_kernels(text) == 1, text[:2000]
