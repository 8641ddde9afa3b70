"""`POST /v1/responses` (OpenAI's Responses API): input items -> one V4.1 assistant turn -> output items
(`reasoning`, `message`, `function_call`), whole or as the Responses event stream:

    response.created, response.in_progress,
    per item: response.output_item.added, [response.content_part.added,
              response.reasoning_text.delta* | response.output_text.delta* | response.function_call_arguments.delta,
              *.done, response.content_part.done], response.output_item.done
    response.completed (or response.incomplete when max_output_tokens cut it)

`store` keeps the conversation (`ResponseStore`) so `previous_response_id` continues it: the next prompt starts
with the same tokens and the prefix cache serves them.
"""

from __future__ import annotations

import itertools
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from serving.api.context import Context, NotFound
from serving.api.generation import Usage, now
from serving.api.responses_protocol import ResponsesRequest
from serving.api.tool_calls import ToolCall
from serving.api.turns import Prompt, Turn, encode_chat, turn_deltas, whole_turn
from serving.engine.async_engine import EngineDead


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass(frozen=True)
class Prepared:
    """A request made ready: the conversation (without instructions) and its encoded prompt."""

    conversation: list[dict]
    prompt: Prompt
    tools: list[dict] | None  # chat-format tools whose calls are parsed (None with tool_choice "none")


def prepare(req: ResponsesRequest, ctx: Context) -> Prepared:
    history: list[dict] = []
    if req.previous_response_id is not None:
        stored = ctx.responses.get(req.previous_response_id)
        if stored is None:
            raise NotFound(f"previous_response_id: no stored response {req.previous_response_id!r} (never stored, "
                           f"deleted, or evicted: the store keeps the latest {ctx.responses.max_entries} responses "
                           f"within {ctx.responses.max_bytes} bytes)", "previous_response_id")
        history = list(stored.conversation)
    conversation = history + req.input_messages()
    if not conversation:
        raise ValueError("input: must not be empty")
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    tools = req.chat_tools()
    try:
        prompt = encode_chat(ctx.tokenizer, system + conversation, tools=tools, stated=req.template_kwargs(),
                             defaults=ctx.chat_defaults)
    except ValueError as e:
        raise ValueError(f"input (as chat messages): {e}") from None
    return Prepared(conversation, prompt, tools if req.tool_choice != "none" else None)


async def create_response(req: ResponsesRequest, ctx: Context, session_id: str | None):
    """The response object, or an async iterator of SSE lines when streaming. Raises before anything streams."""
    prep = prepare(req, ctx)
    rid = _id("resp")
    stream = await ctx.engine.submit(rid, prep.prompt.ids, req.to_sampling(), priority=req.priority,
                                     session_id=session_id, cache_salt=req.cache_salt)
    if req.stream:
        return _events(req, ctx, rid, stream, prep)
    turn = await whole_turn(stream, prep.prompt, prep.tools, req.max_calls())
    items, status = [], _status(turn)  # a cut shows on the last text item, as it does streamed
    if turn.reasoning:
        last = not (turn.content or turn.calls)
        items.append(_reasoning_item(_id("rs"), turn.reasoning, status if last else "completed"))
    if turn.content:
        items.append(_message_item(_id("msg"), turn.content, "completed" if turn.calls else status))
    items += [_call_item(_id("fc"), c, "completed") for c in turn.calls]
    response = _response(req, ctx, rid, now(), status, items, turn)
    _store(req, ctx, rid, response, prep, turn)
    return response


def _status(turn: Turn) -> str:
    return "incomplete" if turn.incomplete else "completed"


def _store(req: ResponsesRequest, ctx: Context, rid: str, response: dict, prep: Prepared, turn: Turn) -> None:
    if not req.store:
        return
    assistant = {"role": "assistant", "content": turn.content, "reasoning_content": turn.reasoning or None}
    if turn.calls:
        assistant["tool_calls"] = [c.to_openai() for c in turn.calls]
    ctx.responses.put(rid, response, prep.conversation + [assistant])


def _usage(turn: Turn | None) -> dict | None:
    if turn is None:
        return None
    u: Usage = turn.usage
    return {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_tokens},
            "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": turn.reasoning_tokens},
            "total_tokens": u.prompt_tokens + u.completion_tokens}


def _response(req: ResponsesRequest, ctx: Context, rid: str, created: int, status: str, output: list[dict],
              turn: Turn | None) -> dict:
    return {"id": rid, "object": "response", "created_at": created, "status": status, "model": ctx.model_name,
            "output": output, "usage": _usage(turn), "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None},
            "store": req.store, "temperature": 1.0 if req.temperature is None else req.temperature,
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "tool_choice": req.tool_choice, "parallel_tool_calls": req.parallel_tool_calls,
            "text": {"format": {"type": "text"}}, "truncation": "disabled", "metadata": req.metadata or {},
            "user": req.user}


def _reasoning_part(text: str) -> dict:
    return {"type": "reasoning_text", "text": text}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _reasoning_item(item_id: str, text: str | None, status: str) -> dict:
    return {"id": item_id, "type": "reasoning", "summary": [],
            "content": [_reasoning_part(text)] if text is not None else [], "status": status}


def _message_item(item_id: str, text: str | None, status: str) -> dict:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [_text_part(text)] if text is not None else []}


def _call_item(item_id: str, call: ToolCall, status: str, arguments: str | None = None) -> dict:
    return {"id": item_id, "type": "function_call", "call_id": call.id, "name": call.name,
            "arguments": call.arguments if arguments is None else arguments, "status": status}


# ================================================================================================ streaming
@dataclass
class _OpenItem:
    kind: str  # "reasoning" or "message": the item whose text is streaming
    item_id: str
    index: int  # output_index
    text: str = ""


class _EventWriter:
    """Numbers the events and keeps the finished output items."""

    def __init__(self):
        self._seq = itertools.count()
        self.output: list[dict] = []
        self.open: _OpenItem | None = None

    def event(self, kind: str, **fields) -> str:
        body = {"type": kind, "sequence_number": next(self._seq), **fields}
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def text(self, kind: str, delta: str) -> list[str]:
        """Stream `delta` into an item of `kind`, opening it (and closing another) first."""
        out = []
        if self.open is None or self.open.kind != kind:
            out += self.close("completed")
            self.open = _OpenItem(kind, _id("rs" if kind == "reasoning" else "msg"), len(self.output))
            item = (_reasoning_item if kind == "reasoning" else _message_item)(self.open.item_id, None, "in_progress")
            part = _reasoning_part("") if kind == "reasoning" else _text_part("")
            out += [self.event("response.output_item.added", output_index=self.open.index, item=item),
                    self.event("response.content_part.added", item_id=self.open.item_id,
                               output_index=self.open.index, content_index=0, part=part)]
        self.open.text += delta
        where = dict(item_id=self.open.item_id, output_index=self.open.index, content_index=0)
        if kind == "reasoning":
            return out + [self.event("response.reasoning_text.delta", delta=delta, **where)]
        return out + [self.event("response.output_text.delta", delta=delta, logprobs=[], **where)]

    def close(self, status: str) -> list[str]:
        item, self.open = self.open, None
        if item is None:
            return []
        where = dict(item_id=item.item_id, output_index=item.index, content_index=0)
        if item.kind == "reasoning":
            done, part = self.event("response.reasoning_text.done", text=item.text, **where), _reasoning_part(item.text)
            whole = _reasoning_item(item.item_id, item.text, status)
        else:
            done = self.event("response.output_text.done", text=item.text, logprobs=[], **where)
            part, whole = _text_part(item.text), _message_item(item.item_id, item.text, status)
        self.output.append(whole)
        return [done, self.event("response.content_part.done", part=part, **where),
                self.event("response.output_item.done", output_index=item.index, item=whole)]

    def call(self, call: ToolCall) -> list[str]:
        out = self.close("completed")
        index, item_id = len(self.output), _id("fc")
        whole = _call_item(item_id, call, "completed")
        self.output.append(whole)
        where = dict(item_id=item_id, output_index=index)
        return out + [
            self.event("response.output_item.added", output_index=index,
                       item=_call_item(item_id, call, "in_progress", arguments="")),
            self.event("response.function_call_arguments.delta", delta=call.arguments, **where),
            self.event("response.function_call_arguments.done", arguments=call.arguments, name=call.name, **where),
            self.event("response.output_item.done", output_index=index, item=whole)]


async def _events(req: ResponsesRequest, ctx: Context, rid: str, stream, prep: Prepared) -> AsyncIterator[str]:
    created, w = now(), _EventWriter()
    start = _response(req, ctx, rid, created, "in_progress", [], None)
    yield w.event("response.created", response=start)
    yield w.event("response.in_progress", response=start)
    turn = Turn(usage=Usage(len(prep.prompt.ids)))
    gen = turn_deltas(stream, thinking=prep.prompt.thinking, tools=prep.tools, max_calls=req.max_calls())
    try:
        async for delta, in_thinking in gen:
            turn.add(delta, in_thinking)
            for line in ((w.text("reasoning", delta.reasoning) if delta.reasoning else [])
                         + (w.text("message", delta.content) if delta.content else [])
                         + [line for call in delta.calls for line in w.call(call)]):
                yield line
    except EngineDead as e:
        yield w.event("error", code="engine_dead", message=str(e), param=None)
        return
    finally:
        await gen.aclose()
    for line in w.close(_status(turn)):
        yield line
    final = _response(req, ctx, rid, created, _status(turn), w.output, turn)
    _store(req, ctx, rid, final, prep, turn)
    yield w.event(f"response.{_status(turn)}", response=final)


def stored_response(ctx: Context, response_id: str) -> dict:
    stored = ctx.responses.get(response_id)
    if stored is None:
        raise NotFound(f"no stored response {response_id!r}", "response_id")
    return stored.response


def delete_response(ctx: Context, response_id: str) -> dict:
    if not ctx.responses.delete(response_id):
        raise NotFound(f"no stored response {response_id!r}", "response_id")
    return {"id": response_id, "object": "response", "deleted": True}
