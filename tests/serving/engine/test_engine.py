"""The engine end to end on the tiny model (float32): greedy and seeded outputs are the same served alone,
in a concurrent batch and after preemption; prompt logprobs equal the full forward's; aborts free blocks;
the prefix cache serves repeated prefixes.

The engine runs with SWA bounded replay off: then chunking and prefix hits are exact (the replay recomputes
the full dependency halo), so any difference would be an engine bug. With bounded replay on, outputs depend
on chunk boundaries and hits by design (spec §2-3; tests/serving/test_runtime.py checks that mode against
its reference)."""

import numpy as np
import pytest

import dsv41
from serving.engine.args import EngineArgs
from serving.engine.engine import Engine
from serving.runtime.kv_cache import CacheLayout
from serving.runtime.sampling_params import SamplingParams



@pytest.fixture(scope="module")
def model():
    return dsv41.random_model("tiny", seed=3)


@pytest.fixture(scope="module")
def args(model):
    """12 KV blocks of 8 tokens: two 44-token requests fit, three preempt. The bucket fit cuts every step of 9-31
    tokens back to 8 (its prefill chunks end anywhere, requests are sent back to the queue)."""
    probe = CacheLayout(model.config, 1, 8, 4, "auto", "float32")
    return EngineArgs.of(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=96, block_size=8,
                         swa_bounded_replay=False, bucket_fit_min_tokens=8,
                         kv_cache_memory=4 * probe.bytes_per_slot() + 12 * probe.bytes_per_block(),
                         token_buckets=(8, 32))


@pytest.fixture(scope="module")
def engine(model, args):
    eng = Engine(model, None, args, progress=False)
    assert eng.scheduler.num_blocks == 12
    return eng


def _prompt(seed, n=20):
    return [int(t) for t in np.random.default_rng(seed).integers(3, 512, n)]


def _serve(engine, prompts, params):
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    out = {f"r{i}": [] for i in range(len(prompts))}
    lps = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
            lps[o.request_id] += [x.logprob for x in o.new_logprobs or []]
    return [out[f"r{i}"] for i in range(len(prompts))], [lps[f"r{i}"] for i in range(len(prompts))]


def test_a_pending_token_and_its_engram_ids_come_from_the_device(engine):
    """Async scheduling on V4.1: a decode row whose token is still on the device reads it there, and its Engram hash
    ids (layer 1 here) are finished there from the host's look-back: the logits equal those of the token known on
    the host, at position 9 and at position 2 (look-back into the padding). First in the module: it resets the
    engine's cache before any request has filled it."""
    from tests.serving.driver import assert_pending_rows_read_on_the_device

    assert engine.runner.supports_async and engine.model.engram is not None
    assert_pending_rows_read_on_the_device(engine.runner, [(0, [0, 1], _prompt(30, 9)), (1, [2], _prompt(31, 2))])


@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_tokens=24, logprobs=0, ignore_eos=True),
                                    SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=24, logprobs=0,
                                                   ignore_eos=True)], ids=["greedy", "seeded"])
def test_same_output_alone_batched_and_preempted(engine, params):
    prompts = [_prompt(s) for s in range(3)]
    alone = [_serve(engine, [p], params) for p in prompts]
    pair, _ = _serve(engine, prompts[:2], params)
    before = engine.scheduler.num_preemptions
    trio, trio_lp = _serve(engine, prompts, params)
    assert engine.scheduler.num_preemptions > before, "three 44-token requests in 12 blocks must preempt"
    for i in range(3):
        toks, lps = alone[i][0][0], alone[i][1][0]
        assert trio[i] == toks and (i == 2 or pair[i] == toks)
        np.testing.assert_allclose(trio_lp[i], lps, atol=1e-4)
    assert engine.scheduler.num_free_blocks == engine.scheduler.num_blocks


def test_async_scheduling_gives_the_step_by_step_outputs(engine, monkeypatch):
    """V4.1 (Engram ids finished on the device) with async scheduling, the engine's default here: three requests
    under preemption give the tokens and logprobs of step-by-step scheduling."""
    assert engine.async_scheduling
    prompts = [_prompt(s) for s in range(10, 13)]
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=5, max_tokens=24, logprobs=0, ignore_eos=True)
    before = engine.scheduler.num_preemptions
    asyn, asyn_lp = _serve(engine, prompts, params)
    monkeypatch.setattr(engine, "async_scheduling", False)
    sync, sync_lp = _serve(engine, prompts, params)
    assert engine.scheduler.num_preemptions >= before + 2, "three 44-token requests in 12 blocks must preempt"
    assert asyn == sync
    for a, b in zip(asyn_lp, sync_lp):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_prompt_logprobs_match_the_full_forward(engine):
    prompt = _prompt(7, 40)
    engine.add_request("p", prompt, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2))
    got = None
    while engine.has_unfinished():
        for o in engine.step():
            got = o.prompt_logprobs if o.prompt_logprobs is not None else got
    logits = np.asarray(engine.model.logits(np.array(prompt)), np.float64)
    logp = logits - np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1, keepdims=True)) \
        - logits.max(1, keepdims=True)
    assert got[0] is None and len(got) == 40
    for p in range(1, 40):
        assert got[p].token_id == prompt[p] and abs(got[p].logprob - logp[p - 1, prompt[p]]) < 1e-4
        assert [t for t, _ in got[p].top] == list(np.argsort(-logp[p - 1])[:2])


def test_abort_frees_blocks_and_prefix_cache_hits(engine):
    p = _prompt(9, 80)
    engine.add_request("a", p, SamplingParams(temperature=0, max_tokens=10))
    for _ in range(3):
        engine.step()  # 32 + 32 + 16 prompt tokens: 10 full blocks registered
    out = engine.abort("a")
    assert out.finished and out.finish_reason == "abort"
    assert engine.scheduler.num_free_blocks == engine.scheduler.num_blocks and not engine.has_unfinished()
    engine.add_request("b", p[:75] + [5, 6], SamplingParams(temperature=0, max_tokens=2))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    # 9 full blocks match; with replay off the exact halo (8 layers x 7 rows) is recomputed from position 16
    assert outs[-1].num_cached_tokens == 72 and engine.scheduler.running == []


def test_bad_requests_name_the_problem(engine):
    for prompt, params, msg in (([], SamplingParams(), "empty"), ([600], SamplingParams(), "vocabulary"),
                                ([5] * 96, SamplingParams(), "maximum context length"),
                                ([5] * 10, SamplingParams(max_tokens=90), "maximum context length")):
        with pytest.raises(ValueError, match=msg):
            engine.add_request("bad", prompt, params)
    assert not engine.has_unfinished()


def test_offline_llm_matches_the_engine(engine, model, args):
    """`serving.LLM` over the same engine configuration: token-id and text prompts, n, and the greedy tokens
    the engine gives the same prompt."""
    from serving import LLM
    from serving.text.tokenizer import byte_level_tokenizer

    llm = LLM(model, tokenizer=byte_level_tokenizer(512), progress=False, compilation_cache_dir="", **args.flat())
    p = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = _prompt(21)
    (direct,), _ = _serve(engine, [prompt], p)
    res = llm.generate([prompt, "hello"], p)
    assert res[0].outputs[0].token_ids == direct and res[0].prompt_token_ids == prompt
    assert res[1].prompt_token_ids[0] == 0 and len(res[1].outputs[0].token_ids) == 6  # BOS + the text's bytes
    many = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=1.0, seed=4, n=3, max_tokens=5))
    assert [c.index for c in many[0].outputs] == [0, 1, 2] and len({tuple(c.token_ids) for c in many[0].outputs}) > 1
    with pytest.raises(ValueError, match="maximum context length is 96"):  # a V4.1 chat prompt is ~100 tokens
        llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=3))


def test_min_tokens_masks_stop_ids_until_reached(engine):
    """The greedy first tokens become stop ids: with min_tokens they cannot be sampled before min_tokens outputs
    (masked on the device, as vLLM), then the first one to come stops the request."""
    prompt = _prompt(31)
    (free,), _ = _serve(engine, [prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    stops = free[:3]
    (got,), _ = _serve(engine, [prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, min_tokens=3,
                                                        stop_token_ids=stops))
    assert not set(got[:3]) & set(stops), (free, got)
    assert len(got) == 8 or got[-1] in stops


def test_the_next_step_is_dispatched_before_the_text_is_made(engine, monkeypatch):
    """A step's text is made while the next step runs: the runner's calls and the output handling interleave as
    launch, collect, launch, text; and the tokens are those of the step-by-step run."""
    from serving.engine.output import OutputState

    prompt = _prompt(41, 8)  # a whole bucket: one prefill chunk
    p = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    monkeypatch.setattr(engine, "async_scheduling", False)  # the overlap of step-by-step scheduling
    (alone,), _ = _serve(engine, [prompt], p)
    events = []
    launch, collect, update = engine.runner.execute, engine.runner.collect, OutputState.update  # execute: dispatch
    monkeypatch.setattr(engine.runner, "execute", lambda *a, **k: events.append("launch") or launch(*a, **k))
    monkeypatch.setattr(engine.runner, "collect", lambda step: events.append("collect") or collect(step))
    monkeypatch.setattr(OutputState, "update", lambda self, *a: events.append("text") or update(self, *a))
    (got,), _ = _serve(engine, [prompt], p)
    assert got == alone
    # one prefill chunk and two decode steps; the last one finishes by length, so nothing follows it
    assert events == ["launch", "collect", "launch", "text", "collect", "launch", "text", "collect", "text"]


def _run(engine, requests):
    """Serve (id, prompt, params) to the end: {id: [its outputs]}."""
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    outs = {rid: [] for rid, *_ in requests}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id].append(o)
    return outs


TEN = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def stop_char(engine):
    """A prompt whose ten greedy tokens make text with a character past the first (the untrained model's bytes are
    mostly invalid UTF-8): its seed, that text and the character (a stop string), with the byte-level tokenizer."""
    from serving.text.tokenizer import byte_level_tokenizer

    engine.tokenizer = byte_level_tokenizer(512)
    try:
        for seed in range(50, 80):
            text = "".join(o.new_text for o in _run(engine, [("a", _prompt(seed), TEN)])["a"])
            stops = [c for c in text[1:-1] if c != "\ufffd"]
            if stops:
                return seed, text, stops[0]
        pytest.fail("no prompt of seeds 50..79 makes a character")
    finally:
        engine.tokenizer = None


def test_a_stop_string_drops_the_row_already_dispatched(engine, monkeypatch, stop_char):
    """A stop string is found in the text after the request's next step was dispatched: that row is dropped, the
    request ends at the string, the other request in the batch is unchanged and every block comes back."""
    from serving.text.tokenizer import byte_level_tokenizer

    monkeypatch.setattr(engine, "tokenizer", byte_level_tokenizer(512))
    seed, text, stop = stop_char
    p, other = TEN, _prompt(90)
    (other_alone,), _ = _serve(engine, [other], p)
    outs = _run(engine, [("a", _prompt(seed), SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                                             stop=[stop])), ("b", other, p)])
    a, b = outs["a"], outs["b"]
    assert a[-1].finish_reason == "stop" and a[-1].stop_reason == stop
    assert "".join(o.new_text for o in a) == text[: text.find(stop)]
    assert sum((o.new_token_ids for o in b), []) == other_alone
    assert engine._inflight is None and engine.scheduler.num_free_blocks == engine.scheduler.num_blocks


def test_step_by_step_a_stop_string_ends_the_request_before_its_next_row(engine, monkeypatch, stop_char):
    """Without async scheduling a stop string is found when its step is collected, before the next step is
    scheduled: the scheduler ends the request there, so no row of it follows the stop string's token; the outputs
    are those of async scheduling."""
    from serving.text.tokenizer import byte_level_tokenizer

    monkeypatch.setattr(engine, "tokenizer", byte_level_tokenizer(512))
    seed, _, stop = stop_char
    prompt, p = _prompt(seed), SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, stop=[stop])
    asyn = _run(engine, [("a", prompt, p)])["a"]
    monkeypatch.setattr(engine, "async_scheduling", False)
    ends, plan = [], engine.runner.plan
    monkeypatch.setattr(engine.runner, "plan", lambda chunks, *a, **k: ends.append(chunks[0].end) or
                        plan(chunks, *a, **k))
    sync = _run(engine, [("a", prompt, p)])["a"]
    assert [(o.new_token_ids, o.new_text, o.finish_reason, o.stop_reason) for o in sync] == \
        [(o.new_token_ids, o.new_text, o.finish_reason, o.stop_reason) for o in asyn]
    n_out = sum(len(o.new_token_ids) for o in sync)
    assert sync[-1].stop_reason == stop and n_out < 10
    assert ends[-1] == len(prompt) + n_out - 1  # the row that sampled the stop string's last token
    assert engine._inflight is None and engine.scheduler.num_free_blocks == engine.scheduler.num_blocks
