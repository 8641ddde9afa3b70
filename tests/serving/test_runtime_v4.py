"""V4-Flash through the serving runtime (the tiny V4 oracle config, random weights, float32): CSA (ratio 4,
overlapping windows) and HCA (ratio 128) global KV written as windows close from per-slot compressor state,
the V4 indexer, hash-routed layers and hc_head. Replay off == the exact full-sequence forward for any chunking,
decode and prefix hit; replay on == the bounded reference; nothing is trimmed (no CED cut)."""

import jax
import numpy as np
import pytest

import dsv41
from dsv41.bounded import bounded_logits
from dsv41.config import load_config
from serving.runtime.config import RuntimeConfig
from serving.runtime.exe_cache import ExecutableCacheSettings
from serving.runtime.runner import Runner
from serving.runtime.programs import Program
from tests.full_logits import full_logits
from tests.serving.driver import Driver, compiled_runner
from tests.serving.test_runtime import TOL, _max_err, _run, cache_copies
from tests.serving.test_runtime import _prompt as runtime_prompt

CONFIG = "tests/fixtures/oracle/v4_tiny/config.json"  # 4 layers: SWA (hash-routed), CSA, HCA, CSA; window 8
RC = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=512, token_buckets=(8, 64))


@pytest.fixture(scope="module")
def model():
    return dsv41.random_model(load_config(CONFIG), seed=1)


@pytest.fixture(scope="module")
def exact(model):
    return compiled_runner(model, **RC, swa_bounded_replay=False)


@pytest.fixture(scope="module")
def bounded(model):
    return compiled_runner(model, **RC, swa_bounded_replay=True)


def _prompt(seed, n):
    return runtime_prompt(seed, n, high=250)  # the tiny V4 vocabulary has 256 ids


def _hit(d: Driver, seed: int, first_len: int, tail_len: int):
    """Prefill and release a request of first_len tokens, then start "b" = its first 256 tokens + tail_len new
    ones: (the plan of b's prefix hit, b's prompt)."""
    first = _prompt(seed, first_len)
    d.start("a", first)
    _run(d, "a", [64] * 5)
    d.finish("a")
    second = first[:256] + _prompt(seed + 1, tail_len)
    return d.start("b", second), second


def test_layout_of_a_v4_cache(model, exact):
    c = model.config
    assert [r.attn_kind for r in c.roles] == ["swa", "csa", "hca", "csa"] and c.roles[0].hash_routed
    assert exact.layout.block_size == 128  # the default: whole ratio-128 rows per block
    sh = exact.layout.shapes()
    assert sorted(sh.rows) == [1, 2, 3] and sorted(sh.keys) == [1, 3] and not sh.tail
    assert sh.pool[1].shape == (4, 8, 2, 2 * c.head_dim) and sh.pool[2].shape == (4, 128, 2, c.head_dim)
    assert sh.index_pool[3].shape == (4, 8, 2, 2 * c.index_head_dim) and 2 not in sh.index_pool


def test_cache_is_updated_in_place(exact):
    """SWA rings and the compressors' rings of raw rows (HCA's holds 128 positions a slot)."""
    assert cache_copies(exact, [p.at(n) for n in (8, 64) for p in (Program.SEGMENT1, Program.SEGMENT2)]) == []


@pytest.mark.parametrize("chunks", [[64, 64, 64, 64, 44], [7] * 43, [1] * 9 + [64] * 4 + [35], [13] * 23 + [1]])
def test_replay_off_any_chunking_equals_full_forward(model, exact, chunks):
    """300 tokens: two HCA windows close (at 127 and 255), CSA windows straddle every chunk boundary, decode
    rows close windows one token at a time."""
    d = Driver(exact)
    d.start("a", _prompt(0, 300))
    got = _run(d, "a", chunks, decode=3)
    assert _max_err(got, full_logits(model, d.reqs["a"].tokens)) <= TOL


def test_steps_of_fewer_rows_than_a_csa_window_equal_full_forward(model):
    """Steps padded to 2 rows, fewer than CSA's ratio 4: its compressors pool only in the steps where a window closes
    (`v4_kv.publish`'s cond). Two requests a row apart: most steps close a window in one of them and not the other."""
    d = Driver(compiled_runner(model, **{**RC, "token_buckets": (2, 64)}, swa_bounded_replay=False))
    prompts = {"a": _prompt(5, 11), "b": _prompt(6, 9)}
    for rid, p in prompts.items():
        d.start(rid, p)
    got = {rid: {} for rid in prompts}
    for work in [{"a": 1}] + [{"a": 1, "b": 1}] * 10:
        for rid, out in d.step({rid: n for rid, n in work.items() if d.reqs[rid].computed < len(prompts[rid])}).items():
            got[rid][d.reqs[rid].computed - 1] = out
    assert sorted(got["a"]) == list(range(11)) and sorted(got["b"]) == list(range(9))
    for rid in prompts:
        assert _max_err(got[rid], full_logits(model, d.reqs[rid].tokens)) <= TOL, rid


def test_batched_requests_equal_full_forward(model, exact):
    d = Driver(exact)
    prompts = {"a": _prompt(1, 140), "b": _prompt(2, 37), "c": _prompt(3, 129)}
    for rid, p in prompts.items():
        d.start(rid, p)
    got = {rid: {} for rid in prompts}
    while any(d.reqs[rid].computed < len(p) for rid, p in prompts.items()):
        work = {rid: 21 for rid, p in prompts.items() if d.reqs[rid].computed < len(p)}
        for rid, out in d.step(work).items():
            got[rid][d.reqs[rid].computed - 1] = out
    for rid in prompts:
        assert _max_err(got[rid], full_logits(model, d.reqs[rid].tokens)) <= TOL, rid


def test_replay_off_prefix_hit_equals_cold_run(model, exact):
    d = Driver(exact)
    plan, _ = _hit(d, 4, 270, 40)
    assert plan.hit_tokens == 256 and plan.replay_start == 256 - 4 * 7  # exact halo L * (W - 1)
    got = _run(d, "b", [64, 4], decode=2)
    assert _max_err(got, full_logits(model, d.reqs["b"].tokens), rows=range(256, 400)) <= TOL


def test_replay_on_prefix_hit_equals_bounded_reference(model, bounded):
    """Nothing is trimmed (V4 has no CED cut); the hit's rows are kept, the replayed window refills the rings."""
    d = Driver(bounded)
    plan, _ = _hit(d, 6, 300, 50)
    assert (plan.hit_tokens, plan.replay_start, plan.write_floor) == (256, 248, 256)
    hit_blocks = d.bm.block_table("b")[:2]
    paged = lambda: jax.tree.map(lambda a: np.asarray(a)[hit_blocks], bounded.cache.paged())  # noqa: E731
    before = paged()
    got = _run(d, "b", [9, 40, 9], decode=2)
    assert all(x.tobytes() == y.tobytes() for x, y in zip(before, paged(), strict=True))
    r = d.reqs["b"]
    ref = bounded_logits(model, np.array(r.tokens), chunks=r.schedule, hit_tokens=256, replay_start=248,
                         decoder_replay=False)
    assert _max_err(got, ref) <= TOL
    cold = full_logits(model, r.tokens)
    assert _max_err(got, cold, rows=range(300, 310)) > 1e-3  # the bounded replay is approximate: the test can fail


@pytest.mark.filterwarnings("ignore:no program is kept in the executable cache")  # this process runs JAX's cache
def test_background_compile_serves_padded_until_its_bucket_is_ready(model, tmp_path):
    """precompile(background=True) returns once the essential buckets are compiled - the largest, and the one a decode
    of every slot takes here (max_num_seqs 4 <= compiler.FEW_ROWS) - : a 12-token step runs padded to them, then on
    its own bucket once the background thread is done - the same logits either way. The banner's executable-cache
    counts are those of the programs compiled before ready, whatever the background has looked up since."""
    r = Runner(model, RuntimeConfig(**{**RC, "token_buckets": (8, 16, 64)}, swa_bounded_replay=False), progress=False,
               executable_cache=ExecutableCacheSettings(tmp_path))
    compiler = r.compiler
    compiler.gate.idle_s = 0.0  # no engine here: compile the rest at once
    compiler.precompile(background=True)
    essential = compiler.essential_keys()
    assert set(essential) <= set(compiler.compiled_keys)
    assert essential[0] == Program.SEGMENT1.at(64) and Program.SEGMENT1.at(8) in essential  # max_num_seqs 4 -> 8
    assert Program.SEGMENT1.at(16) not in essential
    d = Driver(r)
    d.start("a", _prompt(8, 30))
    early = d.step({"a": 12})["a"]  # whichever compiled bucket >= 12 is ready now (64 at the latest)
    compiler._background.join()
    assert compiler.background_done and set(compiler.compiled_keys) == set(compiler.bucket_keys())
    assert compiler.cache_counts_at_ready == (0, len(essential))
    assert (compiler.exe_cache.hits, compiler.exe_cache.misses) == (0, len(compiler.bucket_keys()))
    assert compiler.all_compiled_at is not None
    assert compiler.fit(Program.SEGMENT1, 12, r.buckets.tokens) == 16
    late = d.step({"a": 12})["a"]
    ref = full_logits(model, d.reqs["a"].tokens)
    assert max(float(np.abs(early - ref[11]).max()), float(np.abs(late - ref[23]).max())) <= TOL


def test_the_essential_buckets_are_the_largest_and_a_decode_of_eight_rows(model):
    """Before ready: the largest bucket of each family, and the segments at a decode of eight rows
    (compiler.FEW_ROWS) - no more (the rest, the decode bucket of every slot included, compile in the background)."""
    r = Runner(model, RuntimeConfig(max_num_seqs=32, max_num_batched_tokens=512, max_model_len=512,
                                    token_buckets=(2, 8, 16, 32, 64, 512)), progress=False)
    s1, s2 = Program.SEGMENT1, Program.SEGMENT2
    assert r.compiler.essential_keys() == [s1.at(512), s2.at(512), Program.SAMPLE.at(32), s1.at(8), s2.at(8)]
