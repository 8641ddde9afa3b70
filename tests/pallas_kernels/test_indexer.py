"""Indexer selection: Pallas scoring (interpret) and XLA against the spec reference in the dense and
candidate-restricted modes (with the dense scan bounded by the step's longest context, with and without a
tile plan), the reference against the model's indexer functions, and CUDA lowering.

Queries sit on the e2m1 grid with power-of-two scales, keys are MXFP4 records and head weights small
integers, so every score is exact in float32 in any summation order: ties (ReLU zeros and coincident
sums, which are common) must then resolve identically, to the lower row id."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41 import quant
from pallas_kernels import indexer as ix
from pallas_kernels import lowering
from pallas_kernels.tiles import plan_tiles
from tests.pallas_kernels.util import seeded_rng

Hh, C, RPB = 4, 32, 8


def make_case(rng, *, T=9, n_blocks=10, M=5, quantized=True, max_visible=None):
    """Two requests' queries (request 0's rows first, as a step lays them out), random visible counts up to
    `max_visible` rows (default the whole table)."""
    q = quant.fake_quant_mxfp4(jnp.asarray(rng.standard_normal((T, Hh, C)), jnp.float32))
    w = jnp.asarray(rng.integers(0, 4, (T, Hh)), jnp.float32)
    keys = jnp.asarray(rng.standard_normal((n_blocks, RPB, C)), jnp.float32)
    keys = quant.encode_mxfp4_record(keys) if quantized else quant.fake_quant_mxfp4(keys)
    req = jnp.asarray(np.sort(rng.integers(0, 2, T)), jnp.int32)
    vis = rng.integers(0, (max_visible or M * RPB) + 1, T)
    vis[0], vis[1] = 0, 3  # nothing visible; fewer visible rows than k
    bt = jnp.asarray(np.stack([rng.permutation(n_blocks)[:M] for _ in range(2)]), jnp.int32)
    return q, w, keys, ix.IndexMeta(jnp.asarray(vis, jnp.int32), req, bt)


def plan(meta, size):
    """A tile plan over the case's requests (their rows are consecutive)."""
    req = np.asarray(meta.req_T)
    qlen = np.bincount(req, minlength=2)
    return plan_tiles(np.cumsum([0, qlen[0]]), qlen, size, -(-len(req) // size) + 2)


def _eq(a, b, msg):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=msg)


@pytest.mark.parametrize("quantized", [True, False])
@pytest.mark.parametrize("tile", [None, 4])
def test_dense_mode_matches_reference(quantized, tile):
    rng, msg = seeded_rng()
    q, w, keys, meta = make_case(rng, quantized=quantized)
    want, want_c = ix.reference(q, w, keys, meta, k=8, n_cand_blocks=3)
    assert (np.asarray(want)[0] == -1).all() and (np.asarray(want)[1, 3:] == -1).all(), msg
    if tile:
        meta = meta._replace(tiles=plan(meta, tile))
    for impl in ("xla", "pallas"):
        got, got_c = ix.index_topk(q, w, keys, meta, k=8, n_cand_blocks=3, impl=impl)
        _eq(got, want, f"{msg} {impl} ids")
        _eq(got_c, want_c, f"{msg} {impl} candidate blocks")


def test_dense_scan_stops_at_the_longest_context():
    """With every query's visible rows within 3 of the table's 5 blocks, a scan bound of 3 blocks (a dynamic
    value: one compiled function for any bound) gives the full result; a bound of 2 blocks misses rows."""
    rng, msg = seeded_rng()
    q, w, keys, meta = make_case(rng, max_visible=3 * RPB)
    want, want_c = ix.reference(q, w, keys, meta, k=12, n_cand_blocks=3)
    kw = dict(k=12, n_cand_blocks=3)
    # the kernel skips whole programs of block_n rows: one cache block per program shows the bound
    for impl, op in (("xla", functools.partial(ix.xla, **kw)), ("pallas", functools.partial(ix.pallas, **kw, block_n=RPB))):
        fn = jax.jit(lambda m: op(q, w, keys, m))
        got, got_c = fn(meta._replace(n_blocks=jnp.int32(3), tiles=plan(meta, 4)))
        _eq(got, want, f"{msg} {impl} ids")
        _eq(got_c, want_c, f"{msg} {impl} candidate blocks")
        short, _ = fn(meta._replace(n_blocks=jnp.int32(2), tiles=plan(meta, 4)))
        assert not np.array_equal(np.asarray(short), np.asarray(want)), f"{msg} {impl}: a 2-block scan saw every row"


def test_candidate_mode_matches_reference():
    rng, msg = seeded_rng()
    q, w, keys, meta = make_case(rng)
    T = q.shape[0]
    cand = np.full((T, 3), -1, np.int32)
    for t in range(T):
        n = int(rng.integers(0, 4))
        cand[t, :n] = rng.choice(5, n, replace=False)
    cand = jnp.asarray(cand)
    want, _ = ix.reference(q, w, keys, meta, k=8, candidates_TK=cand)
    ok_rows = np.asarray(want) >= 0
    in_cand = (np.asarray(want) // RPB)[..., None] == np.asarray(cand)[:, None, :]
    assert in_cand.any(-1)[ok_rows].all(), f"{msg}: a selected row lies outside its candidate blocks"
    for impl in ("xla", "pallas"):
        for tiles in (None, plan(meta, 4)):
            got, _ = ix.index_topk(q, w, keys, meta._replace(tiles=tiles), k=8, candidates_TK=cand, impl=impl)
            _eq(got, want, f"{msg} {impl} tiles={tiles is not None}")


def test_reference_agrees_with_model_indexer():
    from dsv41.layers.indexer import index_scores, select_candidate_blocks, select_topk, topk_row_mask

    rng, msg = seeded_rng()
    q, w, keys, meta = make_case(rng, quantized=False)
    meta = meta._replace(req_T=jnp.zeros_like(meta.req_T))
    ids, cblocks = ix.reference(q, w, keys, meta, k=8, n_cand_blocks=2)
    flat = keys[meta.block_table_RM[0]].reshape(-1, C)
    N = flat.shape[0]
    s = jnp.where(jnp.arange(N)[None] < meta.n_visible_T[:, None], index_scores(q, w, flat), -jnp.inf)
    _eq(ids, select_topk(s, 8), msg)
    rows = np.asarray(select_candidate_blocks(s, meta.n_visible_T, 2, 8))
    mine = np.repeat(np.asarray(topk_row_mask(cblocks, N // 8)), 8, axis=1)
    _eq(mine, rows, msg + " candidate blocks")


@pytest.mark.parametrize("mode", ["dense", "candidates"])
def test_lowers_for_cuda_at_v41_sizes(mode):
    S = jax.ShapeDtypeStruct
    T = 4
    meta = ix.IndexMeta(S((T,), jnp.int32), S((T,), jnp.int32), S((2, 64), jnp.int32))
    args = (S((T, 32, 128), jnp.bfloat16), S((T, 32), jnp.float32), S((128, 256, 68), jnp.uint8), meta)
    if mode == "dense":
        text = lowering.lower_for_cuda(ix.pallas, *args, k=512, n_cand_blocks=2048, interpret=False)
    else:
        fn = lambda *a: ix.pallas(*a[:4], k=512, candidates_TK=a[4], interpret=False)
        text = lowering.lower_for_cuda(fn, *args, S((T, 2048), jnp.int32))
    assert lowering.count_gpu_kernels(text) == 1
