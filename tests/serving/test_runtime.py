"""The runtime against the model: replay off == the exact full-sequence forward for any chunking, decode
and prefix hit; replay on == the bounded-semantics reference (dsv41.bounded); batching independence;
release-format storage; donation; no compilation outside `precompile`."""

import jax
import numpy as np
import pytest

import dsv41
from dsv41.bounded import bounded_logits
from serving.runtime.batch import SeqChunk
from serving.runtime.config import RuntimeConfig
from serving.runtime.compiler import CompileInServingLoop
from serving.runtime.runner import Runner
from serving.runtime.programs import Program
from serving.runtime.sampling_params import SamplingParams
from tests.full_logits import full_logits
from tests.serving.driver import Driver, compiled_runner

TOL = 1e-5
# Two step sizes: every chunking below pads to one of them (fewer programs to compile; padding is covered too).
RC = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=256, block_size=8, token_buckets=(8, 32))


@pytest.fixture(scope="module")
def model():
    return dsv41.random_model("tiny", seed=1)


@pytest.fixture(scope="module")
def exact(model):
    return compiled_runner(model, **RC, swa_bounded_replay=False)


@pytest.fixture(scope="module")
def bounded(model):
    return compiled_runner(model, **RC, swa_bounded_replay=True)


def _prompt(seed, n, high=512):
    return [int(t) for t in np.random.default_rng(seed).integers(3, high, n)]


def _run(driver, rid, chunk_sizes, decode=0):
    """Prefill in chunks, then greedy decode; {position: logits} of every computed last row."""
    got = {}
    for n in chunk_sizes:
        out = driver.step({rid: n})[rid]
        got[driver.reqs[rid].computed - 1] = out
    for _ in range(decode):
        last = max(got)
        driver.append(rid, int(np.argmax(got[last])))
        got[last + 1] = driver.step({rid: 1})[rid]
    return got


def _max_err(got, ref, rows=None):
    return max(float(np.abs(v - ref[p]).max()) for p, v in got.items() if rows is None or p in rows)


@pytest.mark.parametrize("chunks", [[1] * 9 + [32, 32, 4], [3] * 25, [7] * 11, [32, 32, 13]])
def test_replay_off_any_chunking_equals_full_forward(model, exact, chunks):
    """Odd lengths, chunks crossing the window (8), the candidate limit (3 blocks x 2 rows) and the
    ratio-2 groups; Engram look-back crosses every chunk boundary."""
    d = Driver(exact)
    d.start("a", _prompt(0, 77))
    got = _run(d, "a", chunks, decode=3)
    assert _max_err(got, full_logits(model, d.reqs["a"].tokens)) <= TOL


def test_replay_off_prefix_hit_equals_cold_run(model, exact):
    d = Driver(exact)
    first = _prompt(1, 90)
    d.start("a", first)
    _run(d, "a", [32, 32, 26])
    d.finish("a")
    second = first[:80] + _prompt(2, 30)
    plan = d.start("b", second)
    assert plan.hit_tokens == 80 and plan.replay_start == 80 - 8 * 7  # exact halo L * (W - 1)
    got = _run(d, "b", [32, 32], decode=2)
    assert _max_err(got, full_logits(model, d.reqs["b"].tokens), rows=range(80, 200)) <= TOL


@pytest.mark.parametrize("chunks", [[32, 32, 13], [5, 20, 32, 20], [1] * 6])
def test_replay_on_equals_bounded_reference(model, bounded, chunks):
    d = Driver(bounded)
    d.start("a", _prompt(3, 77 if len(chunks) > 3 else 65))
    got = _run(d, "a", chunks, decode=2)
    r = d.reqs["a"]
    ref = bounded_logits(model, np.array(r.tokens), chunks=r.schedule)
    assert _max_err(got, ref) <= TOL


def test_replay_on_short_prompt_is_exact(model, bounded, exact):
    """A prompt no longer than the window trims nothing: replay on gives exactly the replay-off logits."""
    outs = []
    for runner in (bounded, exact):
        d = Driver(runner)
        d.start("a", _prompt(4, 8))
        outs.append(_run(d, "a", [8], decode=2))
    for p in outs[0]:
        np.testing.assert_array_equal(outs[0][p], outs[1][p])


def test_replay_on_prefix_hit_keeps_cached_blocks(model, bounded):
    d = Driver(bounded)
    first = _prompt(5, 70)
    d.start("a", first)
    _run(d, "a", [32, 32, 6])
    d.finish("a")
    second = first[:64] + _prompt(6, 25)
    plan = d.start("b", second)
    assert (plan.hit_tokens, plan.replay_start, plan.write_floor) == (64, 56, 64)
    hit_blocks = d.bm.block_table("b")[:8]
    paged = lambda: jax.tree.map(lambda a: np.asarray(a)[hit_blocks], bounded.cache.paged())  # noqa: E731
    before = paged()
    got = _run(d, "b", [32, 1], decode=1)
    assert all(x.tobytes() == y.tobytes() for x, y in zip(before, paged(), strict=True))
    r = d.reqs["b"]
    ref = bounded_logits(model, np.array(r.tokens), chunks=r.schedule, hit_tokens=64, replay_start=56)
    assert _max_err(got, ref) <= TOL


def test_mixed_batch_equals_requests_alone(model, exact):
    """Prefill chunks and decode rows of different requests in one step give each request's own logits."""
    d = Driver(exact)
    d.start("a", _prompt(7, 40))
    d.start("b", _prompt(8, 21))
    d.start("c", _prompt(9, 10))
    outs = [d.step({"a": 19, "b": 9, "c": 4}), d.step({"a": 21, "b": 5, "c": 6})]
    d.append("c", 5)  # c decodes while b still prefills
    outs.append(d.step({"b": 7, "c": 1}))
    for rid, pos_out in (("a", [(18, 0), (39, 1)]), ("b", [(8, 0), (13, 1), (20, 2)]),
                         ("c", [(3, 0), (9, 1), (10, 2)])):
        full = full_logits(model, d.reqs[rid].tokens)
        for p, step in pos_out:
            np.testing.assert_allclose(outs[step][rid], full[p], atol=TOL, rtol=0)


def test_release_records_are_lossless_with_fake_quant(model):
    """With fake-quant on, rows are on the FP8 / NVFP4 / MXFP4 grids: storing the release records
    (528 / 288 / 68 B per row at full size) changes no logit."""
    outs = []
    for fmt in ("auto", "release"):
        r = Runner(model, RuntimeConfig(**RC, kv_cache_dtype=fmt, fake_quant=True), progress=False)
        r.compiler.precompile([Program.SEGMENT1.at(8), Program.SEGMENT2.at(8)])
        d = Driver(r)
        d.start("a", _prompt(10, 30))
        outs.append(_run(d, "a", [8, 8, 8, 6]))
    assert r.layout.report()["format"] == "release" and r.cache.rows[4].dtype == np.uint8
    for p in outs[0]:
        np.testing.assert_allclose(outs[0][p], outs[1][p], atol=TOL, rtol=0)


def test_cache_is_donated_in_place(exact):
    d = Driver(exact)
    d.start("a", _prompt(11, 9))
    ptr = exact.cache.swa[0].unsafe_buffer_pointer()
    d.step({"a": 9})
    assert exact.cache.swa[0].unsafe_buffer_pointer() == ptr


def test_unprecompiled_bucket_is_an_error(model):
    r = Runner(model, RuntimeConfig(**RC), progress=False)
    d = Driver(r)
    d.start("a", _prompt(12, 5))
    with pytest.raises(CompileInServingLoop, match="not precompiled"):
        d.step({"a": 5})
    with pytest.raises(ValueError, match=r"segment1\[4\]\] are not among"):  # 4 is not a token bucket: never run
        r.compiler.precompile([Program.SEGMENT1.at(8), Program.SEGMENT1.at(4)])
    assert r.compiler.compiled_keys == []  # refused before compiling anything


def test_bfloat16_on_a_cpu_never_runs_a_one_row_step(model):
    """XLA:CPU runs a 1-row bf16 dot ~10x slower than a 2-row one (it misses YNNPACK): a bf16 runner's steps are
    at least 2 rows, a float32 one keeps 1."""
    rc = RuntimeConfig(**{**RC, "token_buckets": (1, 8, 32)})
    bf16 = dsv41.random_model("tiny", seed=1, dtype="bfloat16")
    assert Runner(bf16, rc, progress=False).buckets.tokens == (2, 8, 32)
    assert Runner(bf16, RuntimeConfig(**{**RC, "token_buckets": None}), progress=False).buckets.tokens[0] == 2
    assert Runner(model, rc, progress=False).buckets.tokens == (1, 8, 32)


def cache_copies(runner, keys) -> list[str]:
    """Copies of a cache array (a parameter `cache__...`) in the compiled segments: a ring read, then written,
    with nothing ordering the two makes XLA copy the whole ring every step to keep the old one readable."""
    import re

    return [m for key in keys for m in re.findall(r"= \S+ copy\(%cache_[^)]*\)", runner.compiler.compiled_text(key))]


def test_cache_is_updated_in_place(exact):
    """SWA rings and ratio-2 tails: written after the attention / pooling has read them, so in place."""
    assert cache_copies(exact, [p.at(n) for n in (8, 32) for p in (Program.SEGMENT1, Program.SEGMENT2)]) == []


def test_segments_compile_to_topk_without_sort(exact):
    """Routers, indexers and candidate selection keep XLA's TopK (a sliced top-k over scores turns into a
    full sort). The only sorts allowed order each query's K candidate block ids (ties -> lowest row) and the
    MoE's T*k (token, choice) pairs by expert."""
    import re

    K = exact.config.candidate_topk_blocks
    for key in (Program.SEGMENT1.at(32), Program.SEGMENT2.at(32)):
        hlo = exact.compiler.compiled_text(key)
        assert re.search(r"TopK", hlo, re.IGNORECASE), key
        for shape, dim in re.findall(r"\[([\d,]+)\][^ ]* sort\(.*?dimensions=\{(\d+)\}", hlo):
            n = int(shape.split(",")[int(dim)])
            assert n <= K or n == 32 * exact.config.num_experts_per_tok, (key, shape, dim)


def test_keep_all_request_is_not_trimmed(model, bounded):
    """A request that keeps all rows (prompt logprobs) runs every layer on every row even with replay on."""
    d = Driver(bounded)
    d.start("a", _prompt(13, 50), keep_all=True)
    got = _run(d, "a", [32, 18], decode=1)
    r = d.reqs["a"]
    assert _max_err(got, bounded_logits(model, np.array(r.tokens), chunks=r.schedule, decoder_replay=False)) <= TOL
    assert _max_err(got, full_logits(model, r.tokens)) <= TOL


def test_prefix_hit_plans():
    from serving.runtime.encoder_replay import plan_prefix_hit, replay_length

    c = dsv41.ModelConfig.preset("v41-flash")
    assert replay_length(c, bounded=True) == 128 and replay_length(c, bounded=False) == 40 * 127
    assert plan_prefix_hit(128, c, bounded=True).hit_tokens == 0  # hits <= window are not adopted
    p = plan_prefix_hit(1024, c, bounded=True)
    assert (p.hit_tokens, p.replay_start, p.write_floor, p.replayed) == (1024, 896, 1024, 128)
    assert plan_prefix_hit(5080, c, bounded=False).hit_tokens == 0
    assert plan_prefix_hit(6144, c, bounded=False).replay_start == 6144 - 5080


def test_live_allocation_report(exact):
    """Bytes measured on the allocated arrays agree with the layout's arithmetic (tiny, float32: 0.5 ratio-2
    rows + 1 ratio-1 row per token of 32 + 16 floats; 8 rings of 8 x 32 floats + one ratio-2 tail)."""
    live, planned = exact.kv_report(), exact.layout.report()
    for k in ("global_bytes_per_token", "swa_and_tail_bytes_per_request", "total_bytes"):
        assert live[k] == planned[k], k
    assert live["global_bytes_per_token"] == 1.5 * (32 + 16) * 4
    assert live["swa_and_tail_bytes_per_request"] == 8 * 8 * 32 * 4 + 2 * 32 * 4


def test_row_logprobs_of_a_kept_request_match_the_full_forward(model, bounded):
    """Prompt logprobs: every computed row's next-token log-probability and top ids, across chunks, equal the
    full-sequence forward's (the request keeps all rows with replay on)."""
    from serving.runtime.batch import SeqChunk

    d = Driver(bounded)
    prompt = _prompt(14, 45)
    d.start("a", prompt, keep_all=True)
    r, got = d.reqs["a"], {}
    for start, end in ((0, 20), (20, 45)):
        assert d.bm.allocate("a", end)
        ch = SeqChunk(slot=r.slot, block_table=d.bm.block_table("a"), token_ids=prompt, start=start, end=end,
                      prompt_logprobs=True)
        out = bounded.step([ch], [None])
        rows = out.prompt_logprobs[0]
        got.update({start + j: (rows.logprob[j], rows.top_ids[j]) for j in range(end - start)})
        d.bm.commit("a", prompt, end)
    full = np.asarray(full_logits(model, prompt), np.float64)
    logp = full - np.log(np.exp(full - full.max(1, keepdims=True)).sum(1, keepdims=True)) - full.max(1, keepdims=True)
    for p in range(44):
        assert abs(got[p][0] - logp[p, prompt[p + 1]]) <= 1e-4, p
        assert got[p][1][0] == logp[p].argmax(), p


def test_model_without_candidate_blocks_runs(model):
    """A V4.1 config with no candidate source (every index source scores all visible rows) builds and runs."""
    m = dsv41.Model(model.config.replace(candidate_source_layer_id=None), model.params)
    r = Runner(m, RuntimeConfig(**{**RC, "token_buckets": (32,)}, swa_bounded_replay=False), progress=False)
    r.compiler.precompile([Program.SEGMENT1.at(32), Program.SEGMENT2.at(32)])
    d = Driver(r)
    d.start("a", _prompt(15, 30))
    got = _run(d, "a", [30])
    assert _max_err(got, full_logits(m, d.reqs["a"].tokens)) <= TOL


def test_head_runs_on_at_most_the_kept_rows_of_requests(model):
    """A step's requests are the first rows of its logit rows, one kept row each at least: segment 2 of a 2-row
    bucket multiplies the LM head with 2 rows, not max_num_seqs (its logits keep max_num_seqs rows, zeros below)."""
    from tests.jaxpr_walk import equations

    S, V = 16, model.config.vocab_size
    r = Runner(model, RuntimeConfig(**{**RC, "max_num_seqs": S, "token_buckets": (2, 8, 32)}), progress=False)
    jaxpr = r.compiler.trace(Program.SEGMENT2.at(2))
    shapes = [tuple(e.outvars[0].aval.shape) for e in equations(jaxpr) if e.primitive.name == "dot_general"]
    assert (2, V) in shapes and (S, V) not in shapes, shapes
    assert (S, V) in [tuple(a.shape) for a in jaxpr.out_avals]  # the logits


def test_prompt_logprobs_run_the_head_a_group_of_rows_at_a_time(model, monkeypatch):
    """A compiled step reserves its cond branches' temporaries whether or not a step takes them, so the prompt
    logprobs' head runs PROMPT_LOGPROB_ROWS rows at a time: no [K, V] float32 buffer in the compiled segment 2, and
    the full forward's logprobs across groups and a padded last group (30 rows: 12 + 12 + 6, padded to 12)."""
    from serving.runtime import segments
    from serving.runtime.batch import SeqChunk

    monkeypatch.setattr(segments, "PROMPT_LOGPROB_ROWS", 12)
    r = compiled_runner(model, **{**RC, "token_buckets": (32,)}, swa_bounded_replay=True)
    V = model.config.vocab_size
    hlo = r.compiler.compiled_text(Program.SEGMENT2.at(32))
    assert f"f32[12,{V}]" in hlo and f"f32[32,{V}]" not in hlo
    d = Driver(r)
    prompt = _prompt(15, 31)
    d.start("a", prompt, keep_all=True)
    assert d.bm.allocate("a", 30)
    ch = SeqChunk(slot=d.reqs["a"].slot, block_table=d.bm.block_table("a"), token_ids=prompt, start=0, end=30,
                  prompt_logprobs=True)
    rows = r.step([ch], [None]).prompt_logprobs[0]
    full = np.asarray(full_logits(model, prompt), np.float64)[:30]
    logp = full - full.max(1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(1, keepdims=True))
    assert np.abs(rows.logprob - logp[np.arange(30), prompt[1:31]]).max() <= 1e-4
    assert (rows.top_ids[:, :2] == np.argsort(-logp, axis=1)[:, :2]).all()


def test_the_largest_segment1_program_reuses_the_carry_probe_s_trace(model, monkeypatch):
    """A runner finds its carry's shapes by tracing segment 1 at the largest bucket through the jitted rows function
    its segment-1 programs call, so the largest program does not trace segment 1 again; a smaller one does."""
    from serving.runtime import segments

    traces = []
    segment1 = segments.segment1
    monkeypatch.setattr(segments, "segment1", lambda *a, **k: traces.append(1) or segment1(*a, **k))
    r = Runner(model, RuntimeConfig(**RC), progress=False)
    assert len(traces) == 1  # the probe
    r.compiler.lower(Program.SEGMENT1.at(32))
    assert len(traces) == 1
    r.compiler.lower(Program.SEGMENT1.at(8))
    assert len(traces) == 2


def test_a_decode_step_reads_the_device_once_and_runs_three_programs(exact, monkeypatch):
    """A plain step's launch neither reads a device array nor waits for one, and dispatches its three programs
    (segment 1, segment 2, the sampler on its requests' bucket); `collect` is the step's one wait, reading its sampled
    tokens. A read inside the launch would stall the host on the device every step (async scheduling builds the next
    step while the device runs this one). On XLA:CPU a device array's memory is the host's, so JAX's transfer guards
    let such reads pass; watched instead: the array's host value (`jax.device_get`, `float`, `tolist`, ...), its
    wait, and numpy's conversions (numpy reads a CPU array through the buffer protocol, past the host value)."""
    from jax._src.array import ArrayImpl

    d = Driver(exact)
    d.start("a", _prompt(14, 12))
    d.step({"a": 12})
    d.append("a", 5)
    ran, reads = [], []
    executable, value, wait = exact.compiler.executable, ArrayImpl._value, ArrayImpl.block_until_ready
    monkeypatch.setattr(exact.compiler, "executable", lambda key: ran.append(key) or executable(key))
    monkeypatch.setattr(ArrayImpl, "_value", property(lambda a: reads.append(a.shape) or value.fget(a)))
    monkeypatch.setattr(ArrayImpl, "block_until_ready", lambda a: reads.append("wait") or wait(a))
    for name in ("asarray", "array", "asanyarray"):
        convert = getattr(np, name)
        monkeypatch.setattr(np, name, lambda a, *args, convert=convert, **kw: (
            isinstance(a, jax.Array) and reads.append(a.shape)) or convert(a, *args, **kw))
    r = d.reqs["a"]
    chunk = SeqChunk(slot=r.slot, block_table=d.bm.block_table("a"), token_ids=r.tokens, start=12, end=13)
    launched = exact.launch([chunk], [SamplingParams(temperature=0)])
    assert ran == [Program.SEGMENT1.at(8), Program.SEGMENT2.at(8), Program.SAMPLE.at(exact.compiler.sample_rows[0])]
    assert reads == []
    out = exact.collect(launched)
    assert reads and all(shape[0] == exact.compiler.sample_rows[0] for shape in reads), reads  # the sampled rows
    monkeypatch.undo()
    assert out.tokens[0] == int(np.argmax(np.asarray(exact.forward([chunk]))[0]))
    d.bm.commit("a", r.tokens, 13)
    d.finish("a")


def test_warm_up_runs_each_program_once_and_leaves_the_state_fresh(model, monkeypatch):
    """XLA:CPU builds each dot's YNNPACK executable at a program's first run; `warm_up` makes that first run before
    any request, on the example batch through the runner's own state, which it then leaves as it was built: the KV
    cache and carry zeros, and the steps after it exact."""
    r = compiled_runner(model, **RC, swa_bounded_replay=False)
    ran = []
    executable = r.compiler.executable
    monkeypatch.setattr(r.compiler, "executable", lambda key: ran.append(key) or executable(key))
    assert r.warm_up() > 0
    monkeypatch.undo()
    assert sorted(ran, key=str) == sorted(r.compiler.compiled_keys, key=str)  # each program, once
    for got, fresh in zip(jax.tree.leaves((r.cache, r.carry_buf)),
                          jax.tree.leaves((r.fresh_cache(), r._zeros(r.compiler.carry_shapes)))):
        np.testing.assert_array_equal(got, fresh)
    d = Driver(r)
    d.start("a", _prompt(21, 20))
    got = _run(d, "a", [8, 12], decode=2)
    assert _max_err(got, full_logits(model, d.reqs["a"].tokens)) < TOL
