"""The chat-template keyword arguments the V4.1 encoder knows - `thinking` (alias `enable_thinking`) and
`reasoning_effort` - typed, and how a request's lie over a server's defaults.

A server's defaults are vLLM's `--default-chat-template-kwargs`; a checkpoint folder may state its own in
`tokenizer_config.json` under `chat_template_kwargs` (beside where Hugging Face checkpoints keep their chat
template), which the flag replaces. They exist for models that do not follow V4.1's recipe (thinking on at
effort 50): the built-in nano-austen never learned to close a thinking block, so its folder states thinking off.

A request overrides what it states. A request that names an effort asks for thinking, so a default
`thinking: false` does not silence it; a request that turns thinking on drops a default effort of "none".
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serving.text.encoding import DEFAULT_EFFORT, resolve_thinking

KNOWN_KEYS = ("thinking", "enable_thinking", "reasoning_effort")
CHECKPOINT_FILE = "tokenizer_config.json"
CHECKPOINT_KEY = "chat_template_kwargs"


@dataclass(frozen=True)
class ChatTemplateKwargs:
    """What a request or a server states about thinking; None: not stated (V4.1's recipe decides)."""

    thinking: bool | None = None
    reasoning_effort: str | int | None = None

    @classmethod
    def parse(cls, value: Any, where: str) -> ChatTemplateKwargs:
        """From a JSON object; ValueError names `where` and the bad key or value."""
        if not isinstance(value, dict):
            raise ValueError(f"{where}: must be a JSON object, got {type(value).__name__}")
        unknown = sorted(set(value) - set(KNOWN_KEYS))
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {unknown}; the V4.1 encoder knows {list(KNOWN_KEYS)}")
        stated = cls(value.get("thinking", value.get("enable_thinking")), value.get("reasoning_effort"))
        try:
            stated.resolve()
        except ValueError as e:
            raise ValueError(f"{where}.{e}") from None
        return stated

    @classmethod
    def parse_json(cls, text: str, where: str) -> ChatTemplateKwargs:
        try:
            value = json.loads(text)
        except ValueError as e:
            raise ValueError(f"{where}: not valid JSON ({e})") from None
        return cls.parse(value, where)

    def over(self, defaults: ChatTemplateKwargs) -> ChatTemplateKwargs:
        """These (a request's) laid over `defaults` (the server's)."""
        if self.thinking is None and self.reasoning_effort is None:
            return defaults
        if self.thinking is None:  # an effort alone asks for thinking (or, "none", for none)
            return self
        effort = self.reasoning_effort
        if effort is None and defaults.reasoning_effort != "none":
            effort = defaults.reasoning_effort
        return ChatTemplateKwargs(self.thinking, effort)

    def resolve(self) -> tuple[bool, int]:
        """(thinking on?, effort 1-100); ValueError names the bad field."""
        return resolve_thinking(self.thinking, self.reasoning_effort)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.thinking is not None:
            out["thinking"] = self.thinking
        if self.reasoning_effort is not None:
            out["reasoning_effort"] = self.reasoning_effort
        return out

    def describe(self) -> str:
        """What a request that states nothing gets, in words."""
        on, effort = self.resolve()
        if not on:
            return "thinking off"
        return f"thinking on at effort {effort}" + (" (V4.1's recipe)" if effort == DEFAULT_EFFORT else "")


def read_checkpoint_defaults(folder: Path) -> ChatTemplateKwargs | None:
    """The defaults a checkpoint folder states (`tokenizer_config.json` -> `chat_template_kwargs`), or None."""
    path = Path(folder) / CHECKPOINT_FILE
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(config, dict) or CHECKPOINT_KEY not in config:
        return None
    return ChatTemplateKwargs.parse(config[CHECKPOINT_KEY], f"{path}: {CHECKPOINT_KEY}")
