"""A stand-in for the engine behind the API routes: every request "generates" a scripted text in pieces, with the
engine's admission checks (empty or too long prompt, token ids, context length), and records what it was given.
The app around it is the real one (`build_app`), so routes, schemas, parsers and errors are what they serve."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from types import SimpleNamespace

from serving.api.response_store import ResponseStore
from serving.api.server import build_app
from serving.engine.request import RequestOutput
from serving.runtime.sampling_params import SamplingParams
from serving.text.template_kwargs import ChatTemplateKwargs
from serving.text.tokenizer import byte_level_tokenizer

TOK = byte_level_tokenizer(512)
MAX_MODEL_LEN = 4096


@dataclass
class Submitted:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams


class ScriptedStream:
    """The script in pieces of `step` characters, one token each; cut at max_tokens, or at a stop string."""

    def __init__(self, text: str, step: int, params: SamplingParams, cached: int):
        stop_at = min(((text.find(s), s) for s in params.stop if s in text), default=None)
        self.stop = None
        if stop_at is not None:
            text, self.stop = text[:stop_at[0]], stop_at[1]
        self.pieces = [text[i:i + step] for i in range(0, len(text), step)] or [""]
        self.limit, self.cached, self.closed = params.max_tokens, cached, False

    async def __aiter__(self):
        for k, piece in enumerate(self.pieces):
            length = self.limit is not None and k + 1 >= self.limit
            last = length or k == len(self.pieces) - 1
            reason = "length" if length and k < len(self.pieces) - 1 else "stop" if last else None
            yield RequestOutput("r", [7], piece, last, reason, self.stop if reason == "stop" else None,
                                num_prompt_tokens=5, num_cached_tokens=self.cached, num_output_tokens=k + 1)
            await asyncio.sleep(0)
            if last:
                return

    def close(self):
        self.closed = True


@dataclass
class ScriptedEngine:
    text: str = "Thinking it over.</think>It is fine."
    step: int = 4
    cached: int = 0
    submitted: list[Submitted] = field(default_factory=list)
    engine: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(metrics=None))

    async def submit(self, rid, prompt_ids, params, **meta):
        if not prompt_ids:
            raise ValueError("prompt is empty")
        if any(not 0 <= t < TOK.vocab_size for t in prompt_ids):
            raise ValueError("prompt token id outside the vocabulary")
        if len(prompt_ids) + (params.max_tokens or 1) > MAX_MODEL_LEN:
            raise ValueError(f"this model's maximum context length is {MAX_MODEL_LEN} tokens")
        self.submitted.append(Submitted(rid, list(prompt_ids), params))
        return ScriptedStream(self.text, self.step, params, self.cached)


def scripted_app(engine: ScriptedEngine, *, api_key: str | None = None, defaults: ChatTemplateKwargs | None = None,
                 store: ResponseStore | None = None):
    return build_app(engine, TOK, model_name="m", max_model_len=MAX_MODEL_LEN, api_key=api_key,
                     chat_defaults=defaults, response_store=store)


def sse_events(text: str) -> list[dict]:
    """A streamed body's events, each `event: <type>` line checked against its data's type."""
    events = []
    for block in text.strip().split("\n\n"):
        kind, data = block.split("\n")
        body = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {body['type']}"
        events.append(body)
    return events
