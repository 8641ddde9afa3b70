"""OpenAI Responses API request schema (`POST /v1/responses`) and its input items as chat-format messages.

Input items: messages (text parts), `function_call` (an earlier tool call of the assistant), `function_call_output`
(its result) and `reasoning` (the assistant's earlier reasoning, kept with the turn it precedes). Only function
tools. `reasoning.effort` maps onto V4.1's thinking mode: "none" turns it off, minimal/low -> low (25),
medium/high -> high (50), xhigh (75), max (100); unset leaves the server's default. What this engine cannot honour
(forced tool choice, structured output, background mode, `truncation: "auto"`, logprobs) is refused with a 400.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from serving.api.protocol import INT32_MAX
from serving.runtime.sampling_params import SamplingParams
from serving.text.template_kwargs import ChatTemplateKwargs

EFFORTS = {"minimal": "low", "low": "low", "medium": "high", "high": "high", "xhigh": "xhigh", "max": "max"}


class _Lenient(BaseModel):
    """Unknown fields are accepted (clients send more than this engine reads) and logged by the route."""

    model_config = ConfigDict(extra="allow")


class TextPart(_Lenient):
    type: Literal["input_text", "output_text", "text", "reasoning_text", "summary_text"]
    text: str


def text_of(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "\n\n".join(p.text for p in content)


class MessageItem(_Lenient):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextPart]


class FunctionCallItem(_Lenient):
    type: Literal["function_call"]
    call_id: str = Field(..., min_length=1)
    name: str = Field(..., min_length=1)
    arguments: str  # a JSON object's text


class FunctionCallOutputItem(_Lenient):
    type: Literal["function_call_output"]
    call_id: str = Field(..., min_length=1)
    output: str | list[TextPart]


class ReasoningItem(_Lenient):
    type: Literal["reasoning"]
    summary: list[TextPart] = Field(default_factory=list)
    content: list[TextPart] | None = None


def _item_kind(value: Any) -> str:
    return value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", "message")


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")] | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_kind)]


class FunctionTool(_Lenient):
    type: Literal["function"]
    name: str = Field(..., min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def to_chat(self) -> dict:
        function = {"name": self.name, "parameters": self.parameters or {"type": "object", "properties": {}}}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


class ToolChoiceFunction(_Lenient):
    type: Literal["function"]
    name: str


class ReasoningConfig(_Lenient):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None  # reasoning comes back whole, as `content`


class TextFormat(_Lenient):
    type: Literal["text", "json_schema", "json_object"] = "text"


class TextConfig(_Lenient):
    format: TextFormat | None = None


class ResponsesRequest(_Lenient):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction = "auto"
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)  # vLLM's extension
    seed: int | None = Field(None, ge=0, lt=2**63)  # vLLM's extension
    reasoning: ReasoningConfig | None = None
    text: TextConfig | None = None
    truncation: Literal["auto", "disabled"] | None = None
    background: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    include: list[str] | None = None  # what to add to the output; reasoning always comes back as plain text
    metadata: dict[str, str] | None = Field(None, max_length=16)
    user: str | None = None
    cache_salt: str | None = None  # vLLM's extension: a prefix-cache namespace
    priority: int = 0  # vLLM's extension, with --scheduling-policy priority

    def ignored_fields(self) -> list[str]:
        return sorted(self.model_extra or {})

    def unsupported(self) -> str | None:
        if self.tool_choice == "required" or isinstance(self.tool_choice, ToolChoiceFunction):
            return "tool_choice: only 'auto' and 'none' are supported (forcing a call needs guided decoding)"
        if self.text and self.text.format and self.text.format.type != "text":
            return "text.format: only {'type': 'text'} is supported (no guided decoding)"
        if self.background:
            return "background: not supported; send the request and read its stream or response"
        if self.truncation == "auto":
            return "truncation: only 'disabled' is supported (a prompt over the context length is refused)"
        if self.top_logprobs:
            return "top_logprobs: not supported on /v1/responses (use /v1/chat/completions)"
        if self.previous_response_id is not None and not self.previous_response_id:
            return "previous_response_id: must not be empty"
        return None

    def template_kwargs(self) -> ChatTemplateKwargs:
        effort = self.reasoning.effort if self.reasoning else None
        if effort is None:
            return ChatTemplateKwargs()
        return ChatTemplateKwargs(reasoning_effort="none" if effort == "none" else EFFORTS[effort])

    def chat_tools(self) -> list[dict] | None:
        return [t.to_chat() for t in self.tools] if self.tools else None

    def max_calls(self) -> int | None:
        return None if self.parallel_tool_calls else 1

    def to_sampling(self) -> SamplingParams:
        return SamplingParams(temperature=1.0 if self.temperature is None else self.temperature,
                              top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0, seed=self.seed,
                              max_tokens=self.max_output_tokens)

    def input_messages(self) -> list[dict]:
        """`input` as chat-format messages (what the V4.1 encoder reads); instructions are not among them."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        return items_to_messages(self.input)


def items_to_messages(items: list) -> list[dict]:
    """Responses input items -> chat-format messages. A turn's function calls join the assistant message before
    them; reasoning joins the assistant message or call that follows it."""
    messages: list[dict] = []
    reasoning: str | None = None
    for item in items:
        if isinstance(item, ReasoningItem):
            parts = item.content if item.content is not None else item.summary
            reasoning = (reasoning or "") + "".join(p.text for p in parts)
        elif isinstance(item, MessageItem):
            message = {"role": item.role, "content": text_of(item.content)}
            if item.role == "assistant":
                message["reasoning_content"], reasoning = reasoning, None
            messages.append(message)
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and reasoning is None:
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "reasoning_content": reasoning,
                                 "tool_calls": [call]})
                reasoning = None
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": text_of(item.output)})
    return messages
