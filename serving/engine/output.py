"""Turns a request's sampled tokens into text: incremental detokenization and stop strings.

The scheduler appends each token and decides the token-based finishes (EOS, stop token ids, length); this
module only reads the request and the new token. Stop strings are matched on text; text that may still
become a stop string is held back (at most the longest stop string minus one character), so a streamed
stop string never reaches the client. A stop string found here is reported to the engine, which finishes
the request (as vLLM's detokenizer reports one to its output processor).
"""

from __future__ import annotations

from serving.engine.request import Finish, Request
from serving.text.detokenizer import IncrementalDetokenizer


class OutputState:
    """Per request: the incremental detokenizer and the held-back tail."""

    def __init__(self, req: Request, tokenizer):
        p = req.params
        self.req = req
        self.detok = IncrementalDetokenizer(tokenizer, skip_special=p.skip_special_tokens) if tokenizer else None
        self.hold = max((len(s) for s in p.stop), default=1) - 1
        self.pending = ""

    def update(self, token: int, finish: Finish | None) -> tuple[str, str | None]:
        """One new token -> (text to emit now, the stop string it completed or None). `finish` is the
        scheduler's decision for this token: a stop by token (EOS / stop id) emits none of its text, and any
        finish releases the held-back tail."""
        p = self.req.params
        if finish is not None and finish.reason == "stop":
            return self.flush(), None
        text = self.pending + (self.detok.push([token]) if self.detok else "")
        self.pending = ""
        for i, s in _first_stop(text, p.stop):
            return text[: i + (len(s) if p.include_stop_str_in_output else 0)], s
        if finish is not None:
            return text, None
        cut = len(text) - self.hold if self.hold else len(text)
        self.pending = text[cut:]
        return text[:cut], None

    def flush(self) -> str:
        text, self.pending = self.pending, ""
        return text


def _first_stop(text: str, stops: tuple[str, ...]):
    """(index, stop string) of the earliest stop string in `text`, if any (a generator of at most one)."""
    best = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    if best is not None:
        yield best
