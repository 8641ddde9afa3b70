"""One assistant turn for the agent APIs (`/v1/responses`, `/v1/messages`): chat messages in, the V4.1 prompt
encoded under the server's chat-template defaults, one engine request, and its text split as it streams into
reasoning, content and DSML tool calls (`TurnDelta`), then summed up (`Turn`). The chat endpoint's own path
(`chat.py`) does the same per choice, with OpenAI's `n`, logprobs and token ids on top."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from serving.api.generation import Usage
from serving.api.reasoning import ReasoningParser
from serving.api.tool_calls import ToolCall, ToolCallParser
from serving.engine.async_engine import RequestStream
from serving.engine.request import RequestOutput
from serving.text.encoding import encode_messages
from serving.text.template_kwargs import ChatTemplateKwargs


@dataclass(frozen=True)
class Prompt:
    """An encoded conversation: its token ids and whether it opened a thinking block."""

    ids: list[int]
    thinking: bool


def encode_chat(tokenizer, messages: list[dict], *, tools: list[dict] | None, stated: ChatTemplateKwargs,
                defaults: ChatTemplateKwargs, add_generation_prompt: bool = True) -> Prompt:
    """The V4.1 prompt of chat-format messages, `stated` (the request's controls) over the server's `defaults`;
    ValueError names a bad field."""
    if tokenizer is None:
        raise ValueError("messages: this model has no tokenizer; use /v1/completions with token ids")
    controls = stated.over(defaults)
    thinking, _ = controls.resolve()
    text = encode_messages(messages, tools=tools, thinking=controls.thinking,
                           reasoning_effort=controls.reasoning_effort, add_generation_prompt=add_generation_prompt)
    return Prompt(tokenizer.encode(text), thinking)


@dataclass(frozen=True)
class TurnDelta:
    """What one engine output added to the turn (any part may be empty)."""

    reasoning: str
    content: str
    calls: list[ToolCall]
    output: RequestOutput


@dataclass
class Turn:
    """A finished turn: the generated reasoning, content and tool calls, why it ended, and its usage."""

    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str | None = None  # the engine's: stop, length, abort
    stop_reason: int | str | None = None  # the matched stop string or stop token id
    usage: Usage = field(default_factory=Usage)
    reasoning_tokens: int = 0  # generated while the thinking block was open

    def add(self, delta: TurnDelta, in_thinking: bool) -> None:
        """`in_thinking`: the delta's tokens were generated inside the thinking block."""
        self.reasoning_tokens += len(delta.output.new_token_ids) if in_thinking else 0
        self.reasoning += delta.reasoning
        self.content += delta.content
        self.calls += delta.calls
        self.usage.completion_tokens += len(delta.output.new_token_ids)
        self.usage.cached_tokens = delta.output.num_cached_tokens
        if delta.output.finished:
            self.finish_reason, self.stop_reason = delta.output.finish_reason, delta.output.stop_reason
            if self.calls:  # the whitespace around a tool block is dropped, as the chat endpoint does
                self.content = self.content.rstrip()

    @property
    def incomplete(self) -> bool:
        """Cut off by the token limit (a tool call cut short is not returned)."""
        return self.finish_reason == "length"


async def turn_deltas(stream: RequestStream, *, thinking: bool, tools: list[dict] | None,
                      max_calls: int | None = None) -> AsyncIterator[tuple[TurnDelta, bool]]:
    """(delta, generated inside the thinking block) per engine output; closing this aborts the request.
    `tools`: chat-format tools whose DSML calls are parsed (None: none are, the text stays content).
    `max_calls`: calls past this many are dropped (a client that asked for no parallel calls)."""
    reasoner = ReasoningParser(thinking=thinking)
    caller = ToolCallParser(tools) if tools else None
    calls_left = max_calls
    try:
        async for o in stream:
            was_reasoning = reasoner.in_reasoning
            reasoning, content = reasoner.feed(o.new_text)
            if o.finished:
                r2, c2 = reasoner.finish()
                reasoning, content = reasoning + r2, content + c2
            calls: list[ToolCall] = []
            if caller is not None:
                content, deltas = caller.feed(content)
                if o.finished:
                    c3, more = caller.finish()
                    content, deltas = content + c3, deltas + more
                calls = [d.call for d in deltas]
                if calls_left is not None:
                    calls, calls_left = calls[:calls_left], max(0, calls_left - len(calls))
            yield TurnDelta(reasoning, content, calls, o), was_reasoning
    finally:
        stream.close()


async def whole_turn(stream: RequestStream, prompt: Prompt, tools: list[dict] | None,
                     max_calls: int | None = None) -> Turn:
    turn = Turn(usage=Usage(len(prompt.ids)))
    gen = turn_deltas(stream, thinking=prompt.thinking, tools=tools, max_calls=max_calls)
    try:
        async for delta, in_thinking in gen:
            turn.add(delta, in_thinking)
    finally:
        await gen.aclose()
    return turn
