"""Speculative decoding through the engine: greedy output equals non-speculative output token for token - alone,
batched, after preemption (tiny, whose random drafter is always rejected, so every step rolls back), after a
prefix hit, and on the trained nano-austen, whose drafter is accepted - and the spec-decode metrics count what was
verified. Batched and preempted runs are compared with replay off: with bounded replay a preempted request's
result depends on where its prefix hit lands (by design), and drafts reserve blocks, so preemptions differ."""

import numpy as np
import pytest

import dsv41
from dsv41.nano import NANO_DIR
from serving.engine.args import EngineArgs
from serving.engine.draft_allocation import DraftAllocator
from serving.engine.engine import Engine
from serving.runtime.kv_cache import CacheLayout
from serving.runtime.sampling_params import SamplingParams
from serving.text.tokenizer import Tokenizer
from tests.serving.engine.test_engine import _prompt, _serve

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
SPEC = '{"method": "dspark"}'  # adaptive: the policy mixes plain steps (k = 0) and verifying ones
EVERY_STEP = '{"method": "dspark", "adaptive": false}'  # every step verifies up to 5 drafts


@pytest.fixture(scope="module")
def model():
    return dsv41.random_model("tiny", seed=3)


@pytest.fixture(scope="module")
def engines(model):
    """tiny's engines by (bounded replay, speculative config or None), built once for the module: each build
    compiles its programs, and the tests below leave an engine idle with every block free."""
    built = {}

    def get(replay: bool = True, spec: str | None = None) -> Engine:
        if (replay, spec) not in built:
            kw = {} if spec is None else {"speculative_config": spec}
            built[replay, spec] = Engine(model, None, _args(model, swa_bounded_replay=replay, **kw), progress=False)
        return built[replay, spec]

    return get


def _args(model, **kw):
    """12 KV blocks of 8 tokens: two 44-token requests fit, three preempt (as tests/serving/engine/test_engine.py)."""
    probe = CacheLayout(model.config, 1, 8, 4, "auto", "float32", model.config.num_nextn_predict_layers)
    return EngineArgs.of(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=96, block_size=8,
                         kv_cache_memory=4 * probe.bytes_per_slot() + 12 * probe.bytes_per_block(),
                         token_buckets=(8, 32), **kw)  # two step sizes: fewer programs to compile


def _metric(engine, name):
    for line in engine.metrics.render().decode().splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exported")


@pytest.mark.parametrize("replay", [pytest.param(False, marks=pytest.mark.slow), True],
                         ids=["replay-off", "bounded-replay"])
def test_greedy_speculative_equals_plain_alone_batched_preempted(engines, replay):
    plain, spec = engines(replay), engines(replay, SPEC)
    prompts = [_prompt(s) for s in range(3)]
    for eng in (plain, spec):
        eng.outs = [_serve(eng, [p], GREEDY) for p in prompts]
        if not replay:  # bounded replay's result depends on where a preempted request's hit lands, by design
            eng.outs.append(_serve(eng, prompts, GREEDY))
    assert replay or spec.scheduler.num_preemptions > 0, "three 44-token requests in 12 blocks must preempt"
    for (p_toks, p_lps), (s_toks, s_lps) in zip(plain.outs, spec.outs):
        assert s_toks == p_toks
        for a, b in zip(p_lps, s_lps):
            np.testing.assert_allclose(b, a, atol=1e-4)
    assert spec.scheduler.num_free_blocks == spec.scheduler.num_blocks
    drafts = _metric(spec, "vllm:spec_decode_num_drafts_total")
    assert drafts > 0 and _metric(spec, "vllm:spec_decode_num_draft_tokens_total") <= 3 * drafts
    # the policy tried plain steps and verifying ones (both were measured; the outputs above are the plain ones), and
    # only the ks a step's token bucket tells apart: k = 2 runs on k = 3's bucket at every batch size here (1-4
    # requests, buckets 8 and 32), so it is never an arm
    steps = [_metric_label(spec, "dsv41:spec_decode_steps_total", f'k="{k}"')
             for k in range(spec.spec.num_speculative_tokens + 1)]
    assert spec.spec.num_speculative_tokens == 3 and steps[0] > 0 and steps[3] > 0 and steps[2] == 0, steps
    per_request = [_metric_label(spec, "dsv41:spec_decode_request_drafts_total", f'k="{k}"')
                   for k in range(spec.spec.num_speculative_tokens + 1)]
    assert sum(per_request) >= sum(steps[1:]), "every verifying step counts each of its decoding requests"
    # a prefix hit: the second request replays the shared prefix's last window and rebuilds its draft context
    shared, short = _prompt(9, 66), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for eng in (plain, spec):
        eng.hit = [_serve(eng, [shared + [5, 6, 7]], short)[0][0], _serve(eng, [shared + [8, 9]], short)[0][0]]
        assert _metric(eng, "vllm:prefix_cache_hits_total") >= 64
    assert spec.hit == plain.hit


def test_the_adaptive_engine_splits_k_by_the_allocator(engines, monkeypatch):
    """Each verifying step schedules the allocator's split of the policy's k: with a draft row measured to cost 5
    plain steps (far more than any draft of tiny's random drafter earns) a step of k = 3 verifies one draft in all."""
    spec = engines(spec=SPEC)
    monkeypatch.setattr(spec.spec_policy, "choose", lambda running: 3)
    by_rows = DraftAllocator(spec.spec.num_speculative_tokens, step_shape=lambda rows: rows)  # every count a shape
    monkeypatch.setattr(spec, "draft_allocator", by_rows)
    for n in (1, 2, 3, 4, 5, 6) * by_rows.min_steps:
        by_rows.record(2, n, 1.0 + 5.0 * n)
    drafts = []
    schedule = spec.scheduler.schedule

    def spy(max_drafts=None):
        sched = schedule(max_drafts)
        drafts.append(sum(s.num_draft for s in sched))
        return sched

    monkeypatch.setattr(spec.scheduler, "schedule", spy)
    _serve(spec, [_prompt(s) for s in (31, 32)], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert max(drafts) == 1 and drafts.count(1) >= 6, drafts


def test_seeded_sampling_and_stop_conditions_with_speculation(engines):
    """Sampled requests run through rejection sampling to their exact lengths; EOS banned until min_tokens."""
    spec = engines(spec=SPEC)
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=17, min_tokens=5, logprobs=0)
    toks, lps = _serve(spec, [_prompt(s) for s in range(2)], params)
    for t, lp in zip(toks, lps):
        assert 5 <= len(t) <= 17 and len(lp) == len(t) and all(x <= 0 for x in lp)
        assert spec.eos_id not in t[:5]
    with pytest.raises(ValueError, match="prompt_logprobs"):
        spec.add_request("x", [5, 6], SamplingParams(prompt_logprobs=1))


@pytest.fixture(scope="module")
def nano():
    """The trained nano-austen, plain and speculative engines, and four prompts."""
    model = dsv41.load(NANO_DIR, dtype="float32")
    tok = Tokenizer.from_dir(NANO_DIR)
    # one step size: four programs fewer to compile (13 s of the suite from a cold cache)
    kw = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128, token_buckets=(32,))
    plain = Engine(model, tok, EngineArgs.of(**kw), progress=False)
    spec = Engine(model, tok, EngineArgs.of(**kw, speculative_config=EVERY_STEP), progress=False)
    prompts = [tok.encode(t) for t in ("Anne was", "It is a truth universally acknowledged", "Mr. Darcy said that",
                                       "The morning was fine, and")]
    return plain, spec, prompts


def test_nano_greedy_speculative_equals_plain_with_accepted_drafts(nano):
    """The trained drafter is accepted (so rows are committed from drafts and rolled back past a rejection), and
    the output is still exactly the non-speculative one."""
    plain, spec, prompts = nano
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    assert _serve(spec, prompts, params)[0] == _serve(plain, prompts, params)[0]
    accepted = _metric(spec, "vllm:spec_decode_num_accepted_tokens_total")
    assert accepted > 0, "the trained drafter's first position is accepted about 40% of the time"
    per_pos = [_metric_pos(spec, i) for i in range(5)]
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)
    # the confidence bins count each draft verification reached: every verification reaches its first draft, and a
    # draft past the first is reached only after an accepted one
    bins = [f'bin="{b / 10:.1f}"' for b in range(10)]
    reached = sum(_metric_label(spec, "dsv41:spec_decode_confidence_drafts_total", b) for b in bins)
    assert sum(_metric_label(spec, "dsv41:spec_decode_confidence_accepted_total", b) for b in bins) == accepted
    verifications = _metric(spec, "vllm:spec_decode_num_drafts_total")
    draft_tokens = _metric(spec, "vllm:spec_decode_num_draft_tokens_total")
    assert verifications <= reached <= min(verifications + accepted, draft_tokens)


def test_nano_requests_verifying_different_numbers_of_drafts_give_the_plain_outputs(nano, monkeypatch):
    """One step, each request its own number of drafts (the adaptive engine splits its k by each request's acceptance,
    `serving.engine.draft_allocation`; forced here: the i-th running request verifies i of its drafts at most): the
    outputs are the plain engine's, and /metrics counts the requests by the drafts they verified."""
    plain, spec, prompts = nano
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    counts = lambda: [_metric_label(spec, "dsv41:spec_decode_request_drafts_total", f'k="{k}"')  # noqa: E731
                      for k in range(spec.spec.num_speculative_tokens + 1)]
    before = counts()
    monkeypatch.setattr(spec, "_drafts_per_request",
                        lambda k: {r.request_id: min(i, k) for i, r in enumerate(spec.scheduler.running)})
    assert _serve(spec, prompts, params)[0] == _serve(plain, prompts, params)[0]
    verified = [b - a for a, b in zip(before, counts())]
    assert all(n > 0 for n in verified[:4]) and not any(verified[4:]), verified


def test_nano_min_tokens_verifies_drafts_under_the_ban(nano):
    """While min_tokens bans the stop ids, drafts are still verified - against the banned distribution in the rows
    that emit those outputs, the plain one after them - and the outputs are the plain engine's: the most frequent
    token of each plain output, made a stop id, is never emitted before min_tokens and ends the request after."""
    plain, spec, prompts = nano
    free = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    firsts = _serve(plain, prompts, free)[0]
    stop_ids = [max(set(out), key=out.count) for out in firsts]
    drafts_before = _metric(spec, "vllm:spec_decode_num_draft_tokens_total")
    got = []
    for eng in (plain, spec):  # the four requests in one batch, each with its own stop id
        for i, (p, t) in enumerate(zip(prompts, stop_ids)):
            eng.add_request(f"m{i}", p, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, min_tokens=12,
                                                       stop_token_ids=[t]))
        outs = {f"m{i}": [] for i in range(len(prompts))}
        while eng.has_unfinished():
            for o in eng.step():
                outs[o.request_id] += o.new_token_ids
        got.append([outs[f"m{i}"] for i in range(len(prompts))])
    assert got[1] == got[0]
    assert any(t in out[:12] for out, t in zip(firsts, stop_ids)), "some stop id falls inside min_tokens when free"
    assert all(t not in out[:12] for out, t in zip(got[0], stop_ids))
    assert _metric(spec, "vllm:spec_decode_num_draft_tokens_total") > drafts_before


def test_nano_stop_strings_inside_speculative_steps_give_the_plain_outputs(nano, monkeypatch):
    """Stop strings that end before the last token a speculative step emits (an accepted draft): the scheduler keeps
    the tokens up to the string and finishes there, and tokens, text and finishes are those of the plain engine
    (with and without the string in the output); every block comes back."""
    plain, spec, prompts = nano
    stops = (", and", "the world", "\n\n")
    params = [SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, stop=stops,
                             include_stop_str_in_output=i % 2 == 1) for i in range(len(prompts))]
    cut_inside = []
    postprocess = spec.scheduler.postprocess

    def spy(s, tokens, pending=None, stop=None):
        finish = postprocess(s, tokens, pending, stop)
        if stop is not None and stop.index < len(tokens) - 1 and finish.stop_string == stop.text:
            cut_inside.append(s.request.request_id)
        return finish

    monkeypatch.setattr(spec.scheduler, "postprocess", spy)
    got = []
    for eng in (plain, spec):
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            eng.add_request(f"s{i}", prompt, p)
        outs = {}
        while eng.has_unfinished():
            for o in eng.step():
                outs.setdefault(o.request_id, []).append(o)
        got.append({rid: (sum((o.new_token_ids for o in v), []), "".join(o.new_text for o in v), v[-1].finish_reason,
                          v[-1].stop_reason) for rid, v in outs.items()})
        assert eng.scheduler.num_free_blocks == eng.scheduler.num_blocks and eng.scheduler.running == []
    assert got[1] == got[0] and all(r[2] == "stop" for r in got[0].values())
    assert cut_inside, "a stop string should end inside a speculative step (the trained drafter is accepted)"


def _metric_pos(engine, i):
    return _metric_label(engine, "vllm:spec_decode_num_accepted_tokens_per_pos_total", f'position="{i}"')


def _metric_label(engine, name, label):
    for line in engine.metrics.render().decode().splitlines():
        if line.startswith(name + "{") and label in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name}{{{label}}} not exported")


def test_top_logprobs_are_computed_when_asked_with_and_without_speculation(engines):
    """A request asking for 3 top logprobs, batched with one that asks for none (the device computes them only in a
    step where some row asks): plain and speculative engines give the same top entries; each lists the most likely
    tokens in order, the chosen token's logprob matching its entry where it is among them."""
    asks = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    silent = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    tops = []
    for eng in (engines(), engines(spec=SPEC)):
        # prompts no earlier test served: no prefix hit, whose bounded replay would move the logits differently
        # in the two engines (their caches hold what each served before)
        eng.add_request("a", _prompt(21), asks)
        eng.add_request("s", _prompt(22), silent)
        got = {"a": [], "s": []}
        while eng.has_unfinished():
            for o in eng.step():
                got[o.request_id] += o.new_logprobs or []
        assert not got["s"] and len(got["a"]) == 8
        for x in got["a"]:
            lps = [lp for _, lp in x.top]
            assert len(x.top) == 3 and lps == sorted(lps, reverse=True) and x.top[0][1] > -np.inf
            assert x.token_id == x.top[0][0]  # greedy: the chosen token is the most likely one
            np.testing.assert_allclose(x.logprob, x.top[0][1], rtol=1e-6)
        tops.append([[t for t, _ in x.top] for x in got["a"]])
    assert tops[0] == tops[1]


def test_confidence_bins_count_the_drafts_verification_reached():
    """A verification of 4 drafts accepting the first 2 reaches drafts 0-2 (each in its confidence's tenth; the 3rd
    rejected) and never the 4th; a confidence of exactly 1 falls in the top bin."""
    from serving.engine.metrics import EngineMetrics

    class _Metrics:  # what _metric_label reads
        metrics = EngineMetrics("m")

    m = _Metrics.metrics
    m.add_spec_decode(5)
    m.spec_confidence([1.0, 0.55, 0.31, 0.02], num_draft=4, num_accepted=2)
    m.spec_confidence([0.93], num_draft=1, num_accepted=0)
    got = {b: (_metric_label(_Metrics, "dsv41:spec_decode_confidence_drafts_total", f'bin="{b}"'),
               _metric_label(_Metrics, "dsv41:spec_decode_confidence_accepted_total", f'bin="{b}"'))
           for b in ("0.0", "0.3", "0.5", "0.9")}
    assert got == {"0.0": (0, 0), "0.3": (1, 0), "0.5": (1, 1), "0.9": (2, 1)}
