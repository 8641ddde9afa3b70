"""`serving.bench.async_scheduling`'s bookkeeping against a scripted engine (no model): the decode window leaves the
prefills and the drain out, and a round whose modes emit other tokens stops the bench."""

import argparse
import types

import pytest

from serving.bench import async_scheduling as bench
from serving.engine.request import RequestOutput


class ScriptedEngine:
    """Two prefill steps of `prefill_ms` each, then one token per request per step of `decode_ms`; request i gives its
    first token i steps late (a staggered admission). Tokens are `offset` + the step count."""

    def __init__(self, clock, prefill_ms=50.0, decode_ms=10.0, offset=0):
        self.clock, self.prefill_ms, self.decode_ms, self.offset = clock, prefill_ms, decode_ms, offset
        self.left, self.n = {}, 0

    def add_request(self, rid, prompt, params):
        self.left[rid] = (len(self.left), params.max_tokens)

    def has_unfinished(self):
        return bool(self.left)

    def step(self):
        self.n += 1
        self.clock.t += (self.prefill_ms if self.n <= 2 else self.decode_ms) / 1000
        outs = []
        for rid, (lag, left) in list(self.left.items()):
            if self.n > 2 + lag:
                outs.append(RequestOutput(rid, [self.offset + self.n], "", finished=left == 1))
                self.left[rid] = (lag, left - 1)
                if left == 1:
                    del self.left[rid]
        if not self.left:
            self.n = 0
        return outs


def _clock(monkeypatch):
    clock = types.SimpleNamespace(t=0.0)
    monkeypatch.setattr(bench, "time", types.SimpleNamespace(perf_counter=lambda: clock.t))
    return clock


def test_the_window_holds_only_steps_where_every_request_decodes(monkeypatch):
    clock = _clock(monkeypatch)
    got = bench.decode_round(ScriptedEngine(clock), batch=3, context=4, steps=10, vocab=100, seed=0)
    # request 2 starts at step 5, request 0 finishes at step 12: steps 6..11 are the window (prefills at 50 ms out)
    assert got["window_steps"] == 6
    assert got["step_ms"] == pytest.approx(10.0)
    assert [len(t) for t in got["tokens"]] == [10, 10, 10]


def test_a_round_with_other_tokens_stops_the_bench(monkeypatch):
    clock = _clock(monkeypatch)
    a = argparse.Namespace(model="scripted", dtype="float32", context=4, steps=8, repeats=2, batches=[2])
    model = types.SimpleNamespace(config=types.SimpleNamespace(vocab_size=100))
    monkeypatch.setattr(bench, "engines", lambda m, args: {"async": ScriptedEngine(clock, decode_ms=8.0),
                                                           "step": ScriptedEngine(clock)})
    res = bench.run(model, a)["batches"]["2"]
    assert res["async_ms"] == pytest.approx(8.0) and res["step_ms"] == pytest.approx(10.0)
    assert res["async_over_step"] == pytest.approx(0.8) and res["same_tokens"]
    monkeypatch.setattr(bench, "engines", lambda m, args: {"async": ScriptedEngine(clock, offset=1),
                                                           "step": ScriptedEngine(clock)})
    with pytest.raises(SystemExit, match="other greedy tokens"):
        bench.run(model, a)
