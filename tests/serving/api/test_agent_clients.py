"""The agent APIs on the real server and the built-in nano-austen model, driven by the official clients: the
OpenAI Responses API (`responses.create`, `responses.stream`), Anthropic's Messages API (`messages.create`,
`messages.stream`), `/tokenize` and `/detokenize`, and chat with the checkpoint's default of thinking off.
Text, instructions / system, a function tool offered, a tool-call round trip, the streamed event order, usage
with cached tokens from a session's second turn on, and bad input answered 400 in each API's own shape."""

import re
import time

import anthropic
import httpx
import openai
import pytest

from serving.model_source import DEFAULT_NAME
from tests.serving.server_process import running_server

pytestmark = pytest.mark.slow  # the second tier (`make test-slow`; tests/README.md)

KEY = "agent-key"
M = DEFAULT_NAME
# long enough that a session's shared prefix outlasts the replay window a prefix hit recomputes (nano: 128)
INSTRUCTIONS = " ".join(["You are a correspondent of Miss Austen. Answer every letter in the manner of her novels, "
                         "with attention to manners, marriages and the weather in Bath."] * 5)
TOOL_PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
OPENAI_TOOL = {"type": "function", "name": "get_weather", "description": "Weather of a city",
               "parameters": TOOL_PARAMETERS}
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                              "parameters": TOOL_PARAMETERS}}
GREEDY = {"temperature": 0}  # the anthropic client has no sampling arguments any more; the API still takes them
ANTHROPIC_TOOL = {"name": "get_weather", "description": "Weather of a city", "input_schema": TOOL_PARAMETERS}


@pytest.fixture(scope="module")
def server(tmp_path_factory, request):
    """`--server-processes 2`: the same tests against one server over two processes (docs/testing.md)."""
    log = tmp_path_factory.mktemp("agent-server") / "server.log"
    # two buckets (a decode pads to 16): every program compiled before ready, few of them
    args = ["--api-key", KEY, "--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--max-model-len", "2048",
            "--block-size", "16", "--token-buckets", "16,64", "--no-background-compile", "--disable-access-log"]
    with running_server(args, log, processes=request.config.getoption("--server-processes")) as url:
        yield url, log


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key=KEY, max_retries=0, timeout=600)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server[0], api_key=KEY, max_retries=0, timeout=600)


def _count(server, **body) -> int:
    r = httpx.post(f"{server[0]}/tokenize", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["count"]


def test_the_banner_says_which_chat_default_is_in_force(server):
    assert ("chat: a request that states nothing about thinking gets thinking off (the checkpoint's "
            "tokenizer_config.json chat_template_kwargs)") in server[1].read_text()


def test_chat_without_reasoning_controls_shows_text(oai):
    r = oai.chat.completions.create(model=M, messages=[{"role": "user", "content": "Tell me of Emma."}],
                                    max_tokens=12, temperature=0)
    msg = r.choices[0].message
    assert msg.content and msg.content.strip()
    assert msg.model_extra.get("reasoning_content") is None


def test_responses_text_instructions_and_usage(server, oai):
    r = oai.responses.create(model=M, input="Write me a line about Bath.", instructions=INSTRUCTIONS,
                             max_output_tokens=10, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert [o.type for o in r.output] == ["message"] and r.output_text.strip()
    assert r.usage.output_tokens == 10 and r.usage.output_tokens_details.reasoning_tokens == 0
    chat = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": "Write me a line about Bath."}]
    assert r.usage.input_tokens == _count(server, messages=chat)
    assert oai.responses.retrieve(r.id).output_text == r.output_text


def test_responses_stream_event_order(oai):
    with oai.responses.stream(model=M, input="Describe a ball.", max_output_tokens=8, temperature=0,
                              tools=[OPENAI_TOOL]) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text and final.output_text == text and final.usage.output_tokens == 8


def test_responses_tool_call_round_trip_is_encoded_as_chat(server, oai):
    items = [{"role": "user", "content": "What is the weather in Bath?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Bath"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "Rain, and a cold wind."}]
    r = oai.responses.create(model=M, input=items, tools=[OPENAI_TOOL], max_output_tokens=6, temperature=0)
    chat = [{"role": "user", "content": "What is the weather in Bath?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Bath"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "Rain, and a cold wind."}]
    assert r.usage.input_tokens == _count(server, messages=chat, tools=[CHAT_TOOL])
    assert r.output and r.usage.output_tokens == 6


def test_responses_session_reports_cached_tokens_from_the_second_turn(oai):
    first = oai.responses.create(model=M, input="Who is Mr Knightley?", instructions=INSTRUCTIONS,
                                 max_output_tokens=6, temperature=0, extra_body={"cache_salt": "session-r"})
    assert first.usage.input_tokens_details.cached_tokens == 0
    previous = first
    for line in ("And Mr Elton?", "And Harriet?"):
        turn = oai.responses.create(model=M, input=line, instructions=INSTRUCTIONS, previous_response_id=previous.id,
                                    max_output_tokens=6, temperature=0, extra_body={"cache_salt": "session-r"})
        assert turn.usage.input_tokens > previous.usage.input_tokens
        assert turn.usage.input_tokens_details.cached_tokens >= 16  # the earlier turns' full blocks
        previous = turn


def test_responses_bad_input_is_400_naming_the_field(oai):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        oai.responses.create(model=M, input="x", temperature=5)
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        oai.responses.create(model=M, input="x", tools=[OPENAI_TOOL], tool_choice="required")
    with pytest.raises(openai.NotFoundError, match="previous_response_id"):
        oai.responses.create(model=M, input="x", previous_response_id="resp_missing")


def test_messages_text_system_and_usage(server, claude):
    r = claude.messages.create(model=M, max_tokens=10, system=INSTRUCTIONS, extra_body=GREEDY,
                               messages=[{"role": "user", "content": "Write me a line about Bath."}])
    assert r.stop_reason == "max_tokens" and [b.type for b in r.content] == ["text"] and r.content[0].text.strip()
    chat = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": "Write me a line about Bath."}]
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == _count(server, messages=chat)
    assert r.usage.output_tokens == 10


def test_messages_stream_event_order(claude):
    with claude.messages.stream(model=M, max_tokens=8, extra_body=GREEDY, tools=[ANTHROPIC_TOOL],
                                messages=[{"role": "user", "content": "Describe a ball."}]) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    raw = [k for k in kinds if k in ("message_start", "content_block_start", "content_block_delta",
                                     "content_block_stop", "message_delta", "message_stop")]
    assert raw[:3] == ["message_start", "content_block_start", "content_block_delta"]
    assert raw[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 8 and final.content[0].text


def test_messages_tool_use_round_trip_is_encoded_as_chat(server, claude):
    messages = [{"role": "user", "content": "What is the weather in Bath?"},
                {"role": "assistant", "content": [
                    {"type": "text", "text": "Let me look."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Bath"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Rain, and a cold wind."},
                    {"type": "text", "text": "Shall I take an umbrella?"}]}]
    r = claude.messages.create(model=M, max_tokens=6, extra_body=GREEDY, tools=[ANTHROPIC_TOOL], messages=messages)
    chat = [{"role": "user", "content": "What is the weather in Bath?"},
            {"role": "assistant", "content": "Let me look.", "tool_calls": [
                {"id": "toolu_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Bath"}'}}]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "Rain, and a cold wind."},
            {"role": "user", "content": "Shall I take an umbrella?"}]
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == _count(server, messages=chat,
                                                                            tools=[CHAT_TOOL])
    assert claude.messages.count_tokens(model=M, tools=[ANTHROPIC_TOOL], messages=messages).input_tokens == \
        _count(server, messages=chat, tools=[CHAT_TOOL])


def test_messages_session_reports_cached_tokens_from_the_second_turn(claude):
    messages = [{"role": "user", "content": "Who is Mr Knightley?"}]
    for turn, line in enumerate(("And Mr Elton?", "And Harriet?", "Go on.")):
        r = claude.messages.create(model=M, max_tokens=6, system=INSTRUCTIONS, messages=messages,
                                   extra_body={**GREEDY, "cache_salt": "session-a"})
        if turn == 0:
            assert r.usage.cache_read_input_tokens == 0
        else:
            assert r.usage.cache_read_input_tokens >= 16
        messages += [{"role": "assistant", "content": r.content}, {"role": "user", "content": line}]


def test_messages_bad_input_in_anthropic_shape(server, claude):
    with pytest.raises(anthropic.BadRequestError, match="max_tokens") as bad:
        claude.messages.create(model=M, max_tokens=0, messages=[{"role": "user", "content": "x"}])
    assert bad.value.body["type"] == "error" and bad.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="claude-x", max_tokens=4, messages=[{"role": "user", "content": "x"}])
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server[0], api_key="wrong", max_retries=0).messages.create(
            model=M, max_tokens=4, messages=[{"role": "user", "content": "x"}])


def test_tokenize_and_detokenize_round_trip(server):
    auth = {"Authorization": f"Bearer {KEY}"}
    text = "It is a truth universally acknowledged."
    r = httpx.post(f"{server[0]}/tokenize", json={"prompt": text, "return_token_strs": True}, headers=auth).json()
    assert r["count"] == len(r["tokens"]) == len(r["token_strs"]) and r["max_model_len"] == 2048
    assert "".join(r["token_strs"][1:]) == text  # after the BOS
    back = httpx.post(f"{server[0]}/detokenize", json={"tokens": r["tokens"][1:]}, headers=auth).json()
    assert back == {"prompt": text}
    assert httpx.post(f"{server[0]}/tokenize", json={"prompt": text}).status_code == 401


def _metric(server, name, labels: str = "") -> float:
    """The metric's value summed over its label sets (those with `labels` in them)."""
    text = httpx.get(f"{server[0]}/metrics").text
    pattern = rf"^{re.escape(name)}{{[^}}]*{re.escape(labels)}[^}}]*}} ([0-9.e+-]+)$"
    return sum(float(v) for v in re.findall(pattern, text, re.M))


@pytest.mark.parametrize("route,body", [
    ("/v1/responses", {"model": M, "input": "Tell me all of Persuasion.", "max_output_tokens": 1500}),
    ("/v1/messages", {"model": M, "max_tokens": 1500, "messages": [{"role": "user", "content": "All of Emma."}]})])
def test_a_client_that_leaves_mid_stream_aborts_its_request(server, route, body):
    aborted = _metric(server, "vllm:request_success_total", 'finished_reason="abort"')
    with httpx.stream("POST", f"{server[0]}{route}", json={**body, "stream": True, "ignore_eos": True},
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(12)]
    assert any(line.startswith("event: ") for line in got)
    deadline = time.time() + 60
    while time.time() < deadline:
        if (_metric(server, "vllm:num_requests_running") == 0
                and _metric(server, "dsv41:kv_free_blocks") == _metric(server, "dsv41:kv_total_blocks")):
            assert _metric(server, "vllm:request_success_total", 'finished_reason="abort"') == aborted + 1
            break
        time.sleep(0.2)
    else:
        pytest.fail("the request kept running after its client left")
