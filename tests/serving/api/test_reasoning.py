"""Reasoning / content split (serving/api/reasoning.py): whole-text results and every streaming split."""

import pytest

from serving.api.reasoning import ReasoningParser, parse_reasoning
from tests.serving.api.splits import chunkings

CALLS = '<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\n</｜DSML｜ invoke>\n</｜DSML｜ calls>'

# (name, thinking, text, expected reasoning, expected content)
CASES = [
    ("reasoning_then_content", True, "Compute 2+2.\nIt is 4.\n</think>The answer is 4.",
     "Compute 2+2.\nIt is 4.", "The answer is 4."),
    ("chat_mode", False, "Just an answer 😀 漢字", "", "Just an answer 😀 漢字"),
    ("chat_mode_think_block", False, "<think>hmm</think>ok", "hmm", "ok"),
    ("unfinished_reasoning", True, "still thinking <thi", "still thinking <thi", ""),
    ("unfinished_reasoning_trailing_ws", True, "still thinking \n\n", "still thinking", ""),
    ("stray_and_duplicate_markers", True, "a<think>b</think>c</think>d", "ab", "cd"),
    ("reasoning_again_after_content", True, "r1 </think>c1<think>r2</think>c2", "r1r2", "c1c2"),
    ("tool_block_ends_reasoning", True, "I need f.\n\n" + CALLS, "I need f.", CALLS),
    ("markers_after_tool_block_are_content", True, "r</think>" + CALLS + "<think>x</think>",
     "r", CALLS + "<think>x</think>"),
    ("bare_dsml_is_text", True, "see <｜DSML｜ here</think>and <｜DSML｜ there", "see <｜DSML｜ here",
     "and <｜DSML｜ there"),
    ("invoke_inside_reasoning_is_reasoning", True,
     'plan: <｜DSML｜ invoke name="f"> later</think>done', 'plan: <｜DSML｜ invoke name="f"> later', "done"),
    ("blockless_invoke_in_content", True, 'r</think><｜DSML｜ invoke name="f">x</｜DSML｜ invoke><think>',
     "r", '<｜DSML｜ invoke name="f">x</｜DSML｜ invoke><think>'),
    ("content_whitespace_kept", True, "r</think>\n\nanswer  ", "r", "\n\nanswer  "),
    ("empty", True, "", "", ""),
    ("lonely_lt", False, "a < b and c <", "", "a < b and c <"),
]


@pytest.mark.parametrize("name, thinking, text, reasoning, content", CASES, ids=[c[0] for c in CASES])
def test_whole_text(name, thinking, text, reasoning, content):
    assert parse_reasoning(text, thinking=thinking) == (reasoning, content)


@pytest.mark.parametrize("name, thinking, text, reasoning, content", CASES, ids=[c[0] for c in CASES])
def test_every_split_agrees(name, thinking, text, reasoning, content):
    for deltas in chunkings(text):
        parser = ReasoningParser(thinking=thinking)
        outs = [parser.feed(d) for d in deltas] + [parser.finish()]
        assert ("".join(r for r, _ in outs), "".join(c for _, c in outs)) == (reasoning, content), deltas


def test_partial_marker_is_held_then_released():
    parser = ReasoningParser(thinking=True)
    assert parser.feed("abc </th") == ("abc", "")  # " </th" may be the end marker
    assert parser.in_reasoning
    assert parser.feed("ink>x") == ("", "x")
    assert not parser.in_reasoning
    parser = ReasoningParser(thinking=True)
    assert parser.feed("abc </th") == ("abc", "")
    assert parser.feed("ought") == (" </thought", "")  # not a marker after all


def test_streaming_emits_reasoning_before_the_end():
    parser = ReasoningParser(thinking=True)
    assert parser.feed("step one") == ("step one", "")
    assert parser.feed(" and two") == (" and two", "")
