"""V4.1 DSML tool-call parser (serving/api/tool_calls.py), chained after the reasoning parser as the server
runs them: whole-text results against expected calls, and the same results for every streaming split."""

import json

import pytest

from serving.text.encoding import dsml_tool_calls
from serving.api.reasoning import ReasoningParser, parse_reasoning
from serving.api.tool_calls import ToolCall, ToolCallParser, parse_tool_calls, read_invoke
from tests.serving.api.splits import chunkings

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "zip": {"type": "string"},
        "units": {"enum": ["c", "f"]}, "limit": {"type": ["integer", "null"]}}}}},
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {
        "query": {"type": "string"}, "filters": {"type": "object"}}}}},
]
P, PE = "<｜DSML｜ parameter", "</｜DSML｜ parameter>"
OPEN, CLOSE, INV, INVE = "<｜DSML｜ calls>", "</｜DSML｜ calls>", '<｜DSML｜ invoke name="', "</｜DSML｜ invoke>"

WEATHER = dsml_tool_calls([("get_weather", {"city": "Paris", "days": 3})])
TWO_CALLS = dsml_tool_calls([
    ("get_weather", {"city": "東京 😀", "days": 2}),
    ("search", {"query": "a \"quoted\" <b>", "filters": {"lang": ["ja", {"x": None}], "deep": {"k": [1.5, True]}}}),
])


def J(**kw):
    return json.dumps(kw, ensure_ascii=False)


# (name, thinking, tools, text, reasoning, content, [(call name, arguments JSON)])
CASES = [
    ("reasoning_content_no_calls", True, TOOLS, "Easy.</think>It is sunny 😀.", "Easy.", "It is sunny 😀.", []),
    ("one_call_after_content", True, TOOLS, "Need data.</think>Checking.\n\n" + WEATHER, "Need data.",
     "Checking.", [("get_weather", J(city="Paris", days=3))]),
    ("two_calls_nested_json_unicode", True, TOOLS, "Two lookups.\n\n</think>\n\n" + TWO_CALLS, "Two lookups.", "",
     [("get_weather", J(city="東京 😀", days=2)),
      ("search", J(query='a "quoted" <b>', filters={"lang": ["ja", {"x": None}], "deep": {"k": [1.5, True]}}))]),
    ("tool_block_inside_thinking", True, TOOLS, "I must call it\n\n" + WEATHER, "I must call it", "",
     [("get_weather", J(city="Paris", days=3))]),
    ("chat_mode_call", False, TOOLS, WEATHER + "\n", "", "", [("get_weather", J(city="Paris", days=3))]),
    ("chat_mode_plain", False, None, "Plain 漢字 text\nwith < and > and </ signs", "",
     "Plain 漢字 text\nwith < and > and </ signs", []),
    ("bare_dsml_is_text", False, TOOLS, "a <｜DSML｜ b <｜DSML｜", "", "a <｜DSML｜ b <｜DSML｜", []),
    ("unspaced_v4_markup_is_text", False, TOOLS, "<｜DSML｜tool_calls>x</｜DSML｜tool_calls>", "",
     "<｜DSML｜tool_calls>x</｜DSML｜tool_calls>", []),
    ("text_after_block_kept", False, TOOLS, "pre\n\n" + WEATHER + "\n\npost\n", "", "pre\n\npost",
     [("get_weather", J(city="Paris", days=3))]),
    ("blockless_invoke", True, TOOLS,
     f'r</think>{INV}search">\n{P} name="query" string="true">x</｜DSML｜ parameter>\n{INVE}', "r", "",
     [("search", J(query="x"))]),
    ("json_invoke_body", False, TOOLS, f'{OPEN}\n{INV}search">{{"query": "q", "filters": {{}}}}{INVE}\n{CLOSE}',
     "", "", [("search", J(query="q", filters={}))]),
    ("empty_invoke_body", False, TOOLS, f'{OPEN}\n{INV}search">\n\n{INVE}\n{CLOSE}', "", "", [("search", "{}")]),
    ("calls_close_ends_open_invoke", False, TOOLS,
     f'{OPEN}\n{INV}search">\n{P} name="query" string="true">q{PE}\n{CLOSE}', "", "", [("search", J(query="q"))]),
    ("schema_typing", False, TOOLS,
     (f'{OPEN}\n{INV}get_weather">\n{P} name="days" string="true">5{PE}\n{P} name="zip">007{PE}\n'
      f'{P} name="units">f{PE}\n{P} name="limit">null{PE}\n{P} name="city" string="false">123{PE}\n'
      f'{P} name="extra" string="false">[1, 2]{PE}\n{P} name="raw" string="false">not json{PE}\n{INVE}\n{CLOSE}'),
     "", "", [("get_weather", J(days=5, zip="007", units="f", limit=None, city="123", extra=[1, 2], raw="not json"))]),
    ("wrapper_unwrapped", False, TOOLS,
     f'{OPEN}\n{INV}get_weather">\n{P} name="arguments" string="false">{{"city": "Rome"}}{PE}\n{INVE}\n{CLOSE}',
     "", "", [("get_weather", J(city="Rome"))]),
    ("no_schema_values", False, None,
     (f'{OPEN}\n{INV}anything">\n{P} name="n" string="false">1e3{PE}\n{P} name="s" string="true">1e3{PE}\n'
      f'{P} name="m">{{"a": 1}}{PE}\n{INVE}\n{CLOSE}'), "", "", [("anything", J(n=1000.0, s="1e3", m={"a": 1}))]),
    ("missing_parameter_close", False, TOOLS,
     (f'{OPEN}\n{INV}search">\n{P} name="query" string="true">q\n{P} name="filters" string="false">{{}}{PE}\n'
      f'{INVE}\n{CLOSE}'), "", "", [("search", J(query="q\n", filters={}))]),
    ("malformed_block_is_content", True, TOOLS, f"r</think>Try:\n\n{OPEN}\ngarbage here\n{CLOSE} end", "r",
     f"Try:\n\n{OPEN}\ngarbage here\n{CLOSE} end", []),
    ("bad_invoke_name_is_content", False, TOOLS, f'x {OPEN}\n{INV}bad name>\n{INVE}\n{CLOSE}', "",
     f'x {OPEN}\n{INV}bad name>\n{INVE}\n{CLOSE}', []),
    ("unreadable_json_body_is_content", False, TOOLS, f'{OPEN}\n{INV}search">[1, 2]{INVE}\n{CLOSE}', "",
     f'{OPEN}\n{INV}search">[1, 2]{INVE}\n{CLOSE}', []),
    ("good_and_bad_invokes", False, TOOLS,
     (f'{OPEN}\n{INV}search">\n{P} name="query" string="true">ok{PE}\n{INVE}\nstray words\n'
      f'{INV}">\n{INVE}\n{CLOSE}'), "", f'stray words\n{INV}">\n{INVE}', [("search", J(query="ok"))]),
    ("cut_off_invoke_is_content", True, TOOLS,
     f'plan</think>Calling.\n\n{OPEN}\n{INV}get_weather">\n{P} name="city" string="true">Par', "plan",
     f'Calling.\n\n{OPEN}\n{INV}get_weather">\n{P} name="city" string="true">Par', []),
    ("cut_off_after_a_call", False, TOOLS, WEATHER[: -len(CLOSE)] + f'{INV}search">\n{P} name="q',
     "", f'{INV}search">\n{P} name="q', [("get_weather", J(city="Paris", days=3))]),
    ("cut_off_marker_prefix", False, TOOLS, "answer <｜DSML｜ ca", "", "answer <｜DSML｜ ca", []),
    ("whitespace_only_content_dropped_with_calls", True, TOOLS, "r</think>\n\n" + WEATHER + "\n \n", "r", "",
     [("get_weather", J(city="Paris", days=3))]),
    ("two_blocks", False, TOOLS, WEATHER + "\n\n" + dsml_tool_calls([("search", {"query": "b"})]), "", "",
     [("get_weather", J(city="Paris", days=3)), ("search", J(query="b"))]),
]


def _ids(i):
    return f"call_{i}"


def _whole(thinking, tools, text):
    reasoning, content = parse_reasoning(text, thinking=thinking)
    content, calls = parse_tool_calls(content, tools, call_id=_ids)
    return reasoning, content, calls


def _streamed(thinking, tools, deltas):
    rp, tp = ReasoningParser(thinking=thinking), ToolCallParser(tools, call_id=_ids)
    reasoning, content, streamed = [], [], []

    def to_tools(piece):
        c, d = tp.feed(piece)
        content.append(c)
        streamed.extend(d)

    for delta in deltas:
        r, c = rp.feed(delta)
        reasoning.append(r)
        to_tools(c)
    r, c = rp.finish()
    reasoning.append(r)
    to_tools(c)
    c, d = tp.finish()
    content.append(c)
    streamed.extend(d)
    assert [d.index for d in streamed] == list(range(len(streamed)))  # each call sent once, in order
    assert [d.call for d in streamed] == tp.tool_calls
    return "".join(reasoning), "".join(content), tp.tool_calls


def _expected_calls(calls):
    return [ToolCall(f"call_{i}", name, args) for i, (name, args) in enumerate(calls)]


@pytest.mark.parametrize("name, thinking, tools, text, reasoning, content, calls", CASES, ids=[c[0] for c in CASES])
def test_whole_text(name, thinking, tools, text, reasoning, content, calls):
    assert _whole(thinking, tools, text) == (reasoning, content, _expected_calls(calls))


@pytest.mark.parametrize("name, thinking, tools, text, reasoning, content, calls", CASES, ids=[c[0] for c in CASES])
def test_every_split_agrees(name, thinking, tools, text, reasoning, content, calls):
    expected = (reasoning, content, _expected_calls(calls))
    for deltas in chunkings(text):
        assert _streamed(thinking, tools, deltas) == expected, deltas


def test_call_is_emitted_when_its_invoke_closes():
    parser = ToolCallParser(TOOLS, call_id=_ids)
    cut = TWO_CALLS.index("</｜DSML｜ invoke>") + len("</｜DSML｜ invoke>")
    content, deltas = parser.feed(TWO_CALLS[:cut - 1])
    assert (content, deltas) == ("", [])
    content, deltas = parser.feed(TWO_CALLS[cut - 1:cut])
    assert content == "" and [d.to_openai() for d in deltas] == [{
        "index": 0, "id": "call_0", "type": "function",
        "function": {"name": "get_weather", "arguments": J(city="東京 😀", days=2)}}]


def test_default_ids_are_unique():
    _, calls = parse_tool_calls(TWO_CALLS)
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("chatcmpl-tool-") for c in calls)


@pytest.mark.parametrize("arguments", [
    {}, {"s": "plain"}, {"n": 3, "f": -0.5, "b": False, "z": None}, {"nested": {"a": [1, {"b": "漢😀"}]}},
    {"multiline": "line1\nline2\n", "quote": 'say "hi" <tag>'}, {"list": ["x", 1, [2]]},
])
def test_round_trip_through_the_encoder(arguments):
    """What the encoder renders for an assistant tool call parses back to the same arguments."""
    text = "Sure.\n\n" + dsml_tool_calls([("f", arguments), ("g", json.dumps(arguments))])
    content, calls = parse_tool_calls(text)
    assert content == "Sure."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", arguments), ("g", arguments)]


def test_read_invoke_rejects_unreadable():
    assert read_invoke('f">not json', {}) is None
    assert read_invoke('">{}', {}) is None
    assert read_invoke('f', {}) is None
    assert read_invoke('f">{"a": 1}', {}) == ("f", {"a": 1})


@pytest.mark.parametrize("case", [c for c in CASES if c[0] in (
    "two_calls_nested_json_unicode", "reasoning_content_no_calls", "cut_off_invoke_is_content",
    "good_and_bad_invokes")], ids=lambda c: c[0])
def test_token_stream_through_detokenizer(case):
    """Generated ids -> detokenizer (one token per step) -> reasoning parser -> tool-call parser."""
    from serving.text.detokenizer import IncrementalDetokenizer
    from serving.text.tokenizer import byte_level_tokenizer

    name, thinking, tools, text, reasoning, content, calls = case
    tok = byte_level_tokenizer()
    ids = tok.encode(text) + [tok.eos_id]
    det = IncrementalDetokenizer(tok, skip_special=True)
    pieces = [det.push([i]) for i in ids] + [det.flush()]
    assert _streamed(thinking, tools, pieces) == (reasoning, content, _expected_calls(calls))
