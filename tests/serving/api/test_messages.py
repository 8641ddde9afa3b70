"""`/v1/messages` on scripted generations: DSML calls come back as `tool_use` blocks and reasoning as `thinking`
blocks, streamed (at any chunking) as whole; stop reasons; Anthropic's usage (cache reads apart); messages with
tool_use / tool_result blocks render as the chat conversation; thinking controls over the server default; errors
in Anthropic's shape, the API key as `x-api-key`."""

import json

import pytest
from fastapi.testclient import TestClient

from serving.text.encoding import dsml_tool_calls, encode_messages_to_ids
from serving.text.template_kwargs import ChatTemplateKwargs
from tests.serving.api.scripted import ScriptedEngine, TOK, scripted_app, sse_events

TOOL = {"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": TOOL["input_schema"]}}
SCRIPT = ("The user wants the weather.</think>Let me check. " +
          dsml_tool_calls([("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})]))
BODY = {"model": "m", "max_tokens": 400, "messages": [{"role": "user", "content": "Weather?"}], "tools": [TOOL]}


def test_whole_message_has_thinking_text_and_tool_use_blocks_and_cache_reads_apart():
    engine = ScriptedEngine(SCRIPT, step=5, cached=64)
    with TestClient(scripted_app(engine)) as c:
        r = c.post("/v1/messages", json=BODY).json()
    assert r["type"] == "message" and r["role"] == "assistant" and r["stop_reason"] == "tool_use"
    assert [b["type"] for b in r["content"]] == ["thinking", "text", "tool_use", "tool_use"]
    assert r["content"][0]["thinking"] == "The user wants the weather." and r["content"][1]["text"] == "Let me check."
    assert [(b["name"], b["input"]) for b in r["content"][2:]] == [("get_weather", {"city": "Paris"}),
                                                                   ("get_weather", {"city": "Oslo"})]
    prompt = len(engine.submitted[0].prompt_ids)
    assert r["usage"]["input_tokens"] == prompt - 64 and r["usage"]["cache_read_input_tokens"] == 64


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_stream_equals_whole_at_any_chunking(step):
    with TestClient(scripted_app(ScriptedEngine(SCRIPT, step=step))) as c:
        whole = c.post("/v1/messages", json=BODY).json()
        events = sse_events(c.post("/v1/messages", json={**BODY, "stream": True}).text)
    kinds = [e["type"] for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    starts = [e for e in events if e["type"] == "content_block_start"]
    assert [e["index"] for e in starts] == [0, 1, 2, 3]
    assert kinds.count("content_block_stop") == 4
    blocks = [dict(e["content_block"]) for e in starts]
    for e in events:
        if e["type"] == "content_block_delta":
            d, b = e["delta"], blocks[e["index"]]
            if d["type"] == "thinking_delta":
                b["thinking"] += d["thinking"]
            elif d["type"] == "text_delta":
                b["text"] += d["text"]
            else:
                b["input"] = json.loads(d["partial_json"])
    strip = [{k: v for k, v in b.items() if k != "id"} for b in blocks]
    assert strip == [{k: v for k, v in b.items() if k != "id"} for b in whole["content"]]
    assert events[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert events[-2]["usage"] == whole["usage"]


@pytest.mark.parametrize("script,body,stop", [
    ("Plain words and more.", {"max_tokens": 2}, ("max_tokens", None)),
    ("Plain words. THE END and more", {"stop_sequences": ["THE END"]}, ("stop_sequence", "THE END")),
    ("Plain words.", {}, ("end_turn", None))])
def test_stop_reasons(script, body, stop):
    with TestClient(scripted_app(ScriptedEngine(script, step=3))) as c:
        r = c.post("/v1/messages", json={**BODY, "tools": None, **body}).json()
    assert (r["stop_reason"], r["stop_sequence"]) == stop


def test_tool_use_and_tool_result_blocks_render_as_the_chat_conversation():
    engine = ScriptedEngine("ok")
    messages = [{"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "Use the tool.", "signature": "sig"},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Rome"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                              "content": [{"type": "text", "text": "hot"}]},
                                             {"type": "text", "text": "Thanks", "cache_control": {"type": "x"}}]}]
    with TestClient(scripted_app(engine)) as c:
        body = {**BODY, "max_tokens": 2000, "messages": messages, "system": [{"type": "text", "text": "Be brief."}],
                "thinking": {"type": "enabled", "budget_tokens": 1024}, "output_config": {"effort": "max"}}
        assert c.post("/v1/messages", json=body).status_code == 200
        counted = c.post("/v1/messages/count_tokens", json={k: v for k, v in body.items() if k != "max_tokens"})
    expected = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "Checking.", "reasoning_content": "Use the tool.", "tool_calls": [
                    {"id": "toolu_1", "type": "function", "function": {"name": "get_weather",
                                                                       "arguments": '{"city": "Rome"}'}}]},
                {"role": "tool", "tool_call_id": "toolu_1", "content": "hot"}, {"role": "user", "content": "Thanks"}]
    ids = encode_messages_to_ids(TOK, expected, tools=[CHAT_TOOL], thinking=True, reasoning_effort="max")
    assert engine.submitted[0].prompt_ids == ids and counted.json() == {"input_tokens": len(ids)}


@pytest.mark.parametrize("thinking,defaults,opens", [
    (None, ChatTemplateKwargs(False), False), (None, ChatTemplateKwargs(), True),
    ({"type": "adaptive"}, ChatTemplateKwargs(False), True), ({"type": "disabled"}, ChatTemplateKwargs(), False)])
def test_thinking_over_the_server_default(thinking, defaults, opens):
    engine = ScriptedEngine("ok")
    body = {**BODY, "tools": None} | ({"thinking": thinking} if thinking else {})
    with TestClient(scripted_app(engine, defaults=defaults)) as c:
        assert c.post("/v1/messages", json=body).status_code == 200
    assert TOK.decode(engine.submitted[0].prompt_ids).endswith("<think>" if opens else "</think>")


@pytest.mark.parametrize("body,needle", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": None}, "max_tokens"),
    ({"messages": []}, "messages"),
    ({"temperature": 1.5}, "temperature"),
    ({"top_k": -2}, "top_k"),
    ({"stop_sequences": [""]}, "stop_sequences.0"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0"),
    ({"thinking": {"type": "enabled", "budget_tokens": 2000}, "max_tokens": 1500}, "thinking.budget_tokens"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "pre"}]}, "prefill"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages.0.content.0"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "n", "input": {}}]}]},
     "messages.0.content.0.type"),
    ({"max_tokens": 5000}, "maximum context length"),
])
def test_bad_input_is_400_in_anthropic_shape(body, needle):
    with TestClient(scripted_app(ScriptedEngine("ok"))) as c:
        r = c.post("/v1/messages", json={**BODY, **body})
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert needle in err["error"]["message"]


def test_api_key_as_x_api_key_or_bearer_and_errors_in_each_apis_shape():
    with TestClient(scripted_app(ScriptedEngine("ok"), api_key="k")) as c:
        denied = c.post("/v1/messages", json=BODY)
        assert denied.status_code == 401 and denied.json()["error"]["type"] == "authentication_error"
        assert c.post("/v1/messages", json=BODY, headers={"x-api-key": "k"}).status_code == 200
        assert c.post("/v1/messages", json=BODY, headers={"Authorization": "Bearer k"}).status_code == 200
        assert c.post("/v1/responses", json={"input": "x"}).json()["error"]["code"] == 401  # OpenAI's shape
        assert c.post("/tokenize", json={"prompt": "x"}).status_code == 401
        assert c.post("/tokenize", json={"prompt": "x"}, headers={"x-api-key": "k"}).status_code == 200
        missing = c.post("/v1/messages", json={**BODY, "model": "claude-x"}, headers={"x-api-key": "k"})
        assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"


@pytest.mark.parametrize("stream", [False, True])
def test_disable_parallel_tool_use_keeps_the_first_call(stream):
    body = {**BODY, "tool_choice": {"type": "auto", "disable_parallel_tool_use": True}, "stream": stream}
    with TestClient(scripted_app(ScriptedEngine(SCRIPT, step=3))) as c:
        r = c.post("/v1/messages", json=body)
    if stream:
        names = [e["content_block"]["type"] for e in sse_events(r.text) if e["type"] == "content_block_start"]
    else:
        names = [b["type"] for b in r.json()["content"]]
    assert names == ["thinking", "text", "tool_use"]
