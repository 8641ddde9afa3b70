"""DeepSeek-V4.1 tool calls ("spaced DSML") in generated content -> OpenAI tool calls.

The model writes, after any text and a blank line:

    <｜DSML｜ calls>
    <｜DSML｜ invoke name="get_weather">
    <｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>
    <｜DSML｜ parameter name="days" string="false">3</｜DSML｜ parameter>
    </｜DSML｜ invoke>
    </｜DSML｜ calls>

-> content "..." and ToolCall(name="get_weather", arguments='{"city": "Paris", "days": 3}').

Rules (vLLM 0.33.0's deepseek_v41 parser where it decides; the notes say where this one differs):
- `string="true"` values are taken as is; `string="false"` values are JSON (the raw text if that fails).
  With the attribute missing, the tool's JSON schema decides (string -> as is, else JSON). A value
  whose schema admits no string is coerced from its text (`"5"` -> 5 for an integer), a non-string
  for a string-only parameter becomes its JSON text, and a lone `arguments`/`input` wrapper that is
  not a parameter of the tool is unwrapped, as vLLM does.
- An invoke body without parameter tags may be a JSON object (what grammar-constrained decoding
  writes); an empty body is `{}`. An invoke may appear without the `calls` wrapper, and a `calls`
  close also closes an unclosed invoke.
- Whitespace before a tool block (the encoder's blank-line separator) is dropped; so is trailing
  whitespace, and content that is only whitespace, when tool calls were made.
- Malformed output never raises: an invoke that cannot be read (bad name, unreadable body, cut off
  by the end of generation) is returned as content text, and a block with no readable invoke is
  returned whole as content. (vLLM drops such text, and returns a cut-off invoke as a call.)
- Text after a tool block stays content (vLLM drops it).

`ToolCallParser.feed` holds back text that may start a marker and emits each call whole when its
invoke closes, so any split of the text gives the same content and calls as the whole.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from serving.text.encoding import (INVOKE_END, INVOKE_START, PARAMETER_END, PARAMETER_START, TOOL_CALLS_END,
                                  TOOL_CALLS_START)
from serving.api.reasoning import held_suffix_length


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object's text

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolCallDelta:
    """One streamed tool call, sent whole: index among the response's calls, id, name, arguments."""
    index: int
    call: ToolCall

    def to_openai(self) -> dict:
        return {"index": self.index, **self.call.to_openai()}


_PARAMETER_RE = re.compile(
    re.escape(PARAMETER_START) + r'\s+name="([^"]+)"(?:\s+string="([^"]*)")?\s*>(.*?)'
    r"(?:" + re.escape(PARAMETER_END) + r"|(?=" + re.escape(PARAMETER_START) + r'\s+name="))', re.DOTALL)
_WRAPPER_KEYS = ("arguments", "input")
_CLOSE_MARKER_LEN = max(len(INVOKE_END), len(TOOL_CALLS_END))


# ======================================================================== argument typing
def _schema_types(schema: Any) -> set[str]:
    """JSON-schema types a parameter admits (type / enum / anyOf / oneOf / allOf); empty if unknown."""
    if not isinstance(schema, dict):
        return set()
    types: set[str] = set()
    declared = schema.get("type")
    types.update([declared] if isinstance(declared, str) else [t for t in declared or () if isinstance(t, str)])
    for value in schema.get("enum") or ():
        types.add("string" if isinstance(value, str) else "null" if value is None else "other")
    for key in ("anyOf", "oneOf", "allOf"):
        for sub in schema.get(key) or ():
            types |= _schema_types(sub)
    return types


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _typed_value(raw: str, string_attr: str | None, schema: Any) -> Any:
    types = _schema_types(schema)
    if string_attr == "true" or (string_attr is None and types == {"string"}):
        value: Any = raw
    else:
        value = _json_or_text(raw)
    if types and isinstance(value, str) and "string" not in types:
        coerced = _json_or_text(value)
        if not isinstance(coerced, str):
            value = coerced
    elif types == {"string"} and not isinstance(value, str):
        value = json.dumps(value, ensure_ascii=False)
    return value


def _tool_properties(tools: list[dict] | None) -> dict[str, dict]:
    """name -> JSON-schema `properties` of each OpenAI function tool."""
    found = {}
    for tool in tools or ():
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            parameters = function.get("parameters")
            properties = parameters.get("properties") if isinstance(parameters, dict) else None
            found[function["name"]] = properties if isinstance(properties, dict) else {}
    return found


def _unwrap(arguments: dict, properties: dict) -> dict:
    if len(arguments) != 1 or not properties:
        return arguments
    (key, inner), = arguments.items()
    if key not in _WRAPPER_KEYS or key in properties:
        return arguments
    if isinstance(inner, str):
        inner = _json_or_text(inner)
    return inner if isinstance(inner, dict) and set(inner) <= set(properties) else arguments


def read_invoke(invoke_text: str, tools_properties: dict[str, dict]) -> tuple[str, dict] | None:
    """(name, arguments) of the text after `<｜DSML｜ invoke name="` up to its close; None if unreadable."""
    name_end = invoke_text.find('">')
    name = invoke_text[:name_end].strip() if name_end >= 0 else ""
    if not name or any(c in name for c in '"<>\n'):
        return None
    body = invoke_text[name_end + 2:]
    properties = tools_properties.get(name, {})
    parameters = _PARAMETER_RE.findall(body)
    if parameters:
        arguments = {key: _typed_value(raw, string_attr or None, properties.get(key))
                     for key, string_attr, raw in parameters}
    elif not body.strip():
        arguments = {}
    else:
        arguments = _json_or_text(body.strip())
        if not isinstance(arguments, dict):
            return None
    return name, _unwrap(arguments, properties)


# ======================================================================== streaming parser
class _State(Enum):
    CONTENT = "content"
    BLOCK = "block"  # inside <｜DSML｜ calls>, between invokes
    INVOKE = "invoke"  # inside an invoke, until its close


def _new_call_id(index: int) -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class ToolCallParser:
    """Streaming tool-call extraction from one request's content (after the reasoning parser)."""

    def __init__(self, tools: list[dict] | None = None, *, call_id: Callable[[int], str] = _new_call_id):
        """tools: the request's OpenAI tools (their schemas type the arguments); call_id(index) -> id."""
        self._properties = _tool_properties(tools)
        self._call_id = call_id
        self._calls: list[ToolCall] = []
        self._state = _State.CONTENT
        self._held = ""  # CONTENT/BLOCK: may be the start of a marker
        self._content_ws = ""  # trailing whitespace of content, dropped if a tool block follows
        self._block_raw = ""  # text of the open block (from its opening marker): returned if unreadable
        self._block_leading_ws = ""  # whitespace before the block, restored if the block is returned
        self._block_calls = 0
        self._block_leftovers: list[str] = []  # unreadable invokes and stray text inside the block
        self._block_stray = ""  # text since the last invoke/opening marker of the block
        self._bare = False  # the open invoke has no calls wrapper
        self._invoke: list[str] = []  # text of the open invoke after its opening marker, in pieces
        self._invoke_tail = ""  # its last characters: where a closing marker may have begun

    @property
    def tool_calls(self) -> list[ToolCall]:
        return list(self._calls)

    def feed(self, delta: str) -> tuple[str, list[ToolCallDelta]]:
        """Next piece of content -> (content delta, tool calls completed by it)."""
        content: list[str] = []
        first_new = len(self._calls)
        text, self._held = self._held + delta, ""
        while text:
            if self._state is _State.INVOKE:
                text = self._feed_invoke(text, content)
                continue
            markers = ((TOOL_CALLS_START, INVOKE_START) if self._state is _State.CONTENT
                       else (INVOKE_START, TOOL_CALLS_END))
            hits = [(text.find(m), m) for m in markers if m in text]
            if not hits:
                hold = held_suffix_length(text, markers)
                self._plain(text[:len(text) - hold], content)
                self._held = text[len(text) - hold:]
                break
            pos, marker = min(hits)
            self._plain(text[:pos], content)
            text = text[pos + len(marker):]
            if marker == TOOL_CALLS_END:
                self._block_raw += marker
                self._close_block(content)
                continue
            if self._state is _State.CONTENT:
                self._open_block(marker if marker == TOOL_CALLS_START else "")
            self._flush_stray()
            if marker == INVOKE_START:
                self._bare = self._state is _State.CONTENT
                self._state, self._invoke, self._invoke_tail = _State.INVOKE, [], ""
            else:
                self._state = _State.BLOCK
        return "".join(content), [ToolCallDelta(i, c) for i, c in enumerate(self._calls) if i >= first_new]

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """End of generation: an open invoke or block is returned as content; held text is released."""
        content: list[str] = []
        if self._state is _State.INVOKE:
            cut_off = INVOKE_START + "".join(self._invoke)
            self._block_leftovers.append(cut_off)
            self._block_raw += cut_off
            self._close_block(content)
        elif self._state is _State.BLOCK:
            self._plain(self._held, content)
            self._close_block(content)
        else:
            self._plain(self._held, content)
        self._held = ""
        if not self._calls:
            content.append(self._content_ws)
        self._content_ws = ""
        return "".join(content), []

    # -------------------------------------------------------------------- pieces
    def _plain(self, text: str, content: list[str]) -> None:
        """Text outside markers: content (trailing whitespace held), or stray text inside a block."""
        if not text:
            return
        if self._state is _State.BLOCK:
            self._block_raw += text
            self._block_stray += text
            return
        text = self._content_ws + text
        kept = text.rstrip()
        self._content_ws = text[len(kept):]
        if kept:
            content.append(kept)

    def _open_block(self, opening_marker: str) -> None:
        self._block_raw, self._block_calls, self._block_leftovers = opening_marker, 0, []
        self._block_leading_ws, self._content_ws = self._content_ws, ""

    def _flush_stray(self) -> None:
        """Stray text between a block's markers: kept (stripped) unless it is only whitespace."""
        if self._block_stray.strip():
            self._block_leftovers.append(self._block_stray.strip())
        self._block_stray = ""

    def _close_block(self, content: list[str]) -> None:
        self._flush_stray()
        self._state = _State.CONTENT
        if self._block_calls:
            returned = "\n".join(self._block_leftovers)  # unreadable parts next to readable calls
        else:
            returned = self._block_leading_ws + self._block_raw
        self._block_raw, self._block_leftovers, self._block_leading_ws = "", [], ""
        self._plain(returned, content)

    def _feed_invoke(self, text: str, content: list[str]) -> str:
        """Add text to the open invoke; on its close record the call and return the text after it.

        Only the tail of the earlier text and the new text are searched, so a long argument streamed
        in many deltas costs O(its length) overall.
        """
        window = self._invoke_tail + text
        ends = [(window.find(m), m) for m in (INVOKE_END, TOOL_CALLS_END) if m in window]
        if not ends:
            self._invoke.append(text)
            self._invoke_tail = window[-_CLOSE_MARKER_LEN + 1:]
            return ""
        pos, marker = min(ends)
        invoke = "".join(self._invoke)
        invoke = invoke[:len(invoke) - len(self._invoke_tail)] + window
        pos += len(invoke) - len(window)
        rest = invoke[pos + len(marker):]
        whole = INVOKE_START + invoke[:pos + len(marker)]
        self._block_raw += whole
        parsed = read_invoke(invoke[:pos], self._properties)
        if parsed is None:
            self._block_leftovers.append(whole)
        else:
            name, arguments = parsed
            index = len(self._calls)
            self._calls.append(ToolCall(self._call_id(index), name, json.dumps(arguments, ensure_ascii=False)))
            self._block_calls += 1
        self._invoke, self._invoke_tail = [], ""
        if marker == TOOL_CALLS_END or self._bare:
            self._close_block(content)
        else:
            self._state = _State.BLOCK
        return rest


def parse_tool_calls(text: str, tools: list[dict] | None = None, *,
                     call_id: Callable[[int], str] = _new_call_id) -> tuple[str, list[ToolCall]]:
    """Whole content -> (content without tool blocks, tool calls); same rules as `ToolCallParser`."""
    parser = ToolCallParser(tools, call_id=call_id)
    content, _ = parser.feed(text)
    tail, _ = parser.finish()
    return content + tail, parser.tool_calls
