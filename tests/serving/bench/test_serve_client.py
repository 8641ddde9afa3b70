"""serve.py's client against an in-process fake OpenAI streaming server (httpx.MockTransport): payloads,
headers, SSE parsing, usage and cached tokens, sequential turns per session, the lane cap, error counting."""

import asyncio
import itertools
import json
import time

import httpx
import pytest

from serving.bench import serve

FIRST_S, GAP_S = 0.02, 0.010


class FakeServer:
    """Streams max_tokens one-token chunks; a session's cached tokens = its previous prompt's length.
    Requests whose prompt starts with token id 13 get HTTP 400 (an OpenAI error body)."""

    def __init__(self, endpoint: str):
        self.endpoint = endpoint
        self.requests: list[dict] = []  # body, headers, start, end
        self.in_flight = self.max_in_flight = 0
        self.last_prompt: dict[str, int] = {}

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        entry = {"path": request.url.path, "body": body, "headers": dict(request.headers),
                 "start": time.perf_counter()}
        self.requests.append(entry)
        if self.endpoint == "completions":
            n_prompt = len(body["prompt"])
            rejected = body["prompt"][0] == 13
        else:
            n_prompt = sum(len(m["content"]) for m in body["messages"])
            rejected = False
        if rejected:
            entry["end"] = time.perf_counter()
            return httpx.Response(400, json={"error": {"message": "prompt starts with 13", "type": "BadRequest"}})
        session = request.headers["x-session-id"]
        cached = self.last_prompt.get(session, 0)
        self.last_prompt[session] = n_prompt
        return httpx.Response(200, content=self._stream(body, n_prompt, cached, entry),
                              headers={"content-type": "text/event-stream"})

    async def _stream(self, body, n_prompt, cached, entry):
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        n = body["max_tokens"]
        if self.endpoint == "chat":
            yield b'data: {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}\n\n'
        yield b": ping\n\n"
        for i in range(n):
            await asyncio.sleep(FIRST_S if i == 0 else GAP_S)
            choice = {"index": 0, "text": "x"} if self.endpoint == "completions" else {"index": 0, "delta": {"content": "x"}}
            yield f"data: {json.dumps({'choices': [choice]})}\n\n".encode()
        usage = {"prompt_tokens": n_prompt, "completion_tokens": n,
                 "prompt_tokens_details": {"cached_tokens": cached}}
        self.in_flight -= 1  # before the last yields: the client stops reading at [DONE]
        entry["end"] = time.perf_counter()
        yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode()
        yield b"data: [DONE]\n\n"


def _run(fake, *flags):
    args = serve.parse_args(["--base-url", "http://fake:1/v1", "--model", "m", *flags])
    return serve.run(args, transport=httpx.MockTransport(fake))


def test_multi_turn_sessions_are_sequential_lanes_capped_and_usage_counted():
    fake = FakeServer("completions")
    out = _run(fake, "--dataset", "prefix-repetition", "--num-prompts", "4", "--num-prefixes", "2",
               "--prefix-len", "20", "--suffix-len", "5", "--turns", "3", "--output-len", "4",
               "--max-concurrency", "2", "--ignore-eos", "--api-key", "sk-test", "--token-id-range", "20,400")
    s = out["summary"]
    assert (s["completed"], s["failed"]) == (12, 0)
    assert fake.max_in_flight == 2
    for r in fake.requests:
        b, h = r["body"], r["headers"]
        assert r["path"] == "/v1/completions"
        assert b["stream"] is True and b["stream_options"] == {"include_usage": True}
        assert b["max_tokens"] == b["min_tokens"] == 4 and b["ignore_eos"] is True and b["temperature"] == 0.0
        assert all(isinstance(t, int) for t in b["prompt"]) and h["authorization"] == "Bearer sk-test"
    by_session = {}
    for r in fake.requests:
        by_session.setdefault(r["headers"]["x-session-id"], []).append(r)
    assert len(by_session) == 4
    for reqs in by_session.values():
        assert [len(r["body"]["prompt"]) for r in reqs] == [25, 34, 43]  # + reply 4 + suffix 5 per turn
        for prev, nxt in itertools.pairwise(reqs):
            assert nxt["start"] >= prev["end"]  # turn k+1 only after turn k finished
            assert nxt["body"]["prompt"][:len(prev["body"]["prompt"])] == prev["body"]["prompt"]
    # usage: 4 sessions x (25 + 34 + 43) prompt tokens; cached = previous turn's prompt (0, 25, 34)
    assert s["total_input_tokens"] == 4 * 102 and s["total_output_tokens"] == 48
    assert s["prefix_hit_rate"] == pytest.approx(59 / 102)
    # timing: the first chunk after >= FIRST_S (a late chunk only adds); 3 pooled gaps per request, whose mean
    # a late first chunk can shorten on a loaded machine, but not halve
    assert s["p50_ttft_ms"] >= FIRST_S * 1000 * 0.9
    assert s["mean_itl_ms"] >= GAP_S * 1000 * 0.5
    assert s["total_token_throughput"] == pytest.approx((408 + 48) / s["duration"])


def test_errors_are_counted_with_status_and_message_and_the_run_goes_on():
    fake = FakeServer("completions")
    # ids in [13, 15): about half of the prompts start with 13 and are rejected with HTTP 400
    out = _run(fake, "--num-prompts", "12", "--input-len", "6", "--output-len", "3", "--max-concurrency", "4",
               "--token-id-range", "13,15", "--seed", "5")
    rejected = sum(r["body"]["prompt"][0] == 13 for r in fake.requests)
    assert 0 < rejected < 12
    s = out["summary"]
    assert s["failed"] == rejected and s["completed"] == 12 - rejected
    assert out["errors"] == [{"error": "HTTP 400: prompt starts with 13", "count": rejected}]
    assert s["total_output_tokens"] == 3 * (12 - rejected)


def test_chat_endpoint_skips_the_role_chunk_and_sends_messages(tmp_path):
    fake = FakeServer("chat")
    path = tmp_path / "out.json"
    out = _run(fake, "--endpoint", "chat", "--num-prompts", "3", "--input-len", "9", "--output-len", "5",
               "--output-json", str(path), "--num-warmups", "1", "--save-requests")
    assert len(fake.requests) == 4 and fake.requests[0]["headers"]["x-session-id"] == "warmup-0"
    measured = fake.requests[1:]
    assert all(r["path"] == "/v1/chat/completions" for r in measured)
    assert all(r["body"]["messages"][0]["role"] == "user" and len(r["body"]["messages"][0]["content"]) == 9
               for r in measured)
    s = out["summary"]
    assert s["completed"] == 3 and s["total_output_tokens"] == 15
    # the role-only opening chunk (sent at once) is not a token: 5 chunks each, the first after FIRST_S
    assert [len(r["chunk_times"]) for r in out["requests"]] == [5, 5, 5]
    assert s["p50_ttft_ms"] >= FIRST_S * 1000 * 0.9
    assert json.loads(path.read_text())["summary"] == s


def _profiling_server(fake, start_status=200):
    """The fake server plus the profiler routes; `calls` records (route, auth header, requests seen so far)."""
    calls = []

    async def handler(request: httpx.Request) -> httpx.Response:
        route = request.url.path
        if route in ("/start_profile", "/stop_profile"):
            calls.append((route, request.headers.get("authorization"), len(fake.requests),
                          sum("end" in r for r in fake.requests)))
            if route == "/start_profile" and start_status != 200:
                return httpx.Response(start_status, json={"error": {"message": "profiling is off: no --profile-dir"}})
            return httpx.Response(200, json={"trace_dir": "/traces/run"} if route == "/stop_profile" else {})
        return await fake(request)

    return handler, calls


def test_profile_brackets_the_timed_run_with_the_key():
    fake = FakeServer("completions")
    handler, calls = _profiling_server(fake)
    args = serve.parse_args(["--base-url", "http://fake:1/v1", "--model", "m", "--num-prompts", "3", "--input-len",
                             "5", "--output-len", "2", "--num-warmups", "1", "--api-key", "k", "--profile"])
    out = serve.run(args, transport=httpx.MockTransport(handler))
    # started after the warm-up request and before any timed one; stopped once all four had ended
    assert calls == [("/start_profile", "Bearer k", 1, 1), ("/stop_profile", "Bearer k", 4, 4)]
    assert out["profile"] == {"trace_dir": "/traces/run"} and out["summary"]["completed"] == 3


def test_profile_refused_by_the_server_is_an_error_naming_the_route():
    fake = FakeServer("completions")
    handler, calls = _profiling_server(fake, start_status=400)
    args = serve.parse_args(["--base-url", "http://fake:1", "--model", "m", "--num-prompts", "1", "--profile"])
    with pytest.raises(RuntimeError, match="POST /start_profile failed: HTTP 400: profiling is off"):
        serve.run(args, transport=httpx.MockTransport(handler))
    assert [c[0] for c in calls] == ["/start_profile"] and not fake.requests


def test_same_prompts_as_the_workload_generator():
    fake = FakeServer("completions")
    _run(fake, "--num-prompts", "3", "--input-len", "7", "--output-len", "1", "--seed", "11")
    args = serve.parse_args(["--num-prompts", "3", "--input-len", "7", "--output-len", "1", "--seed", "11"])
    expected = sorted(s.turns[0].prompt_ids for s in serve.make_sessions(args))
    assert sorted(r["body"]["prompt"] for r in fake.requests) == expected


@pytest.mark.parametrize("flags, match", [
    (["--turns", "2"], "prefix-repetition"),
    (["--max-concurrency", "0"], "max-concurrency"),
    (["--percentiles", "50,100"], "percentiles"),
    (["--token-id-range", "10"], "token-id-range"),
    (["--goodput", "ttft=5"], "goodput"),
])
def test_bad_flags_name_the_flag(flags, match):
    with pytest.raises(ValueError, match=match):
        serve.parse_args(flags)
