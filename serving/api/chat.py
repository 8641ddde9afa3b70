"""`/v1/chat/completions`: V4.1 prompt encoding, then the generated text split into `reasoning_content`,
`content` and DSML `tool_calls`, streamed (SSE) or whole."""

from __future__ import annotations

from collections.abc import AsyncIterator

from serving.api.context import Context
from serving.api.generation import (SSE_DONE, Usage, chat_logprobs, merged, new_id, now, prompt_logprobs_json, sse,
                                    submit_choices)
from serving.api.protocol import ChatCompletionRequest
from serving.api.reasoning import ReasoningParser, parse_reasoning
from serving.api.tool_calls import ToolCallParser, parse_tool_calls
from serving.api.turns import encode_chat
from serving.text.template_kwargs import ChatTemplateKwargs


def build_prompt(req: ChatCompletionRequest, ctx: Context) -> tuple[list[int], bool]:
    """(prompt ids, thinking on); ValueError names a bad field."""
    prompt = encode_chat(ctx.tokenizer, req.messages, tools=req.tools,
                         stated=ChatTemplateKwargs(*req.thinking_controls()), defaults=ctx.chat_defaults,
                         add_generation_prompt=req.add_generation_prompt)
    return prompt.ids, prompt.thinking


async def chat_completion(req: ChatCompletionRequest, ctx: Context, session_id: str | None):
    """A response dict, or an async iterator of SSE lines when streaming. Raises before anything streams."""
    prompt_ids, thinking = build_prompt(req, ctx)
    params = req.to_sampling()
    rid = new_id("chatcmpl")
    streams = await submit_choices(ctx.engine, rid, prompt_ids, params, priority=req.priority, session_id=session_id,
                                   cache_salt=req.cache_salt)
    tools = req.tools if req.tools and req.tool_choice != "none" else None
    if req.stream:
        return _stream(req, ctx, rid, streams, len(prompt_ids), thinking, tools)
    return await _whole(req, ctx, rid, streams, prompt_ids, thinking, tools)


async def _whole(req, ctx, rid, streams, prompt_ids, thinking, tools) -> dict:
    n = len(streams)
    texts, lps, reasons, stop_reasons = [""] * n, [[] for _ in range(n)], [None] * n, [None] * n
    ids = [[] for _ in range(n)]
    usage, prompt_lp = Usage(len(prompt_ids)), None
    async for i, o in merged(streams):
        texts[i] += o.new_text
        ids[i] += o.new_token_ids
        lps[i] += o.new_logprobs or []
        usage.completion_tokens += len(o.new_token_ids)
        prompt_lp = o.prompt_logprobs if o.prompt_logprobs is not None else prompt_lp
        if o.finished:
            reasons[i], stop_reasons[i] = o.finish_reason, o.stop_reason
            if i == 0:
                usage.cached_tokens = o.num_cached_tokens
    choices = []
    for i in range(n):
        reasoning, content = parse_reasoning(texts[i], thinking=thinking)
        calls = []
        if tools:
            content, calls = parse_tool_calls(content, tools)
        msg = {"role": "assistant", "content": content, "reasoning_content": reasoning or None}
        if calls:
            msg["tool_calls"] = [c.to_openai() for c in calls]
        choices.append({"index": i, "message": msg,
                        "logprobs": {"content": chat_logprobs(ctx.tokenizer, lps[i])} if req.logprobs else None,
                        "finish_reason": "tool_calls" if calls and reasons[i] == "stop" else reasons[i],
                        "stop_reason": stop_reasons[i], **({"token_ids": ids[i]} if req.return_token_ids else {})})
    out = {"id": rid, "object": "chat.completion", "created": now(), "model": ctx.model_name, "choices": choices,
           "usage": usage.to_openai()}
    if req.prompt_logprobs is not None:
        out["prompt_logprobs"] = prompt_logprobs_json(prompt_lp)
    if req.return_token_ids:
        out["prompt_token_ids"] = prompt_ids
    return out


async def _stream(req, ctx, rid, streams, n_prompt, thinking, tools) -> AsyncIterator[str]:
    n, created = len(streams), now()
    reasoners = [ReasoningParser(thinking=thinking) for _ in range(n)]
    callers = [ToolCallParser(tools) if tools else None for _ in range(n)]
    had_calls = [False] * n
    usage = Usage(n_prompt)

    def chunk(i: int, delta: dict, finish=None, stop_reason=None, logprobs=None) -> str:
        body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": ctx.model_name,
                "choices": [{"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish,
                             **({"stop_reason": stop_reason} if finish else {})}]}
        if req.stream_options and req.stream_options.continuous_usage_stats:
            body["usage"] = usage.to_openai()
        return sse(body)

    gen = merged(streams)
    try:
        for i in range(n):
            yield chunk(i, {"role": "assistant", "content": ""})
        async for i, o in gen:
            usage.completion_tokens += len(o.new_token_ids)
            reasoning, content = reasoners[i].feed(o.new_text)
            if o.finished:
                r2, c2 = reasoners[i].finish()
                reasoning, content = reasoning + r2, content + c2
            calls = []
            if callers[i] is not None:
                content, calls = callers[i].feed(content)
                if o.finished:
                    c3, more = callers[i].finish()
                    content, calls = content + c3, calls + more
                had_calls[i] |= bool(calls)
            delta = {}
            if reasoning:
                delta["reasoning_content"] = reasoning
            if content:
                delta["content"] = content
            if calls:
                delta["tool_calls"] = [c.to_openai() for c in calls]
            if req.return_token_ids and o.new_token_ids:
                delta["token_ids"] = o.new_token_ids
            lp = {"content": chat_logprobs(ctx.tokenizer, o.new_logprobs)} if req.logprobs and o.new_logprobs else None
            if o.finished:
                if i == 0:
                    usage.cached_tokens = o.num_cached_tokens
                reason = "tool_calls" if had_calls[i] and o.finish_reason == "stop" else o.finish_reason
                yield chunk(i, delta, reason, o.stop_reason, lp)
            elif delta or lp:
                yield chunk(i, delta, logprobs=lp)
        if req.include_usage():
            yield sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": ctx.model_name,
                       "choices": [], "usage": usage.to_openai()})
        yield SSE_DONE
    finally:
        await gen.aclose()
