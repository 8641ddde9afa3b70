"""The agentic runner against an in-process fake server (httpx.MockTransport) with an ideal prefix cache per
data-parallel rank and the real DP router: lanes, subagents inline, gating, think time, warm-up, session ids,
mirror pinning and lag; and its metric math on a hand-built timeline (both ITL definitions, hit rates)."""

import asyncio
import json
import time

import httpx
import pytest

from serving.bench import agentic_runner, agentic_workload as aw, metrics
from serving.bench.agentic_runner import PointSpec, Sent
from serving.bench.metrics import RequestRecord
from serving.bench.workloads import Turn
from serving.engine.dp_router import DPRouter, RouterConfig

GAP_S = 0.004
CFG = aw.AgenticConfig(block_size=8, system_prompt_len=16, marker_len=3, task_len=5, max_context=512,
                       turns_median=4, max_turns=6, output_median=4, max_output=8, tool_blocks_median=1,
                       max_tool_blocks=2, think_median_s=0.01, think_cap_s=0.03)


class FakeServer:
    """Streams max_tokens one-token chunks GAP_S apart; cached_tokens from an ideal block cache on the rank
    the real DP router picks; /metrics exports the router's in-flight count per rank."""

    def __init__(self, ranks: int = 1, policy: str = "sticky", rank0_arrives_late_s: float = 0.0):
        self.rank0_arrives_late_s = rank0_arrives_late_s  # network jitter: '.rank0' copies reach the router late
        self.router = DPRouter(RouterConfig(ranks, policy, max_inflight=1000))
        self.caches = [set() for _ in range(ranks)]
        self.log: list[dict] = []

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            lines = [f'dsv41:dp_rank_requests{{model_name="m",rank="{r}"}} {float(n)}'
                     for r, n in enumerate(self.router.inflight)]
            return httpx.Response(200, text="\n".join(lines) + "\n")
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "fake-model"}]})
        body = json.loads(request.content)
        if request.headers.get("x-session-id", "").endswith(".rank0"):
            await asyncio.sleep(self.rank0_arrives_late_s)
        rank = self.router.route(dict(request.headers), body["prompt"])
        cached, _ = aw.block_reuse([body["prompt"]], CFG.block_size, self.caches[rank])
        entry = {"session": request.headers.get("x-session-id"), "prompt": body["prompt"], "rank": rank,
                 "max_tokens": body["max_tokens"], "start": time.perf_counter(), "end": None}
        self.log.append(entry)
        return httpx.Response(200, content=self._stream(body, cached, rank, entry),
                              headers={"content-type": "text/event-stream"})

    async def _stream(self, body, cached, rank, entry):
        for _ in range(body["max_tokens"]):
            await asyncio.sleep(GAP_S)
            yield f"data: {json.dumps({'choices': [{'index': 0, 'text': 'x'}]})}\n\n".encode()
        self.router.finish(rank)
        entry["end"] = time.perf_counter()
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"],
                 "prompt_tokens_details": {"cached_tokens": cached}}
        yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode()
        yield b"data: [DONE]\n\n"


def _run(fake, config=CFG, **spec):
    return agentic_runner.run_point("http://fake:1/v1", config, PointSpec(**spec), transport=httpx.MockTransport(fake),
                                    keep_requests=True)


def test_lanes_run_trees_with_inline_subagents_gating_think_time_and_warmup():
    cfg = aw.AgenticConfig(**{**vars(CFG), "subagent_prob": 1.0, "gating_fraction": 0.5})
    fake = FakeServer()
    out = _run(fake, cfg, concurrency=2, num_sessions=5, seed=1)
    trees = aw.session_trees(cfg, 1, 5)
    reqs = out["requests"]
    s = out["summary"]
    assert s["failed"] == 0 and out["trees_started"] == out["trees_finished"] == 5
    # warm-up: each lane's first tree (0 and 1) sends root turn warm_start_turn - 1, excluded from the metrics
    warm = [r for r in reqs if r["warmup"]]
    assert sorted((r["session_id"], r["turn"]) for r in warm) == sorted(
        (t.session_id, t.warm_start_turn - 1) for t in trees[:2])
    assert s["warmup_requests"] == 2 and s["completed"] == len(reqs) - 2
    # every request of a tree, subagents too, carries the tree's X-Session-ID; all requests were sent
    expected = sum(t.num_requests for t in trees[2:]) + sum(len(aw.SessionTree.requests_in_order(t, t.warm_start_turn))
                                                            for t in trees[:2])
    assert s["completed"] == expected
    for e in fake.log:
        assert any(e["session"] == t.session_id for t in trees)
    by_conv = {}
    for r in reqs:
        if not r["warmup"]:
            by_conv.setdefault(r["session_id"], {})[r["turn"]] = r
    gated = background = 0
    for t in trees:
        root = by_conv[t.session_id]
        for k in sorted(root)[1:]:  # think time end-to-start, capped
            assert root[k]["send_time"] >= root[k - 1]["end_time"] + t.root.think_s[k] - 1e-3
        for sub in t.root.subagents:
            if sub.after_turn not in root:
                assert sub.conversation.conversation_id not in by_conv  # spawned before the profile began
                continue
            turns = by_conv[sub.conversation.conversation_id]
            assert min(x["send_time"] for x in turns.values()) >= root[sub.after_turn]["end_time"]
            if sub.gating:  # the parent's next turn waits for the whole subagent
                assert root[sub.after_turn + 1]["send_time"] >= max(x["end_time"] for x in turns.values())
                gated += 1
            elif max(x["end_time"] for x in turns.values()) > root[sub.after_turn + 1]["send_time"]:
                background += 1  # ran alongside its parent
    assert gated >= 2 and background >= 1
    assert out["max_requests_in_flight"] > 2  # subagents run inside their lane, beyond the lane count
    assert s["subagent_requests"] > 0 and s["acceptance_length"] is None
    # an ideal cache on the server: the client's theoretical count is what the server reports
    assert s["prefix_hit_rate"] == pytest.approx(s["theoretical_prefix_hit_rate"]) and s["prefix_hit_rate"] > 0.5


def test_duration_stops_sending_and_trees_do_not_depend_on_concurrency():
    fake = FakeServer()
    t0 = time.perf_counter()
    out = _run(fake, concurrency=3, duration_s=0.4, seed=2)
    assert time.perf_counter() - t0 < 10
    measured = [r for r in out["requests"] if not r["warmup"]]
    profile_start = min(r["send_time"] for r in measured)
    assert max(r["send_time"] for r in measured) <= profile_start + 0.4 + 0.05
    assert out["trees_started"] >= 3
    one = FakeServer()
    _run(one, concurrency=1, num_sessions=4, seed=2)
    three = FakeServer()
    _run(three, concurrency=3, num_sessions=4, seed=2)
    # tree 3 runs from its first turn in both (lanes' first trees start mid-way); same prompts either way
    tree3 = aw.session_tree(CFG, 2, 3).session_id
    assert ([e["prompt"] for e in one.log if e["session"] == tree3]
            == [e["prompt"] for e in three.log if e["session"] == tree3])


def test_mirror_pins_each_copy_to_its_rank_and_lag_staggers_the_copies():
    fake = FakeServer(ranks=2, rank0_arrives_late_s=0.02)
    out = _run(fake, concurrency=2, num_sessions=4, seed=3, mirror_ranks=2, mirror_lag_s=0.0)
    m = out["mirror"]
    assert m["pins_confirmed"] == 4 and m["pins_misplaced"] == 0
    for k in range(4):
        sid = aw.session_tree(CFG, 3, k).session_id
        for r in range(2):
            assert fake.router.owner[f"session:{sid}.rank{r}"] == r
    sent = [e for e in fake.log if not e["prompt"] or len(e["prompt"]) != CFG.block_size]
    assert {e["rank"] for e in sent if e["session"].endswith(".rank0")} == {0}
    assert {e["rank"] for e in sent if e["session"].endswith(".rank1")} == {1}
    # identical work on both ranks: same prompts per copy, and each rank's cache hits as one copy's would
    per_copy = [[e["prompt"] for e in sent if e["session"].endswith(f".rank{r}")] for r in range(2)]
    assert sorted(map(tuple, per_copy[0])) == sorted(map(tuple, per_copy[1]))
    s = out["summary"]
    assert s["prefix_hit_rate"] == pytest.approx(s["theoretical_prefix_hit_rate"])
    assert m["window_token_throughput"] > 0

    lagged = FakeServer(ranks=2)
    out = _run(lagged, concurrency=1, num_sessions=2, seed=3, mirror_ranks=2, mirror_lag_s=0.3)
    measured = [r for r in out["requests"] if not r["warmup"]]
    first = {d: min(r["send_time"] for r in measured if r["cache_domain"] == d) for d in (0, 1)}
    assert first[1] - first[0] >= 0.3 - 0.01
    assert out["mirror"]["lag_s"] == 0.3


def test_point_spec_names_bad_settings():
    with pytest.raises(ValueError, match="--duration-s"):
        PointSpec(2)
    with pytest.raises(ValueError, match="need --num-sessions"):
        PointSpec(2, duration_s=5, mirror_ranks=2)
    with pytest.raises(ValueError, match="mirror_ranks"):
        PointSpec(2, num_sessions=3, mirror_ranks=1)


def _rec(send, chunks, prompt, out, cached, session="t0", turn=0, error=None):
    return RequestRecord(send, chunks[-1] if chunks else send + 1, list(chunks), prompt_tokens=prompt,
                         completion_tokens=out, cached_tokens=cached, error=error, session_id=session, turn=turn)


def test_point_summary_on_a_hand_built_timeline():
    B = 4
    sys_ = (1, 2, 3, 4)
    p0 = sys_ + (5, 6, 7, 8)                 # warm-up: primes 2 blocks
    p1 = p0 + (9, 10, 11, 12)                # root turn: 8 of 12 re-sent
    p2 = sys_ + (20, 21, 22, 23)             # subagent: 4 of 8 re-sent (the shared system block)
    p3 = p1 + (13, 14, 15, 16, 17, 18, 19, 30)  # root turn: 12 of 20 re-sent
    sent = [
        Sent(_rec(0.0, [0.5, 0.6], 8, 2, 0), Turn((("user", p0),), 2), warmup=True),
        # A: 5 tokens, chunks 0.1 s apart -> per-request ITL 0.1 s, four pooled gaps of 0.1 s
        Sent(_rec(1.0, [1.2, 1.3, 1.4, 1.5, 1.6], 12, 5, 8), Turn((("user", p1),), 5)),
        # B (subagent): 3 tokens in 2 chunks, 1 s apart -> per-request ITL (2.5 - 1.5) / 2 = 0.5 s, one gap 1.0 s
        Sent(_rec(1.0, [1.5, 2.5], 8, 3, 4, session="t0.sub0"), Turn((("user", p2),), 3), subagent=True),
        # C: 2 tokens -> per-request ITL 0.3 s, one gap 0.3 s; the server served only 8 of its 12 re-sent tokens
        Sent(_rec(3.0, [3.4, 3.7], 20, 2, 8, turn=1), Turn((("user", p3),), 2)),
        # D: failed, HTTP 503
        Sent(_rec(3.5, [], 20, 0, None, error="HTTP 503: waiting queue is full"), Turn((("user", p3),), 2)),
    ]
    s = agentic_runner.summarize_point(sent, [50, 90, 99], B)
    assert (s["completed"], s["failed"], s["warmup_requests"], s["subagent_requests"]) == (3, 1, 1, 1)
    assert s["errors_by_kind"] == {"HTTP 503": 1}
    # TTFT 0.2, 0.5, 0.4 s
    assert s["median_ttft_ms"] == pytest.approx(400) and s["p90_ttft_ms"] == pytest.approx(480)
    # InferenceX: per-request ITL [0.1, 0.5, 0.3] -> P50 0.3 s, P90 0.46 s; interactivity = 1 / those
    assert s["median_tpot_ms"] == pytest.approx(300) and s["p90_tpot_ms"] == pytest.approx(460)
    assert s["p50_interactivity_tok_s"] == pytest.approx(1 / 0.3)
    assert s["p90_interactivity_tok_s"] == pytest.approx(1 / 0.46)
    assert s["mean_interactivity_tok_s"] == pytest.approx(1 / 0.3)
    # vLLM: pooled gaps [0.1 x4, 1.0, 0.3] -> mean 1.7 / 6, median 0.1, P90 0.65
    assert s["mean_itl_ms"] == pytest.approx(1700 / 6) and s["median_itl_ms"] == pytest.approx(100)
    assert s["p90_itl_ms"] == pytest.approx(650)
    # E2EL 0.6, 1.5, 0.7 s; duration 1.0 -> 4.5 (the failed request's end) = 3.5 s
    assert s["median_e2el_ms"] == pytest.approx(700) and s["duration"] == pytest.approx(3.5)
    # throughput counts cached input: (12 + 8 + 20) prompt + 10 output tokens over 3.5 s
    assert s["total_token_throughput"] == pytest.approx(50 / 3.5)
    # theoretical (warm-up primed, successful measured requests): (8 + 4 + 12) / 40; achieved (8 + 4 + 8) / 40
    assert s["theoretical_prefix_hit_rate"] == pytest.approx(24 / 40)
    assert s["prefix_hit_rate"] == pytest.approx(20 / 40)
    assert s["acceptance_length"] is None
    # the mirror window: A (12 + 5 tokens, ended 1.6) and B (8 + 3, ended 2.5) end in [1, 3]; C ends at 3.7
    records = [x.record for x in sent if not x.warmup]
    assert metrics.window_token_throughput(records, 1.0, 3.0) == pytest.approx(28 / 2.0)
    assert metrics.window_token_throughput(records, 3.0, 3.0) is None
