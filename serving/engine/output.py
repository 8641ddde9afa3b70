"""Turns sampled tokens into text and finish decisions: detokenization, stop strings / token ids, EOS,
length limits. Stop strings are matched on text; text that may still become a stop string is held back
(at most the longest stop string minus one character), so a streamed stop string never reaches the client.
"""

from __future__ import annotations

from serving.text.detokenizer import IncrementalDetokenizer
from serving.engine.request import Request


class OutputState:
    """Per request: the incremental detokenizer and the held-back tail."""

    def __init__(self, req: Request, tokenizer, max_model_len: int):
        p = req.params
        self.req, self.max_model_len = req, max_model_len
        self.detok = IncrementalDetokenizer(tokenizer, skip_special=p.skip_special_tokens) if tokenizer else None
        self.hold = max((len(s) for s in p.stop), default=1) - 1
        self.pending = ""

    def append(self, token: int) -> tuple[str, str | None, int | str | None]:
        """Record one sampled token: (text to emit now, finish reason or None, stop reason)."""
        req, p = self.req, self.req.params
        req.token_ids.append(token)
        n = req.num_output
        # EOS and stop token ids end the request (their text is not emitted) once min_tokens are out.
        if n > p.min_tokens:
            if token in p.stop_token_ids:
                return self.flush(), "stop", token
            if token == req.eos_id and not p.ignore_eos:
                return self.flush(), "stop", None
        text = self.pending + (self.detok.push([token]) if self.detok else "")
        self.pending = ""
        for i, s in _first_stop(text, p.stop):
            return text[: i + (len(s) if p.include_stop_str_in_output else 0)], "stop", s
        if (p.max_tokens is not None and n >= p.max_tokens) or req.num_tokens >= self.max_model_len:
            return text, "length", None
        cut = len(text) - self.hold if self.hold else len(text)
        self.pending = text[cut:]
        return text[:cut], None, None

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
