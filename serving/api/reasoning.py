"""Split DeepSeek-V4.1 output into reasoning (`reasoning_content`) and content.

With thinking on, the prompt ends in `<think>`, so generated text starts inside the reasoning:

    The user wants X. Check Y.</think>The answer is 4.
    '-------- reasoning -------'      '--- content ---'

Rules (vLLM 0.33.0's deepseek_v41 parser, the reference where engines disagree):
- `</think>` ends the reasoning; the marker is dropped. A stray `</think>` in content is dropped.
- `<think>` in content starts reasoning again; a repeated `<think>` inside reasoning is dropped.
- A tool-call block opening inside the reasoning ends it implicitly: from `<｜DSML｜ calls>` on, all text
  (marker included) is content for the tool-call parser, and no later marker is interpreted. A
  block-less `<｜DSML｜ invoke name="` does the same in content (inside reasoning it is reasoning text).
- Only the full spaced marker counts: a bare `<｜DSML｜` is ordinary text.
- Each stretch of reasoning is right-stripped (trailing whitespace before `</think>` is dropped).

`ReasoningParser.feed` never emits part of a marker: a suffix that may begin one is held until the
next delta (or `finish`) settles it, so any split of the text gives the same result as the whole.
"""

from __future__ import annotations

from enum import Enum

from serving.text.encoding import INVOKE_START, THINK_END, THINK_START, TOOL_CALLS_START


class _State(Enum):
    REASONING = "reasoning"
    CONTENT = "content"
    TOOLS = "tools"  # a tool block began: the rest is content, uninterpreted


# (marker, next state, marker kept as content) per state; absent next state = marker dropped in place
_MARKERS: dict[_State, tuple[tuple[str, _State, bool], ...]] = {
    _State.REASONING: ((THINK_END, _State.CONTENT, False), (THINK_START, _State.REASONING, False),
                       (TOOL_CALLS_START, _State.TOOLS, True)),
    _State.CONTENT: ((THINK_START, _State.REASONING, False), (THINK_END, _State.CONTENT, False),
                     (TOOL_CALLS_START, _State.TOOLS, True), (INVOKE_START, _State.TOOLS, True)),
    _State.TOOLS: (),
}


def held_suffix_length(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `markers`."""
    longest = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:n]):
                longest = n
                break
    return longest


class ReasoningParser:
    """Streaming reasoning/content split of one request's generated text."""

    def __init__(self, *, thinking: bool):
        """thinking: the prompt opened the reasoning, i.e. it ends in `<think>` (`encode_messages` with
        thinking on, see `encoding.resolve_thinking`)."""
        self._state = _State.REASONING if thinking else _State.CONTENT
        self._held = ""  # may be the start of a marker
        self._reasoning_ws = ""  # trailing whitespace of the current reasoning stretch

    @property
    def in_reasoning(self) -> bool:
        return self._state is _State.REASONING

    def feed(self, delta: str) -> tuple[str, str]:
        """Next piece of generated text -> (reasoning delta, content delta)."""
        reasoning, content = [], []
        text, self._held = self._held + delta, ""
        while text:
            markers = _MARKERS[self._state]
            found = min(((text.find(m), m, nxt, keep) for m, nxt, keep in markers if m in text),
                        default=None)
            if found is None:
                hold = held_suffix_length(text, tuple(m for m, _, _ in markers))
                self._route(text[:len(text) - hold], reasoning, content)
                self._held = text[len(text) - hold:]
                break
            pos, marker, next_state, keep = found
            self._route(text[:pos], reasoning, content)
            if self._state is _State.REASONING and next_state is not _State.REASONING:
                self._reasoning_ws = ""  # the stretch ends: its trailing whitespace is dropped
            self._state = next_state
            if keep:
                content.append(marker)
            text = text[pos + len(marker):]
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """End of generation: release held text (an unfinished marker is plain text)."""
        reasoning, content = [], []
        self._route(self._held, reasoning, content)
        self._held = self._reasoning_ws = ""
        return "".join(reasoning), "".join(content)

    def _route(self, text: str, reasoning: list[str], content: list[str]) -> None:
        if not text:
            return
        if self._state is not _State.REASONING:
            content.append(text)
            return
        text = self._reasoning_ws + text
        kept = text.rstrip()
        self._reasoning_ws = text[len(kept):]
        if kept:
            reasoning.append(kept)


def parse_reasoning(text: str, *, thinking: bool) -> tuple[str, str]:
    """Whole generated text -> (reasoning_content, content); same rules as `ReasoningParser`."""
    parser = ReasoningParser(thinking=thinking)
    reasoning, content = parser.feed(text)
    tail_reasoning, tail_content = parser.finish()
    return reasoning + tail_reasoning, content + tail_content
