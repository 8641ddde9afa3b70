"""`serving.bench.roofline`, what `serving.bench.prefill` and `peers` compare our steps with: the weight bytes a decode
step reads, the measured streaming and matmul rates."""

import numpy as np
import pytest

import dsv41
from serving.bench.roofline import MatmulProbe, RowsDotProbe, decode_weight_bytes, prefill_flops, weight_read_rate
from serving.runtime.programs import Program


def test_decode_reads_every_backbone_weight_and_the_touched_share_of_the_experts():
    """Plus the embedding rows and each Engram layer's hash-column rows of the batch: the tables themselves (12.3 GB
    of v41-flash-slice's 16.6 GB once counted as read by a batch-1 step) are gathered, never read whole."""
    m = dsv41.random_model("tiny", seed=0)
    c = m.config
    experts = sum(a.nbytes for p, a in m.params.items() if p[0] == "layers" and p[-1] in ("w1", "w2", "w3"))
    dspark = sum(a.nbytes for p, a in m.params.items() if p[0] == "dspark")
    embed = m.params[("embed", "weight")].nbytes
    tables = [a for p, a in m.params.items() if p[0] == "layers" and p[2:4] == ("engram", "embed")]
    assert tables and c.engram_hash_cols > 0
    table_row_bytes = sum(a.nbytes / a.shape[0] for a in tables)
    rest = m.device_bytes() - experts - dspark - embed - sum(a.nbytes for a in tables)
    one = decode_weight_bytes(m, 1)
    k, E = c.num_experts_per_tok, c.n_routed_experts
    np.testing.assert_allclose(one, rest + embed / c.vocab_size + c.engram_hash_cols * table_row_bytes
                               + experts * k / E, rtol=1e-9)
    many = decode_weight_bytes(m, 4096)  # every expert touched, every table row at most once
    np.testing.assert_allclose(many, rest + 4096 * embed / c.vocab_size + sum(
        min(a.nbytes, 4096 * c.engram_hash_cols * a.nbytes / a.shape[0]) for a in tables) + experts, rtol=1e-6)
    assert one < decode_weight_bytes(m, 8) < many


def test_streaming_rate_is_measured():
    rate = weight_read_rate(1 << 22, reps=3)
    assert 1e8 < rate < 1e14


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_matmul_rate_is_probed_each_call(dtype):
    probe = MatmulProbe(dtype)
    rates = [probe() for _ in range(2)]
    assert all(1e8 < r < 1e16 for r in rates) and rates[0] != rates[1]  # a new timing each call


def test_rows_dot_probe_times_the_step_rows_products_over_weights_past_the_caches():
    """The probe's dots are the [rows, K] x [N, K] products it names (their values too), its rate counts every
    weight matrix once, and each call is a new timing."""
    probe = RowsDotProbe(2, "bfloat16")
    assert probe.rows == 2 and probe.n_bytes == sum(w.nbytes for w in probe._w) >= 64 << 20
    x, w = probe._x, probe._w[3]
    (y,) = probe._dots(x, [w])
    assert y.shape == (2, w.shape[0]) and y.dtype == np.float32
    want = np.asarray(x, np.float32) @ np.asarray(w, np.float32).T
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-4, atol=1e-3 * np.abs(want).max())
    rates = [probe() for _ in range(2)]
    assert all(1e8 < r < 1e14 for r in rates) and rates[0] != rates[1]


def test_prefill_flops_count_the_active_parameters_and_what_the_first_token_attends():
    """One token: 2 x the layers' parameters it activates (the routed experts' k of E, from the model's own
    arrays), plus per layer q.k and p.v over the rows it sees - its own window row, and in a ratio-1 compressed
    layer its own global row too (a ratio-2 group has not closed yet) - and an index source's score of that row."""
    m = dsv41.random_model("tiny", seed=0)
    c = m.config
    scale = c.num_experts_per_tok / c.n_routed_experts
    active = sum(a.size * (scale if "experts" in p else 1) for p, a in m.params.items()
                 if p[0] == "layers" and p[2:4] != ("engram", "embed"))  # Engram tables: gathered, not multiplied
    H, d = c.num_attention_heads, c.head_dim
    attention = sum(4 * H * d * (1 + (r.compress_ratio == 1))
                    + (r.compress_ratio == 1 and r.is_index_source) * 2 * c.index_n_heads * c.index_head_dim
                    for r in c.roles)
    assert {r.compress_ratio for r in c.roles} == {0, 1, 2}  # every case above occurs
    np.testing.assert_allclose(prefill_flops(c, 1), 2 * active + attention, rtol=1e-12)
    assert prefill_flops(c, 64) > 64 * prefill_flops(c, 1)  # later tokens attend to more rows


def test_alternate_warms_every_mode_then_runs_them_in_turn_each_after_a_probe():
    from serving.bench.prefill import alternate

    log = []
    runs = {m: (lambda i, m=m: log.append((m, i)) or 0.01 * i) for m in ("off", "on")}
    probes = iter(range(100))
    out = alternate(runs, 3, probe=lambda: log.append("probe") or float(next(probes)))
    assert log == [("off", 0), ("on", 0)] + [x for i in (1, 2, 3) for m in ("off", "on") for x in ("probe", (m, i))]
    assert out == {"off": ([0.01, 0.02, 0.03], [0.0, 2.0, 4.0]), "on": ([0.01, 0.02, 0.03], [1.0, 3.0, 5.0])}
    assert alternate(runs, 1)["on"][1] == []  # no probe, no rates


def test_only_the_decoding_runner_compiles_decode_buckets():
    """The replay-off runner only prefills: its buckets are the prompt lengths' (and the sampler), while the
    replay-on runner adds the decode batches and the decode context's prefill; each is one of the runner's own.
    Both keep the KV records `--kv-cache-dtype` names."""
    from argparse import Namespace

    from serving.bench.prefill import _keys, _runner

    m = dsv41.random_model("tiny", seed=0)
    args = Namespace(decode_batches=[1, 4], decode_context=48, decode_steps=2, block_size=16, kernel_impl="xla",
                     kv_cache_dtype="release", quiet=True)
    off, on = (_runner(m, args, [64], bounded) for bounded in (False, True))
    keys_off, keys_on = _keys(off, [64], args, decodes=False), _keys(on, [64], args, decodes=True)
    assert keys_off == [Program.SAMPLE.at(4), Program.SEGMENT1.at(64), Program.SEGMENT2.at(64)]  # max_num_seqs 4
    W = m.config.sliding_window
    T = {on.buckets.token_bucket(n) for n in (1, 4)}
    kept = T | {on.buckets.token_bucket(W)}
    assert ({Program.SEGMENT1.at(t) for t in T | {48, 64}} | {Program.SEGMENT2.at(t) for t in kept}
            | {Program.SAMPLE.at(min(4, t)) for t in T | {48, on.buckets.token_bucket(W)}}) == set(keys_on)
    assert set(keys_on) <= set(on.compiler.bucket_keys()) and set(keys_off) <= set(off.compiler.bucket_keys())
    assert on.layout.fmt == off.layout.fmt == "release"


def test_prefill_flops_with_decoder_replay_run_the_layers_after_the_cut_on_the_last_rows():
    """decoder_rows=r: the layers up to the CED cut count all n rows, the layers after it the last r only, whose
    window starts at the first of them (so the first kept row sees one window row, as `kept_rows` floors it):
    equal to the full count when r = n; the difference from it is the decoder layers' dropped rows."""
    c = dsv41.load_config("tiny")
    cut, n, W = c.cut_layer, 40, c.sliding_window
    assert cut is not None and cut < len(c.roles) - 1 and W < n
    assert prefill_flops(c, n, decoder_rows=n) == prefill_flops(c, n)
    _, shapes = dsv41.abstract_params(c)
    scale = c.num_experts_per_tok / c.n_routed_experts
    decoder_params = sum(a.size * (scale if "experts" in p else 1) for p, a in shapes.items()
                         if p[0] == "layers" and p[1] > cut and p[2:4] != ("engram", "embed"))
    H, d = c.num_attention_heads, c.head_dim

    def decoder_attention(t: int, floor: int) -> float:
        out = 0.0
        for r in c.roles[cut + 1:]:
            rows = min(t + 1 - floor, W)
            if r.compress_ratio:
                visible = (t + 1) // r.compress_ratio
                rows += visible if r.attn_kind == "hca" else min(c.index_topk, visible)
                out += r.is_index_source * 2.0 * c.index_n_heads * c.index_head_dim * visible
            out += 4.0 * H * d * rows
        return out

    full = sum(decoder_attention(t, 0) for t in range(n)) + 2.0 * decoder_params * n
    kept = sum(decoder_attention(t, n - W) for t in range(n - W, n)) + 2.0 * decoder_params * W
    np.testing.assert_allclose(prefill_flops(c, n) - prefill_flops(c, n, decoder_rows=W), full - kept, rtol=1e-12)


@pytest.mark.slow
def test_decode_steps_run_and_time_each_step(monkeypatch):
    """`bench_decode` prefills the context and times each decode step of B requests (the step's sampled tokens read
    back), on the buckets `_keys` compiles for it; a trace records the same steps again, from the same context, after
    the timed ones and without their probes."""
    import contextlib
    from argparse import Namespace

    from serving.bench import prefill
    from serving.bench.prefill import _keys, _runner, bench_decode

    m = dsv41.random_model("tiny", seed=0)
    args = Namespace(decode_batches=[2], decode_context=32, decode_steps=2, block_size=16, kernel_impl="xla",
                     kv_cache_dtype="auto", quiet=True)
    r = _runner(m, args, [32], True)
    r.compiler.precompile(_keys(r, [32], args, decodes=True))
    seconds, rates = bench_decode(r, 2, 32, 3, m.config.vocab_size)
    assert len(seconds) == 3 and all(s > 0 for s in seconds) and rates == []

    traced, events = [False], []

    @contextlib.contextmanager
    def profiling(folder, label):
        traced[0] = True
        yield
        traced[0] = False

    monkeypatch.setattr(prefill, "profiling", profiling)
    step = r.step
    monkeypatch.setattr(r, "step", lambda chunks, params: events.append(("step", traced[0], chunks[0].end))
                        or step(chunks, params))
    seconds, (rates,) = bench_decode(r, 2, 32, 3, m.config.vocab_size, "unused", "decode",
                                     (lambda: events.append(("probe", traced[0])) or 1.0,))
    assert len(seconds) == 3 and rates == [1.0] * 3
    warm, timed, traced_steps = [("step", False)], [("probe", False), ("step", False)] * 3, [("step", True)] * 3
    assert [e[:2] for e in events] == warm + timed + traced_steps
    ends = [e[2] for e in events if e[0] == "step"]
    assert ends == [33, 34, 35, 36, 33, 34, 35]  # the context prefilled again for the traced steps
