"""What every route's handler reads: the engine, the tokenizer, the served name and the server's settings."""

from __future__ import annotations

from dataclasses import dataclass, field

from serving.api.response_store import ResponseStore
from serving.text.template_kwargs import ChatTemplateKwargs


@dataclass
class Context:
    engine: object  # AsyncEngine
    tokenizer: object
    model_name: str
    # what a request that states nothing about thinking gets (the checkpoint's or --default-chat-template-kwargs)
    chat_defaults: ChatTemplateKwargs = field(default_factory=ChatTemplateKwargs)
    max_model_len: int = 0
    responses: ResponseStore = field(default_factory=ResponseStore)  # `/v1/responses`' stored conversations


class NotFound(LookupError):
    """Something a request names does not exist (HTTP 404); `param` is the field that names it."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param
