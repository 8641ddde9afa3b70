"""The `/v1/responses` store: responses kept in memory for `previous_response_id` and `GET /v1/responses/{id}`,
least recently used first out, bounded in entries and in bytes (`--responses-store-max-entries`,
`--responses-store-max-bytes`). Each entry holds its whole conversation, so the next turn re-encodes the same
prefix and the prefix cache serves it; nothing survives a restart."""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_ENTRIES = 1024
DEFAULT_MAX_BYTES = 64 << 20


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the response object as it was returned
    conversation: tuple[dict[str, Any], ...]  # chat-format messages, its own assistant turn last (no instructions)
    nbytes: int  # what it counts against the bound: both as JSON text


class ResponseStore:
    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, max_bytes: int = DEFAULT_MAX_BYTES):
        if max_entries < 1 or max_bytes < 1:
            raise ValueError(f"the response store needs room: max_entries {max_entries}, max_bytes {max_bytes}")
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, response: dict, conversation: list[dict]) -> bool:
        """Keep it, evicting the least recently used beyond the bounds; False when it alone exceeds the bytes."""
        nbytes = _json_bytes(response) + _json_bytes(conversation)
        if nbytes > self.max_bytes:
            return False
        self.delete(response_id)
        self._entries[response_id] = StoredResponse(response, tuple(conversation), nbytes)
        self.nbytes += nbytes
        while len(self._entries) > self.max_entries or self.nbytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.nbytes -= old.nbytes
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        """The entry (now the most recently used), or None: never stored, deleted or evicted."""
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self.nbytes -= entry.nbytes
        return True


def _json_bytes(value: Any) -> int:
    return len(json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode())
