"""The real server in a subprocess, driven with the official `openai` client and raw HTTP: both endpoints,
streaming and not, usage and cached tokens, stops, n, seeds, logprobs, tool-call history, disconnects,
bad input (4xx naming the problem; the server keeps serving), the API key, traces via /start_profile and
/stop_profile, and 256 concurrent streams."""

import asyncio
import gzip
import json
import re
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

import dsv41
from serving.api.server import build_app
from serving.engine.trace_report import read_trace
from serving.text.encoding import encode_messages_to_ids
from serving.text.tokenizer import byte_level_tokenizer
from tests.serving.server_process import running_server

KEY = "test-key"
TOK = byte_level_tokenizer(512)


@pytest.fixture(scope="module")
def server_log(tmp_path_factory):
    return tmp_path_factory.mktemp("server") / "server.log"


@pytest.fixture(scope="module")
def server(tmp_path_factory, server_log):
    args = ["--model", "tiny", "--api-key", KEY, "--max-num-seqs", "8", "--max-num-batched-tokens", "64",
            "--max-model-len", "2048", "--block-size", "16", "--token-buckets", "8,16,32,64", "--no-background-compile",
            "--disable-access-log", "--max-request-body-bytes", "200000",
            "--profile-dir", str(tmp_path_factory.mktemp("traces"))]
    with running_server(args, server_log) as url:
        yield url


def test_the_banner_says_ready_then_all_programs_compiled(server, server_log):
    """4 token buckets, the same 4 kept-row buckets and one sampler (8 requests), all compiled before ready."""
    deadline = time.monotonic() + 30
    while "all programs compiled" not in server_log.read_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    text = server_log.read_text()
    compiled = re.search(r"all programs compiled [\d.]+s after launch \((\d+) step programs\)", text)
    assert compiled and int(compiled.group(1)) == 9 and text.index("ready in") < compiled.start()
    assert "token buckets [8, 16, 32, 64], kept-row buckets [8, 16, 32, 64]" in text


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0)


def _metric(server, name) -> float:
    """The metric's value, summed over its label sets."""
    text = httpx.get(f"{server}/metrics").text
    values = re.findall(rf"^{re.escape(name)}{{[^}}]*}} ([0-9.e+-]+)$", text, re.M)
    assert values, f"{name} not in /metrics"
    return sum(float(v) for v in values)


def _ids(seed, n):
    import numpy as np

    return [int(t) for t in np.random.default_rng(seed).integers(20, 270, n)]


def _idle(server, timeout=30):
    """Wait until nothing runs or waits and every block is free again."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if (_metric(server, "vllm:num_requests_running") == 0 and _metric(server, "vllm:num_requests_waiting") == 0
                and _metric(server, "dsv41:kv_free_blocks") == _metric(server, "dsv41:kv_total_blocks")):
            return True
        time.sleep(0.2)
    return False


def test_models_health_and_api_key(server, client):
    assert httpx.get(f"{server}/health").status_code == 200  # open without a key
    assert [m.id for m in client.models.list().data] == ["dsv41-tiny"]
    bad = openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="API key"):
        bad.completions.create(model="dsv41-tiny", prompt="hi", max_tokens=2)
    assert httpx.post(f"{server}/v1/completions", json={"prompt": "hi"}).status_code == 401


def test_completions_stream_equals_whole(client):
    kw = dict(model="dsv41-tiny", prompt=_ids(0, 30), max_tokens=12, temperature=0,
              extra_body={"return_token_ids": True, "ignore_eos": True})
    # Distinct cache salts: a prefix hit with bounded replay is approximate by design, so the second request
    # must not reuse the first one's blocks.
    whole = client.completions.create(**{**kw, "extra_body": {**kw["extra_body"], "cache_salt": "whole"}})
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True},
                                            **{**kw, "extra_body": {**kw["extra_body"], "cache_salt": "stream"}}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    ids = [t for c in chunks if c.choices for t in c.choices[0].model_extra["token_ids"]]
    assert whole.choices[0].text == text and whole.choices[0].model_extra["token_ids"] == ids and len(ids) == 12
    assert whole.choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].usage.prompt_tokens == 30


def test_chat_stream_equals_whole_and_reasoning_is_split(client):
    kw = dict(model="dsv41-tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=10, temperature=0)
    whole = client.chat.completions.create(**kw, extra_body={"cache_salt": "whole"})
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw,
                                                 extra_body={"cache_salt": "stream"}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    reasoning = "".join(d.model_extra.get("reasoning_content") or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    msg = whole.choices[0].message
    assert (msg.model_extra.get("reasoning_content") or "", msg.content) == (reasoning, content)
    assert reasoning  # thinking is on by default: the untrained model never closes </think>
    prompt = encode_messages_to_ids(TOK, kw["messages"])
    assert whole.usage.prompt_tokens == len(prompt) == chunks[-1].usage.prompt_tokens


def test_cached_tokens_on_a_repeated_prefix(client):
    prompt = _ids(1, 200)
    first = client.completions.create(model="dsv41-tiny", prompt=prompt, max_tokens=2, temperature=0)
    again = client.completions.create(model="dsv41-tiny", prompt=prompt[:190] + [33, 34], max_tokens=2,
                                      temperature=0)
    salted = client.completions.create(model="dsv41-tiny", prompt=prompt, max_tokens=2, temperature=0,
                                       extra_body={"cache_salt": "tenant-b"})
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == 176  # 11 full blocks of 16 shared
    assert salted.usage.prompt_tokens_details.cached_tokens == 0  # another namespace


def test_stop_strings_and_stop_token_ids(client):
    kw = dict(model="dsv41-tiny", prompt="The stop test", max_tokens=16, temperature=0,
              extra_body={"return_token_ids": True, "ignore_eos": True})
    full = client.completions.create(**kw).choices[0]
    ids = full.model_extra["token_ids"]
    by_id = client.completions.create(**{**kw, "extra_body": {**kw["extra_body"], "stop_token_ids": [ids[5]]}})
    got = by_id.choices[0]
    assert got.finish_reason == "stop" and got.model_extra["stop_reason"] == ids[5]
    assert got.model_extra["token_ids"] == ids[: ids.index(ids[5]) + 1]
    for j in range(20):  # the untrained model's bytes are mostly invalid UTF-8: find an output with a character
        kw["prompt"] = f"The stop test {j}"
        text = client.completions.create(**kw).choices[0].text
        stops = [c for c in text[1:] if c != "\ufffd"]
        if stops:
            break
    by_str = client.completions.create(stop=[stops[0]], **kw).choices[0]
    assert by_str.finish_reason == "stop" and by_str.model_extra["stop_reason"] == stops[0]
    assert by_str.text == text[: text.find(stops[0])]


def test_n_choices_and_seeds_reproduce(client):
    kw = dict(model="dsv41-tiny", prompt="seeded", max_tokens=8, temperature=1.0, n=3, seed=5,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    ta = [c.model_extra["token_ids"] for c in a.choices]
    assert [c.index for c in a.choices] == [0, 1, 2] and ta == [c.model_extra["token_ids"] for c in b.choices]
    assert len({tuple(t) for t in ta}) > 1  # the choices are different samples
    assert a.usage.completion_tokens == 24


def test_chat_logprobs(client):
    r = client.chat.completions.create(model="dsv41-tiny", messages=[{"role": "user", "content": "x"}],
                                       max_tokens=5, temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    for e in content:
        assert len(e.top_logprobs) == 3 and e.logprob == pytest.approx(e.top_logprobs[0].logprob)
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob >= e.top_logprobs[2].logprob


def test_tool_call_history_is_encoded(client):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18C, sunny"}]
    r = client.chat.completions.create(model="dsv41-tiny", messages=messages, tools=tools, max_tokens=4,
                                       extra_body={"chat_template_kwargs": {"thinking": False}})
    assert r.usage.prompt_tokens == len(encode_messages_to_ids(TOK, messages, tools=tools, thinking=False))
    assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")


def test_client_disconnect_aborts_and_frees_blocks(server):
    body = {"model": "dsv41-tiny", "prompt": _ids(2, 100), "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=60) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(3)]
    assert any(line.startswith("data: ") for line in got)
    assert _idle(server), "the aborted request still holds blocks"


PHASES = {"engine.step", "engine.schedule", "runner.build", "runner.segment1", "runner.segment2", "runner.sample",
          "runner.readback", "engine.detokenize"}


def test_profile_routes_need_the_key(server):
    for route in ("/start_profile", "/stop_profile"):
        assert httpx.post(f"{server}{route}").status_code == 401
        assert httpx.post(f"{server}{route}", headers={"Authorization": "Bearer wrong"}).status_code == 401


def test_a_trace_of_completions_has_the_engine_phases_and_the_named_scopes(server, client):
    auth = {"Authorization": f"Bearer {KEY}"}
    idle = httpx.post(f"{server}/stop_profile", headers=auth, timeout=60)
    assert idle.status_code == 400 and "no trace is running" in idle.json()["error"]["message"]
    started = httpx.post(f"{server}/start_profile", headers=auth, timeout=60)
    assert started.status_code == 200, started.text
    try:
        again = httpx.post(f"{server}/start_profile", headers=auth, timeout=60)
        assert again.status_code == 400 and "already running" in again.json()["error"]["message"]
        for i in range(2):
            client.completions.create(model="dsv41-tiny", prompt=_ids(40 + i, 20), max_tokens=4, temperature=0,
                                      extra_body={"ignore_eos": True})
    finally:
        stopped = httpx.post(f"{server}/stop_profile", headers=auth, timeout=300)
    assert stopped.status_code == 200, stopped.text
    info = stopped.json()
    assert info["trace_dir"] == started.json()["trace_dir"] and Path(info["xplane"]).is_file()
    names = {e.get("name") for e in json.load(gzip.open(info["perfetto_trace"]))["traceEvents"]}
    assert PHASES <= names

    r = read_trace(info["xplane"])
    steps = r.phases["runner.segment1"].count
    assert steps >= 8  # 2 requests x 4 tokens, one token of a request per step
    launched = {r.phases[p].count for p in ("runner.build", "runner.segment2", "runner.sample")}
    # every launched step is read back and its text made (they finish by length: nothing is left in flight), one
    # per engine step; a step() with nothing in flight schedules twice (its step and the one it leaves running)
    assert launched | {r.phases[p].count for p in ("runner.readback", "engine.detokenize", "engine.step")} == {steps}
    assert r.phases["engine.schedule"].count > steps
    # every op event found its program's HLO (the server loaded its steps from the persistent cache), and every
    # layer of the model is there under its segment
    assert r.unmatched == 0 and r.device_ns > 0
    c = dsv41.load_config("tiny")
    cut = c.cut_layer
    assert ({f"segment1/layer_{i}" for i in range(cut)} | {f"segment1/layer_{cut}_kv_path"}
            | {f"segment2/layer_{i}" for i in range(cut, c.num_hidden_layers)}) <= set(r.by_scope(2))
    scopes = set(r.by_scope(3))
    assert {f"segment1/layer_{i}/attn" for i in range(cut)} <= scopes
    assert {f"segment2/layer_{i}/moe" for i in range(cut, c.num_hidden_layers)} <= scopes


def test_profile_routes_without_profile_dir_are_400_naming_the_flag():
    engine = SimpleNamespace(engine=SimpleNamespace(metrics=None))  # the routes never reach the engine
    with TestClient(build_app(engine, None, model_name="m", max_model_len=16)) as c:
        for route in ("/start_profile", "/stop_profile"):
            r = c.post(route)
            assert r.status_code == 400 and "--profile-dir" in r.json()["error"]["message"], r.text


BAD = [
    ("/v1/chat/completions", b"{not json", 400, "not valid JSON"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "temperature": -1}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_p": 2}, 400, "top_p"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 0}, 400, "n: "),
    ("/v1/chat/completions", {"messages": [{"role": "bot", "content": "x"}]}, 400, "messages[0].role"),
    ("/v1/chat/completions", {"model": "dsv41-tiny"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "presence_penalty": 1}, 400,
     "presence_penalty"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 30,
                              "logprobs": True}, 400, "top_logprobs"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "abc"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": [5] * 2100}, 400, "maximum context length"),
    ("/v1/completions", {"prompt": [999999]}, 400, "vocabulary"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "does not exist"),
    ("/v1/completions", {"prompt": "x" * 300000}, 413, "exceeds the limit"),
    ("/v1/nothing", {"prompt": "x"}, 404, "Not Found"),
]


@pytest.mark.parametrize("path,body,status,needle", BAD, ids=[b[3] for b in BAD])
def test_bad_input_gets_4xx_naming_the_problem(server, client, path, body, status, needle):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(f"{server}{path}", headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
                   timeout=30, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["code"] == status
    assert client.completions.create(model="dsv41-tiny", prompt="ok", max_tokens=1).choices[0].finish_reason


def test_256_concurrent_streams_complete_and_blocks_return(server):
    async def one(c, i):
        text, n = "", 0
        stream = await c.completions.create(model="dsv41-tiny", prompt=_ids(100 + i, 10 + i % 40), max_tokens=6,
                                            temperature=0.7, seed=i, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for ch in stream:
            if ch.choices:
                text += ch.choices[0].text
            if ch.usage:
                n = ch.usage.completion_tokens
        return n

    async def main():
        c = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=600)
        return await asyncio.gather(*(one(c, i) for i in range(256)), return_exceptions=True)

    results = asyncio.run(main())
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    assert results == [6] * 256
    assert _idle(server)
    assert _metric(server, "vllm:request_success_total") >= 256
