"""Anthropic Messages API request schema (`POST /v1/messages`, `/v1/messages/count_tokens`) and its messages as
chat-format messages for the V4.1 encoder.

Blocks: `text`, `thinking` / `redacted_thinking` (an earlier turn's reasoning; redacted is dropped), `tool_use`
(an earlier tool call) and `tool_result` (its result, in a user message). Images and documents are refused (a
text-only model). `thinking` maps onto V4.1's thinking mode (enabled / adaptive: on, disabled: off), and
`output_config.effort` onto its effort (low 25, medium / high 50, xhigh 75, max 100); neither given leaves the
server's default. Forced tool choice (`any`, `tool`) and a final assistant message (prefill) are refused.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from serving.api.protocol import INT32_MAX
from serving.runtime.sampling_params import SamplingParams
from serving.text.template_kwargs import ChatTemplateKwargs

EFFORTS = {"low": "low", "medium": "high", "high": "high", "xhigh": "xhigh", "max": "max"}
MAX_STOP_SEQUENCES = 16


class _Lenient(BaseModel):
    """Unknown fields (e.g. `cache_control`) are accepted and, at the top level, logged by the route."""

    model_config = ConfigDict(extra="allow")


class TextBlock(_Lenient):
    type: Literal["text"]
    text: str


class ThinkingBlock(_Lenient):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Lenient):
    type: Literal["redacted_thinking"]
    data: str


class ToolUseBlock(_Lenient):
    type: Literal["tool_use"]
    id: str = Field(..., min_length=1)
    name: str = Field(..., min_length=1)
    input: dict[str, Any]


class ToolResultBlock(_Lenient):
    type: Literal["tool_result"]
    tool_use_id: str = Field(..., min_length=1)
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None


ContentBlock = Annotated[TextBlock | ThinkingBlock | RedactedThinkingBlock | ToolUseBlock | ToolResultBlock,
                         Field(discriminator="type")]


class Message(_Lenient):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class Tool(_Lenient):
    type: Literal["custom"] | None = None
    name: str = Field(..., min_length=1)
    description: str | None = None
    input_schema: dict[str, Any]

    def to_chat(self) -> dict:
        function = {"name": self.name, "parameters": self.input_schema}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


class ToolChoice(_Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingEnabled(_Lenient):
    type: Literal["enabled"]
    budget_tokens: int = Field(..., ge=1024)  # Anthropic's minimum; V4.1 has no budget, only an effort


class ThinkingDisabled(_Lenient):
    type: Literal["disabled"]


class ThinkingAdaptive(_Lenient):
    type: Literal["adaptive"]


class OutputConfig(_Lenient):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


Thinking = Annotated[ThinkingEnabled | ThinkingDisabled | ThinkingAdaptive, Field(discriminator="type")]


class CountTokensRequest(_Lenient):
    """What makes the prompt (`/v1/messages/count_tokens` takes only this)."""

    model: str = Field(..., min_length=1)
    messages: list[Message] = Field(..., min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None

    def ignored_fields(self) -> list[str]:
        return sorted(self.model_extra or {})

    def unsupported(self) -> str | None:
        if self.tool_choice is not None and self.tool_choice.type in ("any", "tool"):
            return "tool_choice: only 'auto' and 'none' are supported (forcing a call needs guided decoding)"
        if self.messages[-1].role == "assistant":
            return (f"messages.{len(self.messages) - 1}.role: a final assistant message (prefill) is not supported; "
                    "end with a user message")
        return None

    def template_kwargs(self) -> ChatTemplateKwargs:
        thinking = None if self.thinking is None else self.thinking.type != "disabled"
        effort = self.output_config.effort if self.output_config else None
        if thinking is False:
            return ChatTemplateKwargs(False)
        return ChatTemplateKwargs(thinking, EFFORTS[effort] if effort else None)

    def chat_tools(self) -> list[dict] | None:
        return [t.to_chat() for t in self.tools] if self.tools else None

    def max_calls(self) -> int | None:
        return 1 if self.tool_choice is not None and self.tool_choice.disable_parallel_tool_use else None

    def parsed_tools(self) -> list[dict] | None:
        """The tools whose calls are read from the output (none with tool_choice "none")."""
        return None if self.tool_choice is not None and self.tool_choice.type == "none" else self.chat_tools()

    def chat_messages(self) -> list[dict]:
        """`system` and `messages` as chat-format messages; ValueError names a misplaced block."""
        out: list[dict] = []
        if self.system:
            out.append({"role": "system", "content": _text(self.system)})
        for i, m in enumerate(self.messages):
            if isinstance(m.content, str):
                out.append({"role": m.role, "content": m.content})
            elif m.role == "user":
                out += _user_messages(m.content, f"messages.{i}.content")
            else:
                out.append(_assistant_message(m.content, f"messages.{i}.content"))
        return out


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(..., ge=1)
    stop_sequences: list[Annotated[str, Field(min_length=1)]] | None = Field(None, max_length=MAX_STOP_SEQUENCES)
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, le=INT32_MAX)
    metadata: dict[str, Any] | None = None
    cache_salt: str | None = None  # vLLM's extension: a prefix-cache namespace

    def unsupported(self) -> str | None:
        if isinstance(self.thinking, ThinkingEnabled) and self.thinking.budget_tokens >= self.max_tokens:
            return (f"thinking.budget_tokens: must be less than max_tokens ({self.thinking.budget_tokens} >= "
                    f"{self.max_tokens})")
        return super().unsupported()

    def to_sampling(self) -> SamplingParams:
        return SamplingParams(temperature=1.0 if self.temperature is None else self.temperature,
                              top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0,
                              max_tokens=self.max_tokens, stop=tuple(self.stop_sequences or ()))


def _text(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else "\n\n".join(b.text for b in content)


def _user_messages(blocks: list, where: str) -> list[dict]:
    """A user message's blocks in order: text runs as user messages, tool results as tool messages (the encoder
    merges them back into one user turn)."""
    out: list[dict] = []
    for j, b in enumerate(blocks):
        if isinstance(b, TextBlock):
            if out and out[-1]["role"] == "user":
                out[-1]["content"] += "\n\n" + b.text
            else:
                out.append({"role": "user", "content": b.text})
        elif isinstance(b, ToolResultBlock):
            out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": _text(b.content or "")})
        else:
            raise ValueError(f"{where}.{j}.type: a user message holds text and tool_result blocks, got {b.type!r}")
    return out


def _assistant_message(blocks: list, where: str) -> dict:
    texts, thoughts, calls = [], [], []
    for j, b in enumerate(blocks):
        if isinstance(b, TextBlock):
            texts.append(b.text)
        elif isinstance(b, ThinkingBlock):
            thoughts.append(b.thinking)
        elif isinstance(b, ToolUseBlock):
            calls.append({"id": b.id, "type": "function",
                          "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}})
        elif isinstance(b, ToolResultBlock):
            raise ValueError(f"{where}.{j}.type: tool_result belongs in a user message")
    message = {"role": "assistant", "content": "".join(texts), "reasoning_content": "".join(thoughts) or None}
    if calls:
        message["tool_calls"] = calls
    return message
