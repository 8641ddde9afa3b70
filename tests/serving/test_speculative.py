"""Speculative decoding in the runtime: verification with chosen drafts emits exactly the greedy continuation,
a rejection leaves every cache kind byte-identical to a run that never saw the rejected tokens (SWA rings,
ratio-2 tails, global rows, index keys, draft rings), the draft context matches the drafter's reference math,
and rejection sampling keeps the target's distribution (chi-square)."""

import jax
import numpy as np
import pytest
from scipy import stats

import dsv41
from dsv41.dspark import draft_base_logits, draft_hidden
from dsv41.model import forward_hidden
from serving.runtime.batch import SeqChunk
from serving.runtime.config import RuntimeConfig
from serving.runtime.runner import Runner
from serving.runtime.sampling_params import SamplingParams
from serving.runtime.speculative import SpeculativeConfig, verify
from serving.runtime.programs import Program

GREEDY = SamplingParams(temperature=0.0)
K = 3  # tiny's DSpark block


@pytest.fixture(scope="module")
def model():
    return dsv41.random_model("tiny", seed=3)


@pytest.fixture(scope="module")
def runner(model):
    rc = RuntimeConfig(max_num_seqs=2, max_num_batched_tokens=32, max_model_len=64, block_size=8,
                       token_buckets=(4, 32), swa_bounded_replay=False, speculative_config='{"method": "dspark"}')
    r = Runner(model, rc, progress=False)
    # what the tests run: one speculative request per step (the batched verify steps are the engine tests')
    r.compiler.precompile([Program.SEGMENT1.at(4), Program.SEGMENT1.at(32), Program.SEGMENT2.at(4), Program.SEGMENT2.at(32), Program.SPEC_SNAPSHOT.at(1), Program.SPEC_FINISH.at(1)])
    return r


def _prompt(seed, n):
    return [int(t) for t in np.random.default_rng(seed).integers(3, 500, n)]


def _state(r):
    return jax.tree.map(np.asarray, (r.cache, r.q_buf))


def _set_state(r, state):
    r.cache, r.q_buf = jax.tree.map(jax.numpy.asarray, state)


def _chunk(tokens, start, end, drafts=()):
    # a verification chunk asks to be trimmed, as the engine's do with bounded replay: it must not be trimmed all
    # the same (the references - prefill, plain decode, the accepted rows as one chunk - are untrimmed)
    return SeqChunk(slot=1, block_table=list(range(8)), token_ids=tokens, start=start, end=end,
                    draft_ids=list(drafts), trim=bool(drafts))


def _greedy_run(r, prompt, n):
    """Prefill, then n - 1 plain decode steps: the n greedy tokens."""
    out = r.step([_chunk(prompt, 0, len(prompt))], [GREEDY])
    toks = list(prompt) + [int(out.tokens[0][0])]
    for _ in range(n - 1):
        out = r.step([_chunk(toks, len(toks) - 1, len(toks))], [GREEDY])
        toks.append(int(out.tokens[0][0]))
    return toks[len(prompt):]


@pytest.mark.parametrize("prompt_len", [13, 14])  # the verified block starts at an even / odd position
def test_rejection_rolls_every_cache_back_and_greedy_output_is_exact(runner, prompt_len):
    prompt = _prompt(prompt_len, prompt_len)
    runner.step([_chunk(prompt, 0, prompt_len)], [GREEDY])
    after_prefill = _state(runner)
    ref = _greedy_run(runner, prompt, 1 + K + 1)  # t1 and what follows it
    assert runner.cache.tail, "tiny has ratio-2 KV sources: their tails are part of the check"
    toks = prompt + ref[:1]
    P = prompt_len  # position of t1, the verified block's first row
    for n in range(K + 1):  # accept n drafts: the first n are right, the next is wrong
        drafts = ref[1:1 + n] + [(t + 1) % 500 for t in ref[1 + n:1 + K]]
        _set_state(runner, after_prefill)
        out = runner.step([_chunk(toks, P, P + 1 + K, drafts)], [GREEDY])
        assert int(out.num_emitted[0]) == n + 1
        assert list(out.tokens[0][:n + 1]) == ref[1:n + 2]
        spec = _state(runner)[0]
        # the run that never saw the rejected drafts: the accepted rows as one plain chunk, from the same state
        _set_state(runner, after_prefill)
        runner.step([_chunk(toks + ref[1:1 + n], P, P + 1 + n)], [GREEDY])
        plain = _state(runner)[0]
        assert jax.tree.structure(spec) == jax.tree.structure(plain)
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(spec), jax.tree.leaves(plain), strict=True):
            assert a.tobytes() == b.tobytes(), f"n={n}: cache {jax.tree_util.keystr(path)} differs after rollback"


def test_draft_context_and_proposal_match_the_drafter_reference(model, runner):
    """The runtime's first draft after a prefill == dsv41.dspark's reference math on the exact forward's features."""
    prompt = _prompt(5, 12)
    out = runner.step([_chunk(prompt, 0, len(prompt))], [GREEDY])
    anchor = int(out.tokens[0][0])
    c, ds = model.config, model.module.dspark
    ids = np.asarray(prompt)
    _, feats = forward_hidden(model.module, ids, model.engram_input(ids), capture=c.dspark_target_layer_ids)
    main_x = ds.combine(np.stack([feats[t] for t in c.dspark_target_layer_ids], 1))
    ctx = ds.context_kv(main_x, np.arange(len(prompt)))
    W = c.sliding_window
    for i, rows in enumerate(ctx):  # the ring holds the last W positions' context rows
        ring = np.asarray(runner.layout.swa_format.decode(runner.cache.draft[i][1]))
        for p in range(len(prompt) - W, len(prompt)):
            np.testing.assert_allclose(ring[p % W], np.asarray(rows[p]), atol=1e-5)
    h = draft_hidden(ds, model.module.embed, np.array([anchor] + [c.dspark_noise_token_id] * (K - 1)),
                     len(prompt), ctx, np.arange(len(prompt)))
    base = np.asarray(draft_base_logits(ds, model.module.head, h))
    prev, drafts = anchor, []
    for k in range(K):  # the Markov head, greedy
        _, bias = ds.markov_bias(np.array([prev]))
        prev = int(np.argmax(base[k] + np.asarray(bias)[0]))
        drafts.append(prev)
    assert list(out.drafts[0]) == drafts


@pytest.mark.parametrize("method", ["standard", "block"])
def test_rejection_sampling_keeps_the_target_distribution(method):
    """20,000 verifications of 3 drafts drawn from q, with context-free target rows p0..p3: the output process's
    first two tokens (the second from the next step when only one is emitted) ~ p0 x p1 by chi-square at a fixed
    seed, and a wrong distribution fails the same test; greedy rows accept exactly the argmax."""
    rng = np.random.default_rng(0)
    V, N, K = 5, 20_000, 3
    p = rng.dirichlet(np.ones(V), size=K + 1)
    q = rng.dirichlet(np.ones(V), size=K)
    drafts = np.stack([rng.choice(V, N, p=q[i]) for i in range(K)], 1).astype(np.int32)
    logp = np.broadcast_to(np.log(p), (N, K + 1, V)).astype(np.float32)
    emitted, n = jax.jit(verify, static_argnames=("method",))(
        logp, np.zeros(N, bool), drafts, np.broadcast_to(q, (N, K, V)).astype(np.float32), np.full(N, K, np.int32),
        np.arange(N, dtype=np.uint32), np.zeros(N, np.int32), method=method)
    emitted, n = np.asarray(emitted), np.asarray(n)
    second = np.where(n >= 1, emitted[:, 1], rng.choice(V, N, p=p[1]))
    joint = np.bincount(emitted[:, 0] * V + second, minlength=V * V)
    assert stats.chisquare(joint, np.outer(p[0], p[1]).ravel() * N).pvalue > 1e-3
    assert stats.chisquare(np.bincount(emitted[:, 0], minlength=V), q[0] * N).pvalue < 1e-6  # the test can fail
    if method == "block":  # joint verification accepts at least as many drafts on average
        _, n_std = verify(logp, np.zeros(N, bool), drafts, np.broadcast_to(q, (N, K, V)).astype(np.float32),
                          np.full(N, K, np.int32), np.arange(N, dtype=np.uint32), np.zeros(N, np.int32),
                          method="standard")
        assert n.mean() >= np.asarray(n_std).mean() - 0.01
    g_emitted, g_n = verify(logp[:4], np.ones(4, bool), np.array([[np.argmax(p[0]), 0, 0]] * 4, np.int32),
                            np.ones((4, K, V), np.float32) / V, np.array([2, 2, 1, 0], np.int32),
                            np.zeros(4, np.uint32), np.zeros(4, np.int32), method=method)
    a0, a1 = int(np.argmax(p[0])), int(np.argmax(p[1]))
    assert list(np.asarray(g_n)) == [int(a1 == 0) + 1] * 2 + [1, 0]
    assert int(np.asarray(g_emitted)[3, 0]) == a0


def test_synthetic_rate_gives_the_configured_acceptance_length():
    s = SpeculativeConfig(rejection_sample_method="synthetic", synthetic_acceptance_length=3.51,
                          num_speculative_tokens=5)
    a = s.synthetic_rate
    assert abs(sum(a ** i for i in range(1, 6)) - 2.51) < 1e-9
    V, N = 4, 20_000
    emitted, n = verify(np.zeros((N, 6, V), np.float32), np.zeros(N, bool), np.zeros((N, 5), np.int32),
                        np.ones((N, 5, V), np.float32) / V, np.full(N, 5, np.int32), np.arange(N, dtype=np.uint32),
                        np.zeros(N, np.int32), method="synthetic", synthetic_rate=a)
    assert abs(1 + float(np.mean(n)) - 3.51) < 0.05


@pytest.mark.parametrize("spec, message", [
    ("{", "not valid JSON"),
    ('{"method": "eagle"}', "method 'eagle'"),
    ('{"method": "dspark", "enable_adaptive_verification": true}', "enable_adaptive_verification"),
    ('{"method": "dspark", "rejection_sample_method": "synthetic"}', "synthetic_acceptance_length"),
    ('{"method": "dspark", "num_speculative_tokens": 0}', "positive integer"),
    ('{"method": "dspark", "adaptive": "yes"}', "adaptive must be true or false"),
])
def test_bad_speculative_config_is_refused_by_name(spec, message):
    with pytest.raises(ValueError, match=message):
        RuntimeConfig(speculative_config=spec)


def test_speculative_config_must_fit_the_checkpoint(model):
    with pytest.raises(ValueError, match="exceeds the checkpoint's DSpark block of 3"):
        SpeculativeConfig(num_speculative_tokens=4).resolve(model.config)
    no_drafter = model.config.replace(num_nextn_predict_layers=0)
    with pytest.raises(ValueError, match="no DSpark stages|has none"):
        SpeculativeConfig().resolve(no_drafter)
    assert SpeculativeConfig().resolve(model.config).num_speculative_tokens == 3
    assert RuntimeConfig(speculative_config={"method": "dspark", "num_speculative_tokens": 2}).speculative_config == \
        '{"method": "dspark", "num_speculative_tokens": 2, "rejection_sample_method": "standard", ' \
        '"draft_sample_method": "probabilistic", "adaptive": true}'


def test_served_rejection_sampling_matches_the_model_distribution():
    """End to end through the runner on a 16-token vocabulary: 1,600 seeded requests each prefill (sampling t1 and
    drafting from q), then verify their drafts (emitting t2 by acceptance or from the residual); the joint (t1, t2)
    ~ p(t1) p(t2 | t1) of the exact forward, by chi-square at a fixed seed."""
    from dsv41.config import ModelConfig

    c = ModelConfig.preset("tiny").replace(vocab_size=16, dspark_noise_token_id=15, engram_compressed_vocab_size=16)
    model = dsv41.random_model(c, seed=0)
    R, V = 32, 16
    r = Runner(model, RuntimeConfig(max_num_seqs=R, max_num_batched_tokens=128, max_model_len=32, block_size=8,
                                    token_buckets=(128,), swa_bounded_replay=False,
                                    speculative_config='{"method": "dspark"}'), progress=False)
    r.compiler.precompile([Program.SEGMENT1.at(128), Program.SEGMENT2.at(128), Program.SPEC_SNAPSHOT.at(R), Program.SPEC_FINISH.at(R)])  # the steps of R requests
    prompt = [3, 7, 11]
    pairs = []
    for batch in range(50):
        params = [SamplingParams(temperature=1.0, seed=batch * R + i) for i in range(R)]
        tables = [list(range(4 * i, 4 * i + 4)) for i in range(R)]
        out = r.step([SeqChunk(slot=i, block_table=tables[i], token_ids=prompt, start=0, end=3) for i in range(R)],
                     params)
        t1, drafts = out.tokens[:, 0], out.drafts
        out = r.step([SeqChunk(slot=i, block_table=tables[i], token_ids=prompt + [int(t1[i])], start=3, end=3 + 1 + K,
                               draft_ids=[int(x) for x in drafts[i]]) for i in range(R)], params)
        pairs += [(int(a), int(b)) for a, b in zip(t1, out.tokens[:, 0])]
    counts = np.bincount([a * V + b for a, b in pairs], minlength=V * V)
    p1 = _softmax(np.asarray(model.logits(prompt))[-1])
    p2 = np.stack([_softmax(np.asarray(model.logits(prompt + [a]))[-1]) for a in range(V)])
    expected = (p1[:, None].astype(np.float64) * p2).ravel()
    expected *= len(pairs) / expected.sum()
    small = expected < 5  # pool the sparse cells into one
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    assert stats.chisquare(obs, exp).pvalue > 1e-3


def _softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def test_forward_of_a_speculative_runner_is_each_chunks_last_row(model, runner):
    prompt = _prompt(21, 10)
    logits = np.asarray(runner.forward([_chunk(prompt, 0, 10)]))
    np.testing.assert_allclose(logits[0], np.asarray(model.logits(prompt))[-1], atol=1e-4)


def test_verification_logits_are_written_only_by_steps_that_verify(model, runner):
    """Segment 2 writes a request's verified rows after the first (a donated buffer) only in a step where a request
    verifies drafts, so a plain step writes no more logits than a plain runner's; a chunk's last row is then its row
    num_draft."""
    state, prompt = _state(runner), _prompt(23, 12)
    before = np.asarray(runner.verify_buf)
    first = np.asarray(runner.forward([_chunk(prompt, 0, 11)]))
    np.testing.assert_array_equal(np.asarray(runner.verify_buf), before)
    np.testing.assert_allclose(first[0], np.asarray(model.logits(prompt[:11]))[-1], atol=1e-4)
    drafts = [5, 9]
    last = np.asarray(runner.forward([_chunk(prompt, 11, 14, drafts)]))
    assert not np.array_equal(np.asarray(runner.verify_buf), before)
    np.testing.assert_allclose(last[0], np.asarray(model.logits(prompt + drafts))[-1], atol=1e-4)
    _set_state(runner, state)
