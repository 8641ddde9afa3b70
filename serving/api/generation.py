"""What the chat and completion endpoints share: running a prompt's `n` choices through the engine, usage,
logprob and SSE formatting."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from serving.engine.async_engine import AsyncEngine, RequestStream
from serving.engine.request import RequestOutput, TokenLogprob
from serving.runtime.sampling_params import SamplingParams


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def to_openai(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


async def submit_choices(engine: AsyncEngine, base_id: str, prompt_ids: list[int], params: SamplingParams,
                         **meta) -> list[RequestStream]:
    """One engine request per choice (seeded choices get seed + index); all or none are queued."""
    streams: list[RequestStream] = []
    try:
        for i in range(params.n):
            p = dataclasses.replace(params, n=1, seed=None if params.seed is None else params.seed + i)
            streams.append(await engine.submit(f"{base_id}-{i}", prompt_ids, p, **meta))
    except BaseException:
        for s in streams:
            s.close()
        raise
    return streams


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, output) from every stream as they arrive; closing this closes (aborts) them all."""
    if len(streams) == 1:
        async for o in streams[0]:
            yield 0, o
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: RequestStream):
        try:
            async for o in s:
                await q.put((i, o, None))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            await q.put((i, None, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, o, err = await q.get()
            if err is not None:
                raise err
            yield i, o
            left -= o.finished
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.close()


def token_text(tokenizer, token_id: int) -> tuple[str, list[int]]:
    """A token's text (invalid UTF-8 shown as U+FFFD) and its bytes, for logprob entries."""
    if tokenizer is None:
        return f"token_id:{token_id}", []
    b = tokenizer.token_bytes(token_id)
    return b.decode("utf-8", errors="replace"), list(b)


def chat_logprobs(tokenizer, lps: list[TokenLogprob]) -> list[dict]:
    out = []
    for lp in lps:
        text, b = token_text(tokenizer, lp.token_id)
        top = []
        for tid, v in lp.top:
            t, tb = token_text(tokenizer, tid)
            top.append({"token": t, "logprob": v, "bytes": tb})
        out.append({"token": text, "logprob": lp.logprob, "bytes": b, "top_logprobs": top})
    return out


def completion_logprobs(tokenizer, lps: list[TokenLogprob], offset: int) -> dict:
    """The legacy completions format: tokens, token_logprobs, top_logprobs (dicts), text_offset."""
    tokens, values, tops, offsets = [], [], [], []
    for lp in lps:
        text, _ = token_text(tokenizer, lp.token_id)
        tokens.append(text)
        values.append(lp.logprob)
        tops.append({token_text(tokenizer, t)[0]: v for t, v in lp.top} if lp.top else None)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def prompt_logprobs_json(lps: list[TokenLogprob | None] | None) -> list | None:
    """vLLM's `prompt_logprobs`: per prompt position None (the first) or {token_id: {logprob, rank?}}."""
    if lps is None:
        return None
    out = []
    for lp in lps:
        if lp is None:
            out.append(None)
            continue
        d = {str(lp.token_id): {"logprob": lp.logprob}}
        for t, v in lp.top:
            d.setdefault(str(t), {"logprob": v})
        out.append(d)
    return out
