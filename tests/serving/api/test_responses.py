"""`/v1/responses` on scripted generations (the built-in model cannot be made to call a tool): DSML calls come
back as `function_call` items and reasoning as `reasoning` items, streamed (at any chunking) as whole; input
items and `previous_response_id` become the conversation the V4.1 encoder renders; the store's bounds; the
reasoning effort; what is refused."""

import json

import pytest
from fastapi.testclient import TestClient

from serving.api.response_store import ResponseStore
from serving.text.encoding import dsml_tool_calls, encode_messages_to_ids
from serving.text.template_kwargs import ChatTemplateKwargs
from tests.serving.api.scripted import ScriptedEngine, TOK, scripted_app, sse_events

TOOL = {"type": "function", "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": TOOL["parameters"]}}
SCRIPT = ("The user wants the weather.</think>Let me check. " +
          dsml_tool_calls([("get_weather", {"city": "Paris", "days": 3}), ("get_weather", {"city": "Oslo"})]))


def test_whole_response_has_reasoning_message_and_function_call_items():
    engine = ScriptedEngine(SCRIPT, step=5)
    with TestClient(scripted_app(engine)) as c:
        r = c.post("/v1/responses", json={"input": "Weather?", "tools": [TOOL]}).json()
    assert r["status"] == "completed" and r["object"] == "response"
    kinds = [o["type"] for o in r["output"]]
    assert kinds == ["reasoning", "message", "function_call", "function_call"]
    assert r["output"][0]["content"] == [{"type": "reasoning_text", "text": "The user wants the weather."}]
    assert r["output"][1]["content"][0]["text"] == "Let me check."
    calls = [(o["name"], json.loads(o["arguments"])) for o in r["output"][2:]]
    assert calls == [("get_weather", {"city": "Paris", "days": 3}), ("get_weather", {"city": "Oslo"})]
    assert all(o["call_id"] and o["status"] == "completed" for o in r["output"][2:])
    u = r["usage"]
    assert u["input_tokens"] == len(engine.submitted[0].prompt_ids) and u["output_tokens"] == len(engine_pieces(SCRIPT))
    assert 0 < u["output_tokens_details"]["reasoning_tokens"] < u["output_tokens"]


def engine_pieces(text: str, step: int = 5) -> list[str]:
    return [text[i:i + step] for i in range(0, len(text), step)]


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_stream_equals_whole_at_any_chunking(step):
    with TestClient(scripted_app(ScriptedEngine(SCRIPT, step=step))) as c:
        whole = c.post("/v1/responses", json={"input": "Weather?", "tools": [TOOL]}).json()
        events = sse_events(c.post("/v1/responses", json={"input": "Weather?", "tools": [TOOL], "stream": True}).text)
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 4
    final = events[-1]["response"]
    strip = [{k: v for k, v in o.items() if k not in ("id", "call_id")} for o in final["output"]]
    assert strip == [{k: v for k, v in o.items() if k not in ("id", "call_id")} for o in whole["output"]]
    reasoning = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert (reasoning, text) == ("The user wants the weather.", "Let me check.")
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done == final["output"]


def test_items_and_previous_response_id_render_as_the_chat_conversation():
    engine = ScriptedEngine(SCRIPT, step=7)
    with TestClient(scripted_app(engine)) as c:
        first = c.post("/v1/responses", json={"input": "Weather?", "instructions": "Be brief.", "tools": [TOOL]}).json()
        calls = [o for o in first["output"] if o["type"] == "function_call"]
        results = [{"type": "function_call_output", "call_id": o["call_id"], "output": f"{k}C"}
                   for k, o in enumerate(calls)]
        second = c.post("/v1/responses", json={"input": results, "previous_response_id": first["id"],
                                               "instructions": "Be brief.", "tools": [TOOL]}).json()
    assert second["previous_response_id"] == first["id"]
    expected = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "Let me check.", "reasoning_content": "The user wants the weather.",
                 "tool_calls": [{"id": o["call_id"], "type": "function",
                                 "function": {"name": o["name"], "arguments": o["arguments"]}} for o in calls]},
                {"role": "tool", "tool_call_id": calls[0]["call_id"], "content": "0C"},
                {"role": "tool", "tool_call_id": calls[1]["call_id"], "content": "1C"}]
    ids = encode_messages_to_ids(TOK, expected, tools=[CHAT_TOOL])
    assert engine.submitted[1].prompt_ids == ids
    assert ids[:len(engine.submitted[0].prompt_ids)] == engine.submitted[0].prompt_ids  # the prefix repeats


def test_input_items_with_reasoning_and_calls_join_their_assistant_turn():
    engine = ScriptedEngine("ok")
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
             {"type": "reasoning", "id": "rs_1", "summary": [],
              "content": [{"type": "reasoning_text", "text": "Look."}]},
             {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Rome"}'},
             {"type": "function_call_output", "call_id": "c1", "output": "hot"},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "It is hot."}]},
             {"role": "user", "content": "Thanks"}]
    with TestClient(scripted_app(engine)) as c:
        assert c.post("/v1/responses", json={"input": items, "tools": [TOOL], "reasoning": {"effort": "high"}}
                      ).status_code == 200
    expected = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "", "reasoning_content": "Look.", "tool_calls": [
                    {"id": "c1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "hot"},
                {"role": "assistant", "content": "It is hot."}, {"role": "user", "content": "Thanks"}]
    assert engine.submitted[0].prompt_ids == encode_messages_to_ids(TOK, expected, tools=[CHAT_TOOL],
                                                                    reasoning_effort="high")


@pytest.mark.parametrize("effort,defaults,thinking,level", [
    (None, ChatTemplateKwargs(), True, 50), (None, ChatTemplateKwargs(False), False, None),
    ("none", ChatTemplateKwargs(), False, None), ("minimal", ChatTemplateKwargs(False), True, 25),
    ("medium", ChatTemplateKwargs(), True, 50), ("xhigh", ChatTemplateKwargs(False), True, 75)])
def test_reasoning_effort_maps_onto_thinking_over_the_server_default(effort, defaults, thinking, level):
    engine = ScriptedEngine("ok")
    body = {"input": "Hi"} | ({"reasoning": {"effort": effort}} if effort else {})
    with TestClient(scripted_app(engine, defaults=defaults)) as c:
        assert c.post("/v1/responses", json=body).status_code == 200
    text = TOK.decode(engine.submitted[0].prompt_ids)
    assert text.endswith("<think>" if thinking else "</think>")
    assert (f"Reasoning Effort: {level} " in text) == thinking


def test_store_off_get_delete_and_eviction():
    engine = ScriptedEngine("Fine.")
    with TestClient(scripted_app(engine, store=ResponseStore(max_entries=2))) as c:
        unstored = c.post("/v1/responses", json={"input": "a", "store": False}).json()
        assert c.get(f"/v1/responses/{unstored['id']}").status_code == 404
        ids = [c.post("/v1/responses", json={"input": x}).json()["id"] for x in "bcd"]
        assert c.get(f"/v1/responses/{ids[0]}").status_code == 404  # evicted: two entries kept
        assert c.get(f"/v1/responses/{ids[2]}").json()["id"] == ids[2]
        gone = c.post("/v1/responses", json={"input": "e", "previous_response_id": ids[0]})
        assert gone.status_code == 404 and gone.json()["error"]["param"] == "previous_response_id"
        assert c.delete(f"/v1/responses/{ids[2]}").json()["deleted"] is True
        assert c.delete(f"/v1/responses/{ids[2]}").status_code == 404


def test_the_store_is_bounded_in_bytes_least_recently_used_first():
    store = ResponseStore(max_entries=10, max_bytes=300)
    conversation = [{"role": "user", "content": "x" * 50}]
    for k in range(4):
        assert store.put(f"r{k}", {"id": f"r{k}"}, conversation)
        store.get("r0")  # kept fresh
    assert store.nbytes <= 300 and store.get("r0") is not None and store.get("r1") is None
    assert not store.put("big", {"id": "big"}, [{"role": "user", "content": "y" * 400}]) and store.get("big") is None


@pytest.mark.parametrize("body,needle", [
    ({"input": "x", "tools": [TOOL], "tool_choice": "required"}, "tool_choice"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0"),
    ({"input": "x", "text": {"format": {"type": "json_object"}}}, "text.format"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "temperature": 3}, "temperature"),
    ({"input": "x", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}, "input.0"),
    ({"input": []}, "input"),
    ({"input": "x", "max_output_tokens": 5000}, "maximum context length"),
    ({}, "input"),
])
def test_bad_input_is_400_naming_the_field(body, needle):
    with TestClient(scripted_app(ScriptedEngine("ok"))) as c:
        r = c.post("/v1/responses", json=body)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_parallel_tool_calls_false_keeps_the_first_call(stream):
    with TestClient(scripted_app(ScriptedEngine(SCRIPT, step=3))) as c:
        r = c.post("/v1/responses", json={"input": "Weather?", "tools": [TOOL], "parallel_tool_calls": False,
                                          "stream": stream})
    output = sse_events(r.text)[-1]["response"]["output"] if stream else r.json()["output"]
    calls = [json.loads(o["arguments"]) for o in output if o["type"] == "function_call"]
    assert calls == [{"city": "Paris", "days": 3}]
