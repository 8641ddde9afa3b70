"""Async scheduling on the tiny V4 oracle config (random weights, float32, replay off, so outputs are exact): each
step is scheduled and dispatched before the previous one is collected, its decode rows reading that step's tokens
on the device. The tokens, logprobs and finishes are the step-by-step engine's, under concurrency, preemption, a
token finish with a row already dispatched (stop ids, EOS), a length limit and an abort; every block comes back.
V4.1 (Engram ids finished on the device) is tested in tests/serving/engine/test_engine.py."""

import dataclasses

import numpy as np
import pytest

import dsv41
from dsv41.config import load_config
from serving.engine.args import EngineArgs
from serving.engine.engine import Engine
from serving.runtime.batch import SeqChunk
from serving.runtime.kv_cache import CacheLayout
from serving.runtime.sampling_params import SamplingParams
from tests.serving.driver import assert_pending_rows_read_on_the_device

CONFIG = "tests/fixtures/oracle/v4_tiny/config.json"


@pytest.fixture(scope="module")
def model():
    return dsv41.random_model(load_config(CONFIG), seed=5)


@pytest.fixture(scope="module")
def engine(model):
    """Five KV blocks of 128 tokens: three 100-token prompts fit, their 100 outputs do not (preemption)."""
    probe = CacheLayout(model.config, 1, 128, 4, "auto", "float32")
    args = EngineArgs.of(max_num_seqs=3, max_num_batched_tokens=64, max_model_len=512, block_size=128,
                         swa_bounded_replay=False, token_buckets=(8, 64),
                         kv_cache_memory=3 * probe.bytes_per_slot() + 5 * probe.bytes_per_block())
    eng = Engine(model, None, args, progress=False)
    assert eng.async_scheduling and eng.scheduler.num_blocks == 5
    return eng


def _prompt(seed, n=100):
    return [int(t) for t in np.random.default_rng(seed).integers(3, 250, n)]


def _serve(engine, requests, *, abort_after: dict | None = None):
    """Run (id, prompt, params) to the end: {id: (tokens, logprobs, finish reason)}; `abort_after` {id: n}
    aborts a request once n of its tokens are out."""
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    toks, lps, reason = {rid: [] for rid, *_ in requests}, {rid: [] for rid, *_ in requests}, {}
    while engine.has_unfinished():
        for o in engine.step():
            toks[o.request_id] += o.new_token_ids
            lps[o.request_id] += [x.logprob for x in o.new_logprobs or []]
            if o.finished:
                reason[o.request_id] = o.finish_reason
        for rid, n in (abort_after or {}).items():
            if len(toks[rid]) >= n and rid not in reason:
                engine.abort(rid)
                reason[rid] = "abort"
    assert engine._inflight is None and engine.scheduler.num_free_blocks == engine.scheduler.num_blocks
    return {rid: (toks[rid], lps[rid], reason.get(rid)) for rid, *_ in requests}


def test_a_pending_token_is_read_on_the_device(engine):
    """The runner: a chunk whose last token is pending reads it from the previous launched step's sampled tokens
    (hash-routed layer 0 included): the logits of the token known on the host; without that step it is refused.
    (First in the module: it resets the engine's cache, before any request has filled it.)"""
    prompt = _prompt(30, 9)
    with pytest.raises(ValueError, match="previous launched step"):
        engine.runner.launch([SeqChunk(slot=0, block_table=[0], token_ids=prompt, start=9, end=10, pending_row=0)],
                             [None])
    assert_pending_rows_read_on_the_device(engine.runner, [(0, [0], prompt)])


def _both(engine, monkeypatch, requests, **kw):
    """The requests served step by step, then with async scheduling: (outputs, preemptions) of each."""
    runs = []
    for mode in (False, True):
        monkeypatch.setattr(engine, "async_scheduling", mode)
        before = engine.scheduler.num_preemptions
        runs.append((_serve(engine, requests, **kw), engine.scheduler.num_preemptions - before))
    return runs


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=100, logprobs=0, ignore_eos=True),
    SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=100, logprobs=0, ignore_eos=True)],
    ids=["greedy", "seeded"])
def test_async_steps_give_the_step_by_step_outputs_under_preemption(engine, monkeypatch, params):
    requests = [(f"r{i}", _prompt(i), params) for i in range(3)]
    (sync, sync_preempted), (asyn, async_preempted) = _both(engine, monkeypatch, requests)
    assert sync_preempted and async_preempted, "three 200-token requests in 5 blocks must preempt in either mode"
    for rid, *_ in requests:
        assert asyn[rid][0] == sync[rid][0] and len(sync[rid][0]) == 100 and asyn[rid][2] == "length"
        np.testing.assert_allclose(asyn[rid][1], sync[rid][1], atol=1e-5)


def test_token_finishes_and_aborts_with_a_row_in_flight(engine, monkeypatch):
    """A stop id, EOS and an abort each end a request whose next row is already dispatched: the row is dropped,
    the outputs equal the step-by-step engine's and the other requests run on unchanged."""
    greedy = SamplingParams(temperature=0, max_tokens=40)
    (free,) = _serve(engine, [("x", _prompt(20, 30), dataclasses.replace(greedy, ignore_eos=True))]).values()
    stop_id = free[0][5]  # the 6th greedy token stops the same prompt early
    eos_first = engine.eos_id
    requests = [("stop", _prompt(20, 30), dataclasses.replace(greedy, stop_token_ids=[stop_id])),
                ("long", _prompt(21, 30), dataclasses.replace(greedy, ignore_eos=True)),
                ("abort", _prompt(22, 30), dataclasses.replace(greedy, ignore_eos=True))]
    (sync, _), (asyn, _) = _both(engine, monkeypatch, requests, abort_after={"abort": 3})
    assert asyn == sync
    assert asyn["stop"][0] == free[0][:free[0].index(stop_id) + 1] and asyn["stop"][2] == "stop"
    assert len(asyn["long"][0]) == 40 and asyn["abort"][2] == "abort"
    # EOS: a vocabulary whose greedy first output is EOS (the prompt's next token) ends after one token
    monkeypatch.setattr(engine, "eos_id", free[0][0])
    (got,) = _serve(engine, [("eos", _prompt(20, 30), greedy)]).values()
    monkeypatch.setattr(engine, "eos_id", eos_first)
    assert got[0] == [free[0][0]] and got[2] == "stop"


def test_the_next_step_is_dispatched_before_the_previous_is_collected(engine, monkeypatch):
    """The runner's calls interleave as launch, launch, collect, text: step n + 1 goes out before step n is read
    (its row reads n's token on the device). Three tokens: after the second decode step is dispatched its token
    ends the request by length, so no step follows it."""
    from serving.engine.output import OutputState

    prompt, p = _prompt(41, 20), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    events = []
    launch, collect, update = engine.runner.execute, engine.runner.collect, OutputState.update  # execute: dispatch
    monkeypatch.setattr(engine.runner, "execute", lambda *a, **k: events.append("launch") or launch(*a, **k))
    monkeypatch.setattr(engine.runner, "collect", lambda step: events.append("collect") or collect(step))
    monkeypatch.setattr(OutputState, "update", lambda self, *a: events.append("text") or update(self, *a))
    _serve(engine, [("a", prompt, p)])
    assert events == ["launch", "launch", "collect", "text", "launch", "collect", "text", "collect", "text"]


def test_what_turns_async_scheduling_off(model, engine, monkeypatch):
    """The banner line, and the reasons: the flag, EPLB, and Engram tables in host memory (the host gathers a
    step's rows by their hash ids)."""
    from serving.engine.engine import async_blocker

    assert engine.scheduling_summary().startswith("async") and async_blocker(engine.args, engine.runner, False) is None
    off = dataclasses.replace(engine.args, scheduler=dataclasses.replace(engine.args.scheduler, async_scheduling=False))
    assert async_blocker(off, engine.runner, False) == "--no-async-scheduling"
    assert async_blocker(engine.args, engine.runner, True) == "EPLB"
    monkeypatch.setattr(model, "engram_tables", object())  # `--engram-cpu-offload`
    assert not engine.runner.supports_async
    assert async_blocker(engine.args, engine.runner, False) == "Engram tables in host memory"
    monkeypatch.setattr(engine, "async_scheduling", False)
    monkeypatch.setattr(engine, "_async_blocker", async_blocker(engine.args, engine.runner, False))
    assert engine.scheduling_summary() == "one step at a time (Engram tables in host memory)"
