"""BlockManager: counts, prefix hits with chained hashes, sharing, LRU eviction, atomic allocate,
and a seeded randomized stress test that checks every invariant after every operation."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence

import pytest

from serving.runtime.block_manager import BlockManager, PrefixHit, chain_hashes

BS = 4


def prefill(bm: BlockManager, req_id: object, tokens: Sequence[int], extra_key: bytes = b"") -> PrefixHit:
    """lookup -> admit -> allocate -> commit, the way a scheduler runs a whole prompt."""
    hit = bm.lookup(tokens, extra_key)
    bm.admit(req_id, tokens, hit, extra_key)
    assert bm.allocate(req_id, len(tokens))
    bm.commit(req_id, tokens, len(tokens))
    return hit


# ---- 1. basics --------------------------------------------------------------------------------
def test_allocate_free_counts():
    bm = BlockManager(num_blocks=10, block_size=BS)
    assert (bm.num_blocks, bm.block_size, bm.num_free_blocks, bm.usage) == (10, BS, 10, 0.0)
    bm.admit("a", list(range(9)))
    assert bm.block_table("a") == []
    assert bm.allocate("a", 9)
    assert len(bm.block_table("a")) == 3 and bm.num_free_blocks == 7
    assert bm.usage == pytest.approx(0.3)
    assert bm.allocate("a", 12) and bm.allocate("a", 5) and bm.allocate("a", 0)  # covered: no-ops
    assert len(bm.block_table("a")) == 3
    assert bm.allocate("a", 13) and len(bm.block_table("a")) == 4
    assert len(set(bm.block_table("a"))) == 4
    bm.admit("b", [1])
    assert bm.allocate("b", 4 * BS) and bm.num_free_blocks == 2
    bm.free("a")
    assert bm.num_free_blocks == 6
    bm.free("b")
    assert bm.num_free_blocks == 10 and bm.usage == 0.0


def test_errors_name_the_problem():
    bm = BlockManager(4, BS)
    bm.admit("a", [1, 2, 3])
    with pytest.raises(ValueError, match="already live"):
        bm.admit("a", [1, 2, 3])
    for call in (lambda: bm.block_table("x"), lambda: bm.allocate("x", 4), lambda: bm.free("x"),
                 lambda: bm.commit("x", [1], 1)):
        with pytest.raises(KeyError, match="unknown req_id"):
            call()
    with pytest.raises(ValueError, match="num_computed"):
        bm.commit("a", [1, 2, 3], 3)  # nothing allocated yet
    with pytest.raises(ValueError, match="num_tokens"):
        bm.allocate("a", -1)
    with pytest.raises(ValueError):
        BlockManager(0, BS)


def test_lookup_hits_full_committed_blocks_only():
    bm = BlockManager(16, BS)
    tokens = list(range(100, 110))  # 2 full blocks + a partial one
    assert prefill(bm, "a", tokens).num_tokens == 0
    table = bm.block_table("a")
    assert bm.lookup(tokens) == PrefixHit(8, tuple(table[:2]))
    assert bm.lookup(tokens + [7, 7, 7, 7]) == PrefixHit(8, tuple(table[:2]))  # partial block never hits
    assert bm.lookup(tokens[:7]) == PrefixHit(4, (table[0],))
    assert bm.lookup(tokens[:3]).num_tokens == 0
    assert bm.lookup([]) == PrefixHit(0, ())
    # Only what commit covered is registered.
    bm.admit("b", list(range(200, 212)))
    assert bm.allocate("b", 12)
    bm.commit("b", list(range(200, 212)), 7)
    assert bm.lookup(list(range(200, 212))).num_tokens == 4
    bm.commit("b", list(range(200, 212)), 7)  # idempotent
    bm.commit("b", list(range(200, 212)), 12)
    assert bm.lookup(list(range(200, 212))) == PrefixHit(12, tuple(bm.block_table("b")))
    # stats are counted in tokens
    bm2 = BlockManager(8, BS)
    prefill(bm2, "a", tokens)
    bm2.lookup(tokens)
    assert (bm2.stats.queries, bm2.stats.hits) == (2 * len(tokens), 8)


def test_hit_stops_at_first_different_block_and_chains():
    bm = BlockManager(16, BS)
    x0, x1, x2 = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    prefill(bm, "a", x0 + x1 + x2)
    table = bm.block_table("a")
    y1 = [5, 6, 7, 99]
    assert bm.lookup(x0 + y1 + x2) == PrefixHit(4, (table[0],))  # x2 after a different prefix: no hit
    assert bm.lookup([0, 2, 3, 4] + x1 + x2).num_tokens == 0
    assert bm.lookup(x1 + x2).num_tokens == 0  # same contents at a different position
    assert bm.lookup(x0 + x1 + x2, extra_key=b"lora").num_tokens == 0  # salted root
    assert bm.lookup(x0 + x1 + x2).num_tokens == 12


def test_caching_disabled_never_hits():
    bm = BlockManager(16, BS, enable_prefix_caching=False)
    tokens = list(range(16))
    for rid in range(3):
        assert prefill(bm, rid, tokens).num_tokens == 0
    assert bm.lookup(tokens) == PrefixHit(0, ())
    for rid in range(3):
        bm.free(rid)
    snap = bm.snapshot()
    assert bm.lookup(tokens).num_tokens == 0 and len(snap.free) == 16 and not snap.evictable


def test_duplicate_contents_keep_existing_mapping():
    bm = BlockManager(16, BS)
    tokens = list(range(8))
    for rid in ("a", "b"):  # both computed the prompt before either committed
        bm.admit(rid, tokens)
        assert bm.allocate(rid, 8)
    bm.commit("a", tokens, 8)
    bm.commit("b", tokens, 8)
    assert bm.lookup(tokens).block_ids == tuple(bm.block_table("a"))
    snap = bm.snapshot()
    assert all(snap.block_hashes[b] is None for b in bm.block_table("b")) and len(snap.cached) == 2
    bm.free("b")  # unhashed blocks go straight back to the free pool
    assert not bm.snapshot().evictable and bm.num_free_blocks == 14


def test_stale_hit_is_rejected():
    bm = BlockManager(2, BS)
    tokens = list(range(4))
    prefill(bm, "a", tokens)
    bm.free("a")
    hit = bm.lookup(tokens)
    assert hit.num_tokens == 4
    bm.admit("b", [9])
    assert bm.allocate("b", 8)  # evicts the cached block
    with pytest.raises(ValueError, match="stale"):
        bm.admit("c", tokens, hit)
    assert "c" not in bm.snapshot().tables


def test_reset_prefix_cache():
    bm = BlockManager(8, BS)
    prefill(bm, "a", list(range(8)))
    assert not bm.reset_prefix_cache()  # referenced
    bm.free("a")
    assert bm.lookup(list(range(8))).num_tokens == 8
    assert bm.reset_prefix_cache()
    assert bm.lookup(list(range(8))).num_tokens == 0 and bm.num_free_blocks == 8 and not bm.snapshot().cached


# ---- 2. sharing and LRU eviction ---------------------------------------------------------------
def test_sharing_prefix_blocks():
    bm = BlockManager(16, BS)
    prefix = list(range(8))
    prefill(bm, "a", prefix + [50, 51])
    hit = prefill(bm, "b", prefix + [60, 61, 62])
    assert hit.num_tokens == 8
    a, b = bm.block_table("a"), bm.block_table("b")
    assert a[:2] == b[:2] and a[2] != b[2]
    assert [bm.snapshot().ref_counts[x] for x in a[:2]] == [2, 2]
    assert bm.num_free_blocks == 16 - 4
    bm.free("a")
    assert [bm.snapshot().ref_counts[x] for x in b] == [1, 1, 1] and bm.num_free_blocks == 16 - 3
    assert bm.lookup(prefix).block_ids == tuple(b[:2])
    bm.free("b")
    assert bm.num_free_blocks == 16 and bm.lookup(prefix).block_ids == tuple(b[:2])
    # A hit on evictable blocks revives them: they leave the evictable set.
    prefill(bm, "c", prefix)
    assert bm.block_table("c") == b[:2] and not set(b[:2]) & set(bm.snapshot().evictable)
    assert bm.num_free_blocks == 14


def test_lru_eviction_order():
    bm = BlockManager(6, block_size=2)
    p, q = [1, 2, 3, 4], [5, 6, 7, 8]
    prefill(bm, "p", p)
    pb = bm.block_table("p")
    bm.free("p")
    prefill(bm, "q", q)
    qb = bm.block_table("q")
    bm.free("q")
    assert not set(pb) & set(qb)
    bm.admit("r", [0])
    # Never-cached free blocks first: nothing is evicted.
    assert bm.allocate("r", 4)
    assert not set(bm.block_table("r")) & set(pb + qb)
    assert bm.lookup(p).num_tokens == 4 and bm.lookup(q).num_tokens == 4
    # Then the least recently freed cached block, chain tail first.
    expected = [pb[1], pb[0], qb[1], qb[0]]
    hits_after = [(2, 4), (0, 4), (0, 2), (0, 0)]
    for i, (want_block, (hp, hq)) in enumerate(zip(expected, hits_after)):
        assert bm.allocate("r", 6 + 2 * i)
        assert bm.block_table("r")[-1] == want_block
        assert bm.snapshot().block_hashes[want_block] is None
        assert (bm.lookup(p).num_tokens, bm.lookup(q).num_tokens) == (hp, hq)
    assert bm.num_free_blocks == 0 and not bm.allocate("r", 13)


# ---- 3. atomic allocate ------------------------------------------------------------------------
def test_failed_allocate_changes_nothing():
    bm = BlockManager(8, BS)
    prefill(bm, "a", list(range(12)))
    prefill(bm, "b", list(range(8)) + [40, 41, 42, 43])  # shares 2 blocks with "a"
    bm.free("a")  # "a"'s own block becomes evictable
    bm.admit("c", [1, 2, 3])
    assert bm.allocate("c", 4)
    assert bm.num_free_blocks == 4
    before = bm.snapshot()
    assert not bm.allocate("c", 4 + 5 * BS)
    assert not bm.allocate("c", 4 + 4 * BS + 1)
    assert bm.snapshot() == before
    assert bm.allocate("c", 4 + 4 * BS) and bm.num_free_blocks == 0


# ---- 4. randomized stress ----------------------------------------------------------------------
class _Req:
    def __init__(self, tokens: list[int], key: bytes, computed: int):
        self.tokens, self.key, self.computed = tokens, key, computed
        self.pid: list[int] = []  # pid[p] identifies (key, tokens[:p+1]): what KV row p depends on
        self._extend_pid()

    def _extend_pid(self) -> None:
        prev = hash(self.key) if not self.pid else self.pid[-1]
        for t in self.tokens[len(self.pid):]:
            prev = hash((prev, t))
            self.pid.append(prev)

    def append(self, token: int) -> None:
        self.tokens.append(token)
        self._extend_pid()


def _check(bm: BlockManager, live: dict[int, _Req], kv: dict[tuple[int, int], int],
           origin: dict[int, tuple[bytes, tuple[int, ...]]]) -> None:
    nb, bs, snap = bm.num_blocks, bm.block_size, bm.snapshot()
    assert set(snap.tables) == set(live)
    counts = Counter(b for t in snap.tables.values() for b in t)
    for rid, table in snap.tables.items():
        assert tuple(bm.block_table(rid)) == table and len(set(table)) == len(table)
        assert len(table) * bs >= live[rid].computed
    assert all(snap.ref_counts[b] == counts[b] for b in range(nb))
    free, evictable = list(snap.free), list(snap.evictable)
    referenced = {b for b in range(nb) if snap.ref_counts[b] > 0}
    assert len(set(free)) == len(free) and not set(free) & set(evictable)
    assert not (set(free) | set(evictable)) & referenced
    assert len(free) + len(evictable) + len(referenced) == nb
    assert bm.num_free_blocks == len(free) + len(evictable) == nb - len(referenced)
    assert bm.usage == pytest.approx(len(referenced) / nb)
    assert all(snap.block_hashes[b] is None for b in free) and all(snap.block_hashes[b] is not None for b in evictable)
    hashed = {b: h for b, h in enumerate(snap.block_hashes) if h is not None}
    assert {h: b for b, h in hashed.items()} == snap.cached and len(hashed) == len(snap.cached)
    if not bm.enable_prefix_caching:
        assert not hashed
    # Every stored hash is the chain hash of the tokens of the request that committed the block.
    for b in list(origin):
        if snap.block_hashes[b] is None:
            del origin[b]
    assert set(origin) == set(hashed)
    for b, (key, toks) in origin.items():
        assert snap.block_hashes[b] == chain_hashes(toks, bs, key)[-1]
    # Simulated device: every live request reads back the KV of its own prefix.
    for rid, r in live.items():
        table = snap.tables[rid]
        for p in range(r.computed):
            assert kv[table[p // bs], p % bs] == r.pid[p], (rid, p)


@pytest.mark.parametrize("seed,caching", [(0, True), (1, True), (2, True), (3, False)])
def test_randomized_stress(seed: int, caching: bool):
    rng = random.Random(seed)
    bm = BlockManager(num_blocks=40, block_size=BS, enable_prefix_caching=caching)
    vocab = 3  # tiny: identical block contents after different prefixes are common
    prefixes = [[rng.randrange(vocab) for _ in range(n)] for n in (0, 5, 12, 21)]
    keys = [b"", b"", b"salt"]
    live: dict[int, _Req] = {}
    kv: dict[tuple[int, int], int] = {}
    origin: dict[int, tuple[bytes, tuple[int, ...]]] = {}
    n_hit_admits = 0

    def compute(rid: int, target: int) -> None:
        r, table = live[rid], bm.block_table(rid)
        for p in range(r.computed, target):
            kv[table[p // BS], p % BS] = r.pid[p]
        r.computed = target
        hashes = bm.snapshot().block_hashes
        for b in [b for b in origin if hashes[b] is None]:  # evicted by the allocate just before
            del origin[b]
        bm.commit(rid, r.tokens, target)
        hashes = bm.snapshot().block_hashes
        for i, b in enumerate(table[:target // BS]):
            if hashes[b] is not None and b not in origin:
                origin[b] = (r.key, tuple(r.tokens[:(i + 1) * BS]))

    for _ in range(3000):
        rid = rng.randrange(20)
        x = rng.random()
        if rid not in live:
            if x < 0.6:
                key = rng.choice(keys)
                tokens = rng.choice(prefixes) + [rng.randrange(vocab) for _ in range(rng.randrange(1, 14))]
                hit = bm.lookup(tokens, key) if x < 0.5 else None
                if hit is not None:
                    assert hit.num_tokens % BS == 0 and len(hit.block_ids) * BS == hit.num_tokens
                    for i, b in enumerate(hit.block_ids):  # the hit's rows hold a prefix of the query
                        assert origin[b] == (key, tuple(tokens[:(i + 1) * BS]))
                    n_hit_admits += hit.num_tokens > 0
                    if rng.random() < 0.2:  # a scheduler may use fewer blocks than the hit offers
                        k = rng.randrange(len(hit.block_ids) + 1)
                        hit = PrefixHit(k * BS, hit.block_ids[:k])
                bm.admit(rid, tokens, hit, key)
                live[rid] = _Req(tokens, key, hit.num_tokens if hit else 0)
            elif x < 0.62:
                in_use = any(bm.snapshot().tables.values())  # live requests with empty tables hold nothing
                assert bm.reset_prefix_cache() is (not in_use)
        elif x < 0.55:  # a prefill chunk, or one decode step once the prompt is done
            r = live[rid]
            if r.computed == len(r.tokens):
                r.append(rng.randrange(vocab))
            target = min(len(r.tokens), r.computed + rng.randrange(1, 3 * BS))
            need = -(-target // BS) - len(bm.block_table(rid))
            fits = need <= bm.num_free_blocks
            before = None if fits else bm.snapshot()
            ok = bm.allocate(rid, target)
            assert ok is fits
            if ok:
                compute(rid, target)
            else:
                assert bm.snapshot() == before
        elif x < 0.6:  # a no-op allocate and an idempotent commit
            r = live[rid]
            table_before = bm.block_table(rid)
            assert bm.allocate(rid, rng.randrange(len(table_before) * BS + 1))
            assert bm.block_table(rid) == table_before
            before = bm.snapshot()
            bm.commit(rid, r.tokens, r.computed)
            assert bm.snapshot() == before
        elif x < 0.8:
            bm.free(rid)
            del live[rid]
        else:
            other = rng.choice(list(live))
            r = live[other]
            hit = bm.lookup(r.tokens, r.key)
            lead = 0  # the request's own leading committed blocks that carry a hash must all hit
            hashes = bm.snapshot().block_hashes
            for b in bm.block_table(other)[:r.computed // BS]:
                if hashes[b] is None:
                    break
                lead += 1
            assert hit.num_tokens >= lead * BS
            for i, b in enumerate(hit.block_ids):
                assert origin[b] == (r.key, tuple(r.tokens[:(i + 1) * BS]))
        _check(bm, live, kv, origin)

    if caching:
        assert n_hit_admits > 50 and bm.stats.hits > 0
    else:
        assert n_hit_admits == 0 and bm.stats.hits == 0
    for rid in list(live):
        bm.free(rid)
        del live[rid]
    _check(bm, live, kv, origin)
    assert bm.num_free_blocks == bm.num_blocks and bm.reset_prefix_cache()
