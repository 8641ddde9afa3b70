"""`POST /v1/messages` (Anthropic's Messages API): messages -> one V4.1 assistant turn -> content blocks
(`thinking`, `text`, `tool_use`), whole or as the Messages event stream:

    message_start
    per block: content_block_start, content_block_delta* (thinking_delta | text_delta | input_json_delta),
               content_block_stop
    message_delta (stop_reason, stop_sequence, the final usage), message_stop

Usage follows Anthropic: `input_tokens` are the prompt tokens the prefix cache did not serve,
`cache_read_input_tokens` those it did. Errors come in Anthropic's shape (`anthropic_error`).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi.responses import JSONResponse

from serving.api.context import Context
from serving.api.generation import Usage
from serving.api.messages_protocol import CountTokensRequest, MessagesRequest
from serving.api.tool_calls import ToolCall
from serving.api.turns import Prompt, Turn, encode_chat, turn_deltas, whole_turn
from serving.engine.async_engine import EngineDead

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def anthropic_error(status: int, message: str) -> JSONResponse:
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return JSONResponse({"type": "error", "error": {"type": kind, "message": message}}, status_code=status)


def encode(req: CountTokensRequest, ctx: Context) -> Prompt:
    return encode_chat(ctx.tokenizer, req.chat_messages(), tools=req.chat_tools(), stated=req.template_kwargs(),
                       defaults=ctx.chat_defaults)


async def count_tokens(req: CountTokensRequest, ctx: Context, session_id: str | None) -> dict:
    return {"input_tokens": len(encode(req, ctx).ids)}


async def create_message(req: MessagesRequest, ctx: Context, session_id: str | None):
    """The message object, or an async iterator of SSE lines when streaming. Raises before anything streams."""
    prompt = encode(req, ctx)
    mid = f"msg_{uuid.uuid4().hex}"
    stream = await ctx.engine.submit(mid, prompt.ids, req.to_sampling(), session_id=session_id,
                                     cache_salt=req.cache_salt)
    if req.stream:
        return _events(req, ctx, mid, stream, prompt)
    turn = await whole_turn(stream, prompt, req.parsed_tools(), req.max_calls())
    blocks = []
    if turn.reasoning:
        blocks.append({"type": "thinking", "thinking": turn.reasoning, "signature": ""})
    if turn.content:
        blocks.append({"type": "text", "text": turn.content})
    blocks += [_tool_use(c) for c in turn.calls]
    stop_reason, stop_sequence = _stop(turn)
    return {**_message(ctx, mid, blocks), "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": _usage(turn.usage)}


def _message(ctx: Context, mid: str, content: list[dict]) -> dict:
    return {"id": mid, "type": "message", "role": "assistant", "model": ctx.model_name, "content": content,
            "stop_reason": None, "stop_sequence": None}


def _usage(u: Usage) -> dict:
    return {"input_tokens": u.prompt_tokens - u.cached_tokens, "output_tokens": u.completion_tokens,
            "cache_read_input_tokens": u.cached_tokens, "cache_creation_input_tokens": 0}


def _tool_use(call: ToolCall, with_input: bool = True) -> dict:
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": _input(call) if with_input else {}}


def _input(call: ToolCall) -> dict:
    """The call's arguments as an object (Anthropic's `input` is one)."""
    try:
        value = json.loads(call.arguments)
    except ValueError:
        value = call.arguments
    return value if isinstance(value, dict) else {"arguments": value}


def _stop(turn: Turn) -> tuple[str, str | None]:
    """Anthropic's (stop_reason, stop_sequence): the token limit wins, then tool calls, then a stop string."""
    if turn.incomplete:
        return "max_tokens", None
    if turn.calls:
        return "tool_use", None
    if isinstance(turn.stop_reason, str):
        return "stop_sequence", turn.stop_reason
    return "end_turn", None


# ================================================================================================ streaming
@dataclass
class _OpenBlock:
    kind: str  # "thinking" or "text"
    index: int


class _EventWriter:
    def __init__(self):
        self.blocks = 0
        self.open: _OpenBlock | None = None

    @staticmethod
    def event(kind: str, **fields) -> str:
        body = {"type": kind, **fields}
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def _start(self, block: dict) -> str:
        self.blocks += 1
        return self.event("content_block_start", index=self.blocks - 1, content_block=block)

    def text(self, kind: str, delta: str) -> list[str]:
        out = []
        if self.open is None or self.open.kind != kind:
            out += self.close()
            out.append(self._start({"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking"
                                   else {"type": "text", "text": ""}))
            self.open = _OpenBlock(kind, self.blocks - 1)
        body = {"type": "thinking_delta", "thinking": delta} if kind == "thinking" else {"type": "text_delta",
                                                                                          "text": delta}
        return out + [self.event("content_block_delta", index=self.open.index, delta=body)]

    def close(self) -> list[str]:
        block, self.open = self.open, None
        return [] if block is None else [self.event("content_block_stop", index=block.index)]

    def call(self, call: ToolCall) -> list[str]:
        out = self.close() + [self._start(_tool_use(call, with_input=False))]
        index = self.blocks - 1
        return out + [self.event("content_block_delta", index=index,
                                 delta={"type": "input_json_delta", "partial_json": call.arguments}),
                      self.event("content_block_stop", index=index)]


async def _events(req: MessagesRequest, ctx: Context, mid: str, stream, prompt: Prompt) -> AsyncIterator[str]:
    w = _EventWriter()
    turn = Turn(usage=Usage(len(prompt.ids)))
    # the cache hit is known once the request is admitted: message_delta's usage (final, cumulative) states it
    yield w.event("message_start", message={**_message(ctx, mid, []), "usage": {
        "input_tokens": len(prompt.ids), "output_tokens": 0}})
    gen = turn_deltas(stream, thinking=prompt.thinking, tools=req.parsed_tools(), max_calls=req.max_calls())
    try:
        async for delta, in_thinking in gen:
            turn.add(delta, in_thinking)
            for line in ((w.text("thinking", delta.reasoning) if delta.reasoning else [])
                         + (w.text("text", delta.content) if delta.content else [])
                         + [line for call in delta.calls for line in w.call(call)]):
                yield line
    except EngineDead as e:
        yield w.event("error", error={"type": "overloaded_error", "message": str(e)})
        return
    finally:
        await gen.aclose()
    for line in w.close():
        yield line
    stop_reason, stop_sequence = _stop(turn)
    yield w.event("message_delta", delta={"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                  usage=_usage(turn.usage))
    yield w.event("message_stop")
