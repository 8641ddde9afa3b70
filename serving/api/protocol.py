"""OpenAI request schemas (with vLLM's extensions) and their mapping onto `SamplingParams`.

Known fields are typed and range-checked, so a bad value is a 400 naming the field. Unknown fields are
ignored (as OpenAI and vLLM do) and reported in the log. Parameters this engine cannot honour (penalties,
guided decoding, `suffix`) are refused with a 400 instead of being silently ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from serving.runtime.sampling_params import MAX_LOGPROBS, SamplingParams

INT32_MAX = 2**31 - 1


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    n: int = Field(1, ge=1, le=64)
    temperature: float | None = Field(None, ge=0, le=100)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)  # the sampler holds it as int32
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0, le=INT32_MAX)]] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    priority: int = 0
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    return_token_ids: bool = False  # vLLM: choices carry `token_ids`, the response `prompt_token_ids`
    cache_salt: str | None = None  # vLLM: prefix-cache namespace (tenants, or opting out of shared blocks)

    def unsupported(self) -> str | None:
        """A message for parameters accepted by OpenAI/vLLM that this engine does not implement."""
        for name, neutral in (("presence_penalty", 0), ("frequency_penalty", 0), ("repetition_penalty", 1)):
            v = getattr(self, name)
            if v is not None and v != neutral:
                return f"{name}: sampling penalties are not supported; omit it or pass {neutral}"
        return None

    def sampling(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,  # OpenAI's default
            top_k=self.top_k or 0, top_p=1.0 if self.top_p is None else self.top_p,
            min_p=self.min_p or 0.0, seed=self.seed, max_tokens=max_tokens, min_tokens=self.min_tokens,
            stop=tuple(stop), stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output, logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs, skip_special_tokens=self.skip_special_tokens, n=self.n)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def ignored_fields(self) -> list[str]:
        return sorted(self.model_extra or {})


class ChatCompletionRequest(_Sampling):
    messages: list[dict[str, Any]] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | int | None = None
    add_generation_prompt: bool = True
    response_format: dict[str, Any] | None = None

    def unsupported(self) -> str | None:
        if self.tool_choice == "required" or isinstance(self.tool_choice, dict):
            return "tool_choice: only 'auto' and 'none' are supported (forcing a call needs guided decoding)"
        if self.response_format and self.response_format.get("type", "text") != "text":
            return "response_format: only {'type': 'text'} is supported (no guided decoding)"
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs: needs logprobs=true"
        return super().unsupported()

    def thinking_controls(self) -> tuple[bool | None, str | int | None]:
        kw = self.chat_template_kwargs or {}
        thinking = kw.get("thinking", kw.get("enable_thinking"))
        effort = kw.get("reasoning_effort", self.reasoning_effort)
        return thinking, effort

    def to_sampling(self) -> SamplingParams:
        lp = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling(self.max_completion_tokens or self.max_tokens, lp)


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)

    def unsupported(self) -> str | None:
        if self.suffix:
            return "suffix: not supported"
        if self.best_of is not None and self.best_of != self.n:
            return "best_of: only best_of == n is supported"
        if self.echo and self.stream:
            return "echo: not supported with stream=true"
        return super().unsupported()

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise ValueError("prompt: must not be empty")
        return list(p)

    def to_sampling(self) -> SamplingParams:
        return self.sampling(self.max_tokens, self.logprobs)
