"""What a request asks of generation: the device sampler reads the first five fields, the engine the rest.

One class for the offline API, the server and the runtime (vLLM's names and defaults). Invalid values raise
`ValueError` naming the field; the server turns that into a 400.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_LOGPROBS = 20  # top logprobs the device returns per row (OpenAI allows 0..20)
MAX_BANNED = 16  # token ids one row may be kept from sampling (EOS + stop ids until min_tokens are out)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off (vLLM's -1 is accepted as off too)
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None  # reproducible whatever else is in the batch
    max_tokens: int | None = 16  # None: up to the model length
    min_tokens: int = 0  # EOS and stop token ids are ignored before this many tokens
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # top logprobs per generated token (0 = only the sampled one)
    prompt_logprobs: int | None = None  # same for prompt tokens; such requests keep every row (no trimming)
    skip_special_tokens: bool = True
    n: int = 1

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        _check(self.temperature >= 0, "temperature", "must be >= 0", self.temperature)
        _check(self.top_k >= 0, "top_k", "must be >= 0 (0 or -1 = off)", self.top_k)
        _check(0 < self.top_p <= 1, "top_p", "must be in (0, 1]", self.top_p)
        _check(0 <= self.min_p <= 1, "min_p", "must be in [0, 1]", self.min_p)
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "must be >= 1", self.max_tokens)
        _check(self.min_tokens >= 0, "min_tokens", "must be >= 0", self.min_tokens)
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
               f"must be <= max_tokens ({self.max_tokens})", self.min_tokens)
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            _check(v is None or 0 <= v <= MAX_LOGPROBS, name, f"must be in [0, {MAX_LOGPROBS}]", v)
        _check(self.n >= 1, "n", "must be >= 1", self.n)
        _check(self.seed is None or 0 <= self.seed < 2**63, "seed", "must be in [0, 2**63)", self.seed)
        _check(all(s for s in self.stop), "stop", "must not contain empty strings", list(self.stop))
        _check(not self.min_tokens or len(self.stop_token_ids) < MAX_BANNED, "stop_token_ids",
               f"may hold at most {MAX_BANNED - 1} ids together with min_tokens", len(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _check(ok: bool, name: str, what: str, value) -> None:
    if not ok:
        raise ValueError(f"{name} {what}, got {value!r}")
