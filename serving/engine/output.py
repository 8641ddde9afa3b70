"""Turns a request's sampled tokens into text: incremental detokenization and stop strings.

The scheduler appends each token and decides every finish (EOS, stop token ids, length, stop strings); this module
reads text. A stop string can only be found in text, so for a request that has stop strings the engine calls
`find_stop` on a step's new tokens before the scheduler appends them, and hands what it found to the scheduler;
`update` then reports each appended token's text under the scheduler's finish. Text that may still become a stop
string is held back (at most the longest stop string minus one character), so a streamed stop string never reaches
the client.
"""

from __future__ import annotations

from serving.engine.request import Finish, Request, StopString
from serving.text.detokenizer import IncrementalDetokenizer


class OutputState:
    """Per request: the incremental detokenizer and the held-back tail."""

    def __init__(self, req: Request, tokenizer):
        p = req.params
        self.req = req
        self.detok = IncrementalDetokenizer(tokenizer, skip_special=p.skip_special_tokens) if tokenizer else None
        self.hold = max((len(s) for s in p.stop), default=1) - 1
        self.pending = ""
        self._decoded: list[str] = []  # the text of tokens `find_stop` decoded that `update` has not reported yet

    def find_stop(self, tokens: list[int]) -> StopString | None:
        """A step's new tokens, before the scheduler appends them: the first whose text completes a stop string, and
        the earliest-starting stop string it completes. Decodes the tokens up to that one (none after it is kept)."""
        text = self.pending
        for j, token in enumerate(tokens):
            piece = self._decode(token)
            self._decoded.append(piece)
            text += piece
            for _, s in _first_stop(text, self.req.params.stop):
                return StopString(j, s)
        return None

    def update(self, token: int, finish: Finish | None) -> str:
        """One appended token -> the text to emit now. `finish` is the scheduler's decision at this token: a stop
        by token (EOS / stop id) emits none of its text, a stop string cuts the text there (after it with
        `include_stop_str_in_output`), and any finish releases the held-back tail."""
        piece = self._decoded.pop(0) if self._decoded else self._decode(token)
        if finish is not None and finish.reason == "stop" and finish.stop_string is None:
            return self.flush()
        text = self.pending + piece
        self.pending = ""
        if finish is not None:
            s = finish.stop_string
            if s is None:
                return text
            return text[: text.find(s) + (len(s) if self.req.params.include_stop_str_in_output else 0)]
        cut = max(len(text) - self.hold, 0)
        self.pending = text[cut:]
        return text[:cut]

    def flush(self) -> str:
        text, self.pending = self.pending, ""
        return text

    def _decode(self, token: int) -> str:
        return self.detok.push([token]) if self.detok else ""


def _first_stop(text: str, stops: tuple[str, ...]):
    """(index, stop string) of the earliest stop string in `text`, if any (a generator of at most one)."""
    best = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    if best is not None:
        yield best
