"""The chat endpoint's output path on scripted generations (the untrained default model cannot be made to
call a tool): reasoning, content and DSML tool calls come out the same streamed (every token boundary)
and whole, in OpenAI's shapes, with finish_reason "tool_calls"."""

import asyncio
import json

import pytest

from serving.api.chat import Context, chat_completion
from serving.text.encoding import dsml_tool_calls
from serving.api.protocol import ChatCompletionRequest
from serving.text.tokenizer import byte_level_tokenizer
from serving.engine.request import RequestOutput

TOK = byte_level_tokenizer(512)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
TEXT = ("The user wants the weather.</think>Let me check. " +
        dsml_tool_calls([("get_weather", {"city": "Paris", "days": 3}), ("get_weather", {"city": "Oslo"})]))


class ScriptedStream:
    """Yields the script's text in pieces of `step` characters, as the engine's RequestStream would."""

    def __init__(self, text: str, step: int):
        self.pieces = [text[i:i + step] for i in range(0, len(text), step)]

    async def __aiter__(self):
        for k, piece in enumerate(self.pieces):
            last = k == len(self.pieces) - 1
            yield RequestOutput("r", [7], piece, last, "stop" if last else None, num_prompt_tokens=5,
                                num_output_tokens=k + 1)

    def close(self):
        pass


class ScriptedEngine:
    def __init__(self, text, step):
        self.text, self.step, self.streams = text, step, []

    async def submit(self, rid, prompt_ids, params, **meta):
        self.streams.append(ScriptedStream(self.text, self.step))
        return self.streams[-1]


def _request(stream: bool) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS, stream=stream,
                                 stream_options={"include_usage": True} if stream else None)


async def _whole(step):
    return await chat_completion(_request(False), Context(ScriptedEngine(TEXT, step), TOK, "m"), None)


async def _streamed(step):
    eng = ScriptedEngine(TEXT, step)
    return [line async for line in await chat_completion(_request(True), Context(eng, TOK, "m"), None)]


def test_whole_response_has_reasoning_content_and_typed_tool_calls():
    msg = asyncio.run(_whole(5))["choices"][0]
    assert msg["finish_reason"] == "tool_calls"
    m = msg["message"]
    assert m["reasoning_content"] == "The user wants the weather." and m["content"] == "Let me check."
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in m["tool_calls"]]
    assert calls == [("get_weather", {"city": "Paris", "days": 3}), ("get_weather", {"city": "Oslo"})]
    assert all(c["id"] and c["type"] == "function" for c in m["tool_calls"])


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_stream_equals_whole_at_any_chunking(step):
    lines = asyncio.run(_streamed(step))
    assert lines[-1] == "data: [DONE]\n\n"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens"] > 0
    deltas = [c["choices"][0] for c in chunks[:-1]]
    assert deltas[0]["delta"] == {"role": "assistant", "content": ""}
    reasoning = "".join(d["delta"].get("reasoning_content", "") for d in deltas)
    content = "".join(d["delta"].get("content", "") for d in deltas)
    calls = [c for d in deltas for c in d["delta"].get("tool_calls", [])]
    whole = asyncio.run(_whole(step))["choices"][0]["message"]
    assert (reasoning, content) == (whole["reasoning_content"], whole["content"])
    assert [c["index"] for c in calls] == [0, 1]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole["tool_calls"]]
    assert deltas[-1]["finish_reason"] == "tool_calls"
    assert "DSML" not in content and "DSML" not in reasoning
