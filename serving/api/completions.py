"""`/v1/completions`: text or token-id prompts (one or a batch), streamed (SSE) or whole. Text prompts get the
BOS token prepended, as DeepSeek's tokenizer does for plain completions."""

from __future__ import annotations

from collections.abc import AsyncIterator

from serving.api.context import Context
from serving.api.generation import (SSE_DONE, Usage, completion_logprobs, merged, new_id, now,
                                    prompt_logprobs_json, sse, submit_choices)
from serving.api.protocol import CompletionRequest


def prompt_ids(prompt: str | list[int], tokenizer, index: int, n_prompts: int) -> list[int]:
    where = "prompt" if n_prompts == 1 else f"prompt[{index}]"
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(f"{where}: this model has no tokenizer; send token ids")
        if not prompt:
            raise ValueError(f"{where}: must not be empty")
        return [tokenizer.bos_id] + tokenizer.encode(prompt)
    if not prompt:
        raise ValueError(f"{where}: must not be empty")
    return list(prompt)


async def completion(req: CompletionRequest, ctx: Context, session_id: str | None):
    prompts = req.prompts()
    ids = [prompt_ids(p, ctx.tokenizer, k, len(prompts)) for k, p in enumerate(prompts)]
    params = req.to_sampling()
    rid = new_id("cmpl")
    all_streams = []
    try:
        for k, p in enumerate(ids):
            all_streams.append(await submit_choices(ctx.engine, f"{rid}-{k}", p, params, priority=req.priority,
                                                    session_id=session_id, cache_salt=req.cache_salt))
    except BaseException:
        for streams in all_streams:
            for s in streams:
                s.close()
        raise
    # Choice index = prompt index * n + choice (OpenAI's layout for batched prompts).
    flat = [s for streams in all_streams for s in streams]
    texts = [p if isinstance(p, str) else None for p in prompts]
    if req.stream:
        return _stream(req, ctx, rid, flat, ids)
    return await _whole(req, ctx, rid, flat, ids, texts)


async def _whole(req, ctx, rid, streams, ids, texts) -> dict:
    n = len(streams)
    out_text, lps, out_ids = [""] * n, [[] for _ in range(n)], [[] for _ in range(n)]
    finish, stop, prompt_lp = [None] * n, [None] * n, [None] * n
    usage = Usage(sum(len(p) for p in ids))
    async for i, o in merged(streams):
        out_text[i] += o.new_text
        out_ids[i] += o.new_token_ids
        lps[i] += o.new_logprobs or []
        usage.completion_tokens += len(o.new_token_ids)
        if o.prompt_logprobs is not None:
            prompt_lp[i] = o.prompt_logprobs
        if o.finished:
            finish[i], stop[i] = o.finish_reason, o.stop_reason
            if i % req.n == 0:
                usage.cached_tokens += o.num_cached_tokens
    choices = []
    for i in range(n):
        k = i // req.n
        text = out_text[i]
        if req.echo:
            text = (texts[k] if texts[k] is not None else ctx.tokenizer.decode(ids[k]) if ctx.tokenizer else "") + text
        c = {"index": i, "text": text, "finish_reason": finish[i], "stop_reason": stop[i],
             "logprobs": completion_logprobs(ctx.tokenizer, lps[i], 0) if req.logprobs is not None else None}
        if req.prompt_logprobs is not None:
            c["prompt_logprobs"] = prompt_logprobs_json(prompt_lp[i])
        if req.return_token_ids:
            c["token_ids"], c["prompt_token_ids"] = out_ids[i], ids[k]
        choices.append(c)
    return {"id": rid, "object": "text_completion", "created": now(), "model": ctx.model_name, "choices": choices,
            "usage": usage.to_openai()}


async def _stream(req, ctx, rid, streams, ids) -> AsyncIterator[str]:
    created = now()
    usage = Usage(sum(len(p) for p in ids))
    offsets = [0] * len(streams)
    gen = merged(streams)
    try:
        async for i, o in gen:
            usage.completion_tokens += len(o.new_token_ids)
            lp = None
            if req.logprobs is not None and o.new_logprobs:
                lp = completion_logprobs(ctx.tokenizer, o.new_logprobs, offsets[i])
            offsets[i] += len(o.new_text)
            if o.finished and i % req.n == 0:
                usage.cached_tokens += o.num_cached_tokens
            if not (o.new_text or o.finished or lp or req.return_token_ids):
                continue
            choice = {"index": i, "text": o.new_text, "logprobs": lp,
                      "finish_reason": o.finish_reason if o.finished else None}
            if req.return_token_ids:
                choice["token_ids"] = o.new_token_ids
            if o.finished:
                choice["stop_reason"] = o.stop_reason
            if o.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs_json(o.prompt_logprobs)
            body = {"id": rid, "object": "text_completion", "created": created, "model": ctx.model_name,
                    "choices": [choice]}
            if req.stream_options and req.stream_options.continuous_usage_stats:
                body["usage"] = usage.to_openai()
            yield sse(body)
        if req.include_usage():
            yield sse({"id": rid, "object": "text_completion", "created": created, "model": ctx.model_name,
                       "choices": [], "usage": usage.to_openai()})
        yield SSE_DONE
    finally:
        await gen.aclose()
