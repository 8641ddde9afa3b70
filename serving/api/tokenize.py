"""`POST /tokenize` and `POST /detokenize`, as vLLM has them: a text prompt (BOS prepended unless
`add_special_tokens` is false, as `/v1/completions` does) or chat messages (encoded exactly as
`/v1/chat/completions` would, under the same chat-template defaults) -> token ids and their count; token ids ->
text. `token_strs` are each token's text, as logprobs show it."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from serving.api.context import Context
from serving.api.generation import token_text
from serving.api.protocol import INT32_MAX
from serving.api.turns import encode_chat
from serving.text.template_kwargs import ChatTemplateKwargs


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = Field(None, min_length=1)
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (the encoding has BOS)
    return_token_strs: bool = False

    def ignored_fields(self) -> list[str]:
        return sorted(self.model_extra or {})

    def unsupported(self) -> str | None:
        if (self.prompt is None) == (self.messages is None):
            return "prompt: give either prompt (text) or messages (a chat), not both or neither"
        if self.prompt is not None and (self.tools or self.chat_template_kwargs):
            return "tools: tools and chat_template_kwargs go with messages, not prompt"
        return None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, le=INT32_MAX)]]

    def ignored_fields(self) -> list[str]:
        return sorted(self.model_extra or {})

    def unsupported(self) -> str | None:
        return None


def _tokenizer(ctx: Context, field: str):
    if ctx.tokenizer is None:
        raise ValueError(f"{field}: this model has no tokenizer (its checkpoint has no tokenizer.json)")
    return ctx.tokenizer


async def tokenize(req: TokenizeRequest, ctx: Context, session_id: str | None) -> dict:
    if req.prompt is not None:
        tok = _tokenizer(ctx, "prompt")
        ids = ([tok.bos_id] if req.add_special_tokens is not False else []) + tok.encode(req.prompt)
    else:
        tok = _tokenizer(ctx, "messages")
        kw = req.chat_template_kwargs or {}
        stated = ChatTemplateKwargs(kw.get("thinking", kw.get("enable_thinking")), kw.get("reasoning_effort"))
        ids = encode_chat(tok, req.messages, tools=req.tools, stated=stated, defaults=ctx.chat_defaults,
                          add_generation_prompt=req.add_generation_prompt).ids
        if req.add_special_tokens:
            ids = [tok.bos_id] + ids
    out = {"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids}
    if req.return_token_strs:
        out["token_strs"] = [token_text(tok, t)[0] for t in ids]
    return out


async def detokenize(req: DetokenizeRequest, ctx: Context, session_id: str | None) -> dict:
    tok = _tokenizer(ctx, "tokens")
    bad = next((i for i, t in enumerate(req.tokens) if t >= tok.vocab_size), None)
    if bad is not None:
        raise ValueError(f"tokens[{bad}]: id {req.tokens[bad]} is outside the tokenizer's vocabulary "
                         f"[0, {tok.vocab_size})")
    return {"prompt": tok.decode(req.tokens)}
