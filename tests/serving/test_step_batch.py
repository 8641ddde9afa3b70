"""The typed step contract built on the host (`batch.build_step` -> `StepBatch`): rows, kept rows (decoder
replay), tiles, prompt-logprob targets and trip counts follow from the chunks, checked as invariants."""

import jax
import numpy as np
import pytest

from serving.runtime.batch import Buckets, SeqChunk, build_step, token_ladder
from serving.runtime.step import PackedBatch, StepBatch, unpacked

W, BS, TILE = 8, 8, 4
BUCKETS = Buckets((8, 16, 32, 64), max_num_seqs=4, tile=TILE)


def _tokens(n, seed=0):
    return [int(t) for t in np.random.default_rng(seed).integers(3, 500, n)]


def _step(chunks, **kw) -> StepBatch:
    return build_step(chunks, BUCKETS, max_blocks=8, window=W, block_size=BS, **kw)


@pytest.fixture
def chunks():
    a = SeqChunk(slot=2, block_table=[5, 1, 7], token_ids=_tokens(20, 1), start=0, end=20, trim=True)
    b = SeqChunk(slot=0, block_table=[3, 4, 6, 0, 2], token_ids=_tokens(31, 2), start=30, end=31, kv_floor=16,
                 write_floor=24, trim=True)
    c = SeqChunk(slot=1, block_table=[2], token_ids=_tokens(6, 3), start=0, end=5, prompt_logprobs=True)
    return [a, b, c]


def test_rows_requests_and_kept_rows(chunks):
    a, b, c = chunks
    s = _step(chunks)
    rows, kept, req = s.rows, s.kept, s.requests
    assert rows.ids_T.shape == (32,) and kept.row_K.shape == (16,)  # 26 rows -> 32; 8 + 1 + 5 kept -> 16
    n = sum(ch.num_tokens for ch in chunks)
    assert rows.valid_T.sum() == n and not rows.valid_T[n:].any()
    for r, ch in enumerate(chunks):
        sl = slice(rows.first_R[r], rows.first_R[r] + rows.qlen_R[r])
        assert list(rows.pos_T[sl]) == list(range(ch.start, ch.end)) and (rows.req_T[sl] == r).all()
        assert list(rows.ids_T[sl]) == list(ch.token_ids[ch.start:ch.end])
        assert (req.slot_R[r], req.start_R[r], req.end_R[r]) == (ch.slot, ch.start, ch.end)
        assert list(req.block_table_RM[r, :len(ch.block_table)]) == list(ch.block_table)
    # decoder replay: a's last W rows, b's decode row, every row of c (prompt logprobs keep them all)
    assert list(kept.qlen_R[:3]) == [W, 1, 5]
    for r in range(3):
        ks = kept.row_K[kept.first_R[r]:kept.first_R[r] + kept.qlen_R[r]]
        assert (rows.req_T[ks] == r).all() and list(rows.pos_T[ks]) == list(range(chunks[r].end - kept.qlen_R[r],
                                                                                    chunks[r].end))
        assert kept.logit_row_R[r] == kept.first_R[r] + kept.qlen_R[r] - 1
    assert kept.valid_K.sum() == W + 1 + 5
    assert list(req.decoder_floor_R[:3]) == [20 - W, max(16, 31 - W), 0]
    assert (req.kv_floor_R[1], req.write_floor_R[1]) == (16, 24)


def test_tiles_cover_each_request_row_once(chunks):
    s = _step(chunks)
    for view, T in ((s.rows, 32), (s.kept, 16)):
        t = view.tiles
        assert t.size == TILE and t.count == BUCKETS.tiles(T)
        covered = np.zeros(T, int)
        for i in range(t.count):
            r, f, k = t.req_N[i], t.first_N[i], t.n_N[i]
            covered[f:f + k] += 1
            assert k == 0 or view.first_R[r] <= f and f + k <= view.first_R[r] + view.qlen_R[r]
        n = int(view.qlen_R.sum())
        assert (covered[:n] == 1).all() and not covered[n:].any()


def test_decode_buckets_tile_each_row_alone():
    """A bucket a decode batch fits (<= max_num_seqs rows) tiles each row alone: no padding rows in the tiles."""
    buckets = Buckets((4, 8), max_num_seqs=4, tile=TILE)
    chunks = [SeqChunk(slot=r, block_table=[r], token_ids=_tokens(5, r), start=4, end=5) for r in range(3)]
    t = build_step(chunks, buckets, max_blocks=8, window=W, block_size=BS).rows.tiles
    assert t.size == 1 and t.count == 4 and list(t.n_N) == [1, 1, 1, 0] and list(t.first_N[:3]) == [0, 1, 2]
    assert build_step(chunks, buckets, max_blocks=8, window=W, block_size=BS, token_bucket=8).rows.tiles.size == TILE


def test_prompt_logprob_targets_and_trip_counts(chunks):
    a, b, c = chunks
    s = _step(chunks)
    kept = s.kept
    nxt = kept.prompt_next_K[kept.first_R[2]:kept.first_R[2] + 5]
    assert list(nxt) == list(c.token_ids[1:6])  # the known next token of every row of c (its 6th is known)
    others = np.ones(16, bool)
    others[kept.first_R[2]:kept.first_R[2] + 5] = False
    assert (kept.prompt_next_K[others] == -1).all()  # chunks not asking (and padding) have no targets
    # the dense indexer scans the blocks of the longest context (31 positions): ratio 1 -> 4 blocks of 8 rows,
    # ratio 2 -> 15 rows in blocks of 4 -> 4 blocks; V4's ratio 4 -> 7 rows in blocks of 2 -> 4, ratio 128 -> none
    assert list(s.index_blocks_2) == [4, 4, 4, 0]


def test_segments_see_only_their_part(chunks):
    s = _step(chunks)
    one, two = s.segment1(), s.segment2()
    assert one.kept is None and one.rows is s.rows and two.rows is None and two.kept is s.kept
    leaves1, leaves2 = jax.tree.leaves(one), jax.tree.leaves(two)
    assert all(isinstance(x, np.ndarray) for x in leaves1 + leaves2)
    assert not any(x is y for x in leaves1 for y in jax.tree.leaves(s.kept))
    assert not any(x is y for x in leaves2 for y in jax.tree.leaves(s.rows))


def test_bad_chunks_are_refused(chunks):
    a, b, c = chunks
    with pytest.raises(ValueError, match="prompt logprobs need every row kept"):
        _step([SeqChunk(slot=0, block_table=[0], token_ids=[1, 2, 3], start=0, end=3, trim=True,
                        prompt_logprobs=True)])
    with pytest.raises(ValueError, match="do not cover 20 positions"):
        _step([SeqChunk(slot=0, block_table=[0, 1], token_ids=_tokens(20), start=0, end=20)])
    with pytest.raises(ValueError, match="exceed max_num_seqs"):
        _step(chunks + chunks)
    with pytest.raises(ValueError, match="outside its"):
        _step([SeqChunk(slot=0, block_table=[0], token_ids=[1, 2], start=0, end=3)])


def test_packed_batch_round_trips_in_one_int32_array(chunks):
    """Two ranks' segment-1 batches packed into one [2, N] int32 array (a float array rides beside it): unpacked
    on the host, and per rank inside a jitted function (the rank dimension dropped as the runner's wrappers do),
    every array comes back with its values, shape and dtype."""
    one = _step(chunks).segment1()
    two = jax.tree.map(lambda a: np.stack([a, (a + 1).astype(a.dtype) if a.dtype != bool else ~a]), one)
    tree = {"batch": two, "scale": np.arange(6, dtype=np.float32).reshape(2, 3)}
    p = PackedBatch.pack(tree)
    assert p.packed.dtype == np.int32 and p.packed.shape[0] == 2 and len(p.others) == 1
    assert len(jax.tree.leaves(p)) == 2  # what a step transfers: two arrays, not one per field

    def same(a, b):
        assert np.asarray(a).dtype == np.asarray(b).dtype and np.array_equal(np.asarray(a), np.asarray(b))

    jax.tree.map(same, unpacked(p), tree)
    for r in range(2):
        got = jax.jit(lambda q, r=r: unpacked(jax.tree.map(lambda a: a[r], q)))(p)
        jax.tree.map(same, got, jax.tree.map(lambda a: a[r], tree))


def test_a_pending_token_names_the_previous_steps_row(chunks):
    """Async scheduling: a decode chunk whose token is still on the device has a placeholder id and, in prev_T, the
    previous step's sampled row to read; every other row reads its own id (-1). It must be the chunk's last
    position."""
    a, b, _ = chunks
    toks = _tokens(31, 2)
    pending = SeqChunk(slot=0, block_table=[3, 4, 6, 0, 2], token_ids=toks[:30], start=30, end=31, pending_row=3)
    assert pending.num_known == 31 and pending.num_draft == 0 and pending.tokens(29, 31) == [toks[29], 0]
    rows = _step([a, pending]).rows
    assert rows.prev_T.tolist() == [-1] * 20 + [3] + [-1] * (len(rows.prev_T) - 21)
    assert rows.ids_T[20] == 0 and rows.ids_T[:20].tolist() == a.token_ids
    known = _step([a, b]).rows
    assert (known.prev_T == -1).all() and known.ids_T[20] == toks[30]
    with pytest.raises(ValueError, match="pending token must be the chunk's last position"):
        _step([SeqChunk(slot=0, block_table=[0], token_ids=[1, 2], start=0, end=2, pending_row=0)])


def test_engram_ids_of_a_step_are_each_sequences_hash_ids():
    """V4.1: a step hashes all its rows at once; each chunk's rows get the ids its whole sequence hashes to (a chunk
    starting mid-sequence looks back into tokens it does not compute, a short prompt into the padding), and a
    pending row gets its look-back instead (its ids are finished on the device), the others zeros."""
    from dsv41.config import ModelConfig
    from dsv41.layers.engram import EngramLayout, ngram_windows
    from serving.runtime.batch import EngramHashing

    c = ModelConfig.preset("tiny")
    layout, token_map = EngramLayout.from_config(c), np.random.default_rng(0).integers(0, 500, c.vocab_size)
    toks = [_tokens(20, 1), _tokens(31, 2), _tokens(2, 3)]
    chunks = [SeqChunk(slot=2, block_table=[5, 1, 7], token_ids=toks[0], start=12, end=20),
              SeqChunk(slot=0, block_table=[3, 4, 6, 0, 2], token_ids=toks[1][:30], start=30, end=31, pending_row=1),
              SeqChunk(slot=1, block_table=[2], token_ids=toks[2], start=0, end=2)]
    rows = _step(chunks, engram=EngramHashing(layout, token_map)).rows
    np.testing.assert_array_equal(rows.engram_TEc[:8], layout.hash_ids(toks[0], token_map, start=12))
    np.testing.assert_array_equal(rows.engram_TEc[9:11], layout.hash_ids(toks[2], token_map))
    assert not rows.engram_TEc[11:].any()
    want = layout.look_back(ngram_windows(toks[1], 30, c.engram_max_ngram_size)[:, 1:], token_map)
    np.testing.assert_array_equal(rows.engram_look_back_RLS2[1], want[0])
    assert not rows.engram_look_back_RLS2[[0, 2, 3]].any()


def test_the_token_ladder_keeps_the_buckets_padding_would_cost():
    """Decode: the smallest, then powers of two from 8 up to max_num_seqs; prefill: the window, 4x it, then doubling
    to the budget (docs/design/measurements.md, "Token buckets")."""
    assert token_ladder(512, 128, smallest=2, max_seqs=32) == (2, 8, 16, 32, 128, 512)  # the default budget, bf16
    assert token_ladder(1024, 128, smallest=1, max_seqs=32) == (1, 8, 16, 32, 128, 512, 1024)
    assert token_ladder(8192, 128, smallest=1, max_seqs=256) == (1, 8, 16, 32, 64, 128, 512, 1024, 2048, 4096, 8192)
    assert token_ladder(2048, 128, smallest=1, max_seqs=12) == (1, 8, 12, 128, 512, 1024, 2048)
    assert token_ladder(64, 128, smallest=1, max_seqs=32) == (1, 8, 16, 32, 64)  # a budget under the window
    assert token_ladder(4, 128, smallest=2, max_seqs=4) == (2, 4)
    assert token_ladder(512, 128, smallest=2, max_seqs=32, kept=True) == (2, 8, 16, 32, 128, 256, 512)
    assert token_ladder(2048, 128, smallest=1, max_seqs=32, kept=True) == (1, 8, 16, 32, 128, 256, 512, 1024, 2048)


def test_kept_rows_have_their_own_buckets_ending_at_the_largest_token_bucket():
    b = Buckets((8, 64), max_num_seqs=4, tile=TILE, kept=(8, 32, 64))
    assert (b.token_bucket(20), b.kept_bucket(20)) == (64, 32) and Buckets((8, 64), 4, TILE).kept == (8, 64)
    with pytest.raises(ValueError, match="65 kept rows exceed the largest kept-row bucket 64"):
        b.kept_bucket(65)
    with pytest.raises(ValueError, match="must end at the largest token bucket 64"):
        Buckets((8, 64), max_num_seqs=4, tile=TILE, kept=(8, 32))
