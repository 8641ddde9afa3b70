"""Indexer selection pieces against brute force, and the ratio-2 compressor's open-group tail."""

import jax.numpy as jnp
import numpy as np
import pytest

from dsv41.layers.compressor import Compressor
from dsv41.layers.indexer import causal_row_mask, select_candidate_blocks, select_topk, topk_row_mask


def _brute_candidates(scores, visible, K, bs):
    T, N = scores.shape
    out = np.zeros((T, N), bool)
    for t in range(T):
        nv = -(-visible[t] // bs)
        if nv == 0:
            continue
        blocks = [(np.inf if b == nv - 1 else scores[t, b * bs:min((b + 1) * bs, visible[t])].max(), b)
                  for b in range(nv)]
        blocks.sort(key=lambda sb: (-sb[0], sb[1]))  # by score, ties to the lower block
        for _, b in blocks[:K]:
            out[t, b * bs:min((b + 1) * bs, N)] = True
    return out


@pytest.mark.parametrize("seed", range(4))
def test_candidate_blocks_match_brute_force(seed):
    rng = np.random.default_rng(seed)
    T, N, K, bs = 30, 29, 3, 4  # N not a multiple of the block size
    positions = np.arange(T)
    visible = np.minimum(positions + 1, N)
    scores = np.round(rng.standard_normal((T, N)), 1).astype(np.float32)  # rounding makes ties
    scores[rng.random((T, N)) < 0.2] = 0.0
    masked = np.where(np.arange(N)[None] < visible[:, None], scores, -np.inf)
    got = np.asarray(select_candidate_blocks(jnp.asarray(masked), jnp.asarray(visible), K, bs))
    want = _brute_candidates(scores, visible, K, bs)
    np.testing.assert_array_equal(got & (np.arange(N)[None] < visible[:, None]), want & (np.arange(N)[None] < visible[:, None]))
    # No-op while a query sees at most K blocks: every visible row is a candidate.
    few = visible <= K * bs
    assert np.all(got[few] | ~(np.arange(N)[None] < visible[few, None]))
    # Restricting above: exactly K blocks' rows (at most K * bs rows), the newest block always in.
    for t in np.flatnonzero(~few):
        assert got[t, :visible[t]].sum() <= K * bs and got[t, visible[t] - 1]


def test_topk_marks_missing_rows():
    s = jnp.asarray([[1.0, -jnp.inf, 3.0, -jnp.inf], [-jnp.inf] * 4])
    idx = np.asarray(select_topk(s, 3))
    assert idx[0].tolist() == [2, 0, -1] and idx[1].tolist() == [-1, -1, -1]
    m = np.asarray(topk_row_mask(jnp.asarray(idx), 4))
    assert m.tolist() == [[True, False, True, False], [False] * 4]
    vis = np.asarray(causal_row_mask(jnp.arange(5), 3, 2))
    assert vis.sum(1).tolist() == [0, 1, 1, 2, 2]  # row j visible iff j < (p + 1) // 2


@pytest.mark.parametrize("chunks", [(1,) * 13, (3, 3, 3, 3, 1), (7, 6), (2, 5, 1, 5)])
def test_ratio2_tail_chunking_equals_one_shot(chunks):
    comp = Compressor(16, 8, 2, 1e-6, dtype=jnp.float32)
    rng = np.random.default_rng(0)
    kv = jnp.asarray(rng.standard_normal((13, 8)), jnp.float32)
    gate = jnp.asarray(rng.standard_normal((13, 8)), jnp.float32)
    one_shot = np.asarray(comp.pool(kv, gate))
    rows, tail, start = [], None, 0
    for n in chunks:
        r, tail = comp.pool_chunk(kv[start:start + n], gate[start:start + n], start, tail)
        rows.append(np.asarray(r))
        start += n
    np.testing.assert_allclose(np.concatenate(rows), one_shot, rtol=1e-6, atol=1e-6)
    assert tail is not None and np.array_equal(np.asarray(tail[0]), np.asarray(kv[12]))  # 13 is odd: open group
    with pytest.raises(ValueError, match="tail is required"):
        comp.pool_chunk(kv[3:5], gate[3:5], 3, None)
