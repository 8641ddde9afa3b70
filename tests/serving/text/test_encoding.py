"""V4.1 prompt encoding (serving/text/encoding.py) against goldens from DeepSeek's reference encoder.

`encoding_goldens.json` was written by `make_encoding_goldens.py`, which runs vLLM 0.33.0's pure-Python
`deepseek_v41_encoding.py` standalone (loaded by file path, vLLM not installed) on each case.
"""

import json
from pathlib import Path

import pytest

from serving.text.encoding import (ASSISTANT, BOS, THINK_END, THINK_START, encode_messages,
                                  encode_messages_to_ids, resolve_thinking)
from serving.text.tokenizer import byte_level_tokenizer

GOLDENS = json.loads(Path(__file__).with_name("encoding_goldens.json").read_text(encoding="utf-8"))
OPTIONS = ("tools", "thinking", "reasoning_effort", "drop_thinking")


def _options(case):
    return {k: case[k] for k in OPTIONS if k in case}


@pytest.mark.parametrize("case", GOLDENS, ids=[c["name"] for c in GOLDENS])
def test_matches_reference_encoder(case):
    assert encode_messages(case["messages"], **_options(case)) == case["expected"]


def test_goldens_cover_the_feature_list():
    names = {c["name"] for c in GOLDENS}
    for effort in ("low", "high", "xhigh", "max", "1", "100", "none"):
        assert f"system_user_effort_{effort}" in names
    expected = "".join(c["expected"] for c in GOLDENS)
    for piece in ("## Tools", "<｜DSML｜ invoke", "<tool_result>", "<｜Assistant｜></think>",
                  "<｜Assistant｜><think>", "Reasoning Effort: 25 ", "Reasoning Effort: 100 "):
        assert piece in expected


@pytest.mark.parametrize("case", [c for c in GOLDENS if c["messages"][-1]["role"] != "assistant"],
                         ids=lambda c: c["name"])
def test_without_generation_prompt(case):
    with_prompt = encode_messages(case["messages"], **_options(case))
    without = encode_messages(case["messages"], add_generation_prompt=False, **_options(case))
    header = next(h for h in (ASSISTANT + THINK_START, ASSISTANT + THINK_END) if with_prompt.endswith(h))
    assert without == with_prompt[: -len(header)]


@pytest.mark.parametrize("thinking, effort, expected", [
    (None, None, (True, 50)), (True, None, (True, 50)), (False, None, (False, 50)),
    (None, "low", (True, 25)), (None, "high", (True, 50)), (None, "xhigh", (True, 75)), (None, "max", (True, 100)),
    (None, 1, (True, 1)), (None, 100, (True, 100)), (None, "none", (False, 50)), (False, "max", (False, 100)),
])
def test_resolve_thinking(thinking, effort, expected):
    assert resolve_thinking(thinking, effort) == expected


def test_effort_only_rendered_when_thinking():
    msgs = [{"role": "user", "content": "q"}]
    assert "Reasoning Effort: 75 " in encode_messages(msgs, reasoning_effort="xhigh")
    assert "Reasoning Effort" not in encode_messages(msgs, thinking=False, reasoning_effort="xhigh")


def test_ids_have_one_bos_and_single_role_tokens():
    tok = byte_level_tokenizer()
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
            {"role": "assistant", "content": "a"}, {"role": "user", "content": "v"}]
    ids = encode_messages_to_ids(tok, msgs)
    assert ids == tok.encode(encode_messages(msgs))
    assert ids[0] == tok.bos_id and ids.count(tok.bos_id) == 1
    assert ids.count(tok.token_id("<｜User｜>")) == 2 and ids.count(tok.token_id("<｜Assistant｜>")) == 2
    assert ids.count(tok.eos_id) == 1 and ids[-1] == tok.token_id("<think>")
    assert tok.decode(ids) == encode_messages(msgs) and encode_messages(msgs).startswith(BOS)


USER = {"role": "user", "content": "hi"}


@pytest.mark.parametrize("messages, options, message", [
    ([], {}, "messages: must be a non-empty list"),
    ("hello", {}, "messages: must be a non-empty list"),
    ([USER, {"role": "assistant", "content": "x"}, {"role": "bot", "content": "x"}], {},
     "messages[2].role: unknown role 'bot'"),
    (["hi"], {}, "messages[0]: must be an object"),
    ([{"role": "user", "content": 5}], {}, "messages[0].content: must be a string or a list"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], {},
     "messages[0].content[0].type: only text parts are supported"),
    ([{"role": "user", "content": [{"type": "text"}]}], {}, "messages[0].content[0].text: must be a string"),
    ([{"role": "developer", "content": ""}, USER], {}, "messages[0].content: a developer message must have content"),
    ([USER, {"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}], {},
     "messages[1].tool_calls[0].function.name: must be a non-empty string"),
    ([USER, {"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}], {},
     "messages[1].tool_calls[0].function.arguments: missing"),
    ([USER, {"role": "assistant", "tool_calls": [{"type": "function"}]}], {},
     "messages[1].tool_calls[0].function: must be an object"),
    ([USER, {"role": "assistant", "content": "x", "reasoning_content": 3}], {},
     "messages[1].reasoning_content: must be a string"),
    ([USER], {"reasoning_effort": "huge"},
     "reasoning_effort: must be low/high/xhigh/max (or none) or an integer 1-100, got 'huge'"),
    ([USER], {"reasoning_effort": 0}, "reasoning_effort: must be"),
    ([USER], {"reasoning_effort": 101}, "reasoning_effort: must be"),
    ([USER], {"reasoning_effort": True}, "reasoning_effort: must be"),
    ([USER], {"reasoning_effort": "medium"}, "got 'medium'"),
    ([USER], {"thinking": "yes"}, "thinking: must be true or false, got 'yes'"),
    ([USER], {"tools": {"type": "function"}}, "tools: must be a list"),
    ([USER], {"tools": [{"type": "function", "function": {"description": "d"}}]},
     "tools[0].function.name: must be a non-empty string"),
    ([USER], {"tools": [{"type": "retrieval"}]}, "tools[0].type: only 'function' tools are supported"),
    ([USER], {"tools": ["f"]}, "tools[0]: must be an object"),
])
def test_errors_name_the_field(messages, options, message):
    with pytest.raises(ValueError) as info:
        encode_messages(messages, **options)
    assert message in str(info.value)
