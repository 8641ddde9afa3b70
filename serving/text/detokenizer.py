"""Incremental detokenization: generated token ids -> newly completed text, never a broken character.

V4.1's tokenizer is byte-level: a token may hold part of a character (an emoji is 4 bytes, often split
over 2-4 tokens). The detokenizer feeds each new token's bytes to an incremental UTF-8 decoder, which
returns the characters completed so far and keeps the bytes of an unfinished one:

    push([id(F0 9F)]) -> ""        first half of 😀: held
    push([id(98 80), id(!)]) -> "😀!"

Cost per push is O(new tokens) whatever the length of the text. Invalid byte sequences come out as
U+FFFD exactly as `Tokenizer.decode` of the whole sequence gives them; `flush()` ends the stream and
releases a trailing unfinished character (as U+FFFD).
"""

from __future__ import annotations

import codecs

from serving.text.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Text of one request's generated tokens, built piece by piece."""

    def __init__(self, tokenizer: Tokenizer, *, skip_special: bool = True):
        if not tokenizer.byte_level:
            raise ValueError("IncrementalDetokenizer needs a byte-level tokenizer (ByteLevel decoder), as "
                             "V4.1's tokenizer.json has")
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pieces: list[str] = []  # collapsed into one string when `text` is read

    def push(self, token_ids: list[int]) -> str:
        """Append tokens; return the text they complete (may be "" while a character is unfinished)."""
        tok = self._tokenizer
        data = b"".join(tok.token_bytes(i) for i in token_ids
                        if not (self._skip_special and tok.is_skipped(i)))
        return self._emit(self._utf8.decode(data))

    def flush(self) -> str:
        """End of stream: release a trailing unfinished character as U+FFFD (usually "")."""
        return self._emit(self._utf8.decode(b"", final=True))

    def _emit(self, piece: str) -> str:
        if piece:
            self._pieces.append(piece)
        return piece

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""
