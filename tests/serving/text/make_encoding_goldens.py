"""Regenerate `encoding_goldens.json`: the V4.1 prompt of each case as DeepSeek's reference encoder writes it.

The reference is vLLM 0.33.0's pure-Python `vllm/tokenizers/deepseek_v41_encoding.py` (imports only the
standard library), loaded by file path; vLLM itself is not installed or imported. The serving controls
that vLLM applies around it are done here by this script's own glue, with the V4.1 recipe's effort
scale (low/high/xhigh/max = 25/50/75/100, thinking on at 50 when unset), so efforts reach the
reference encoder as integers.

    python tests/serving/text/make_encoding_goldens.py VLLM_ROOT/vllm/tokenizers/deepseek_v41_encoding.py
"""

from __future__ import annotations

import copy
import importlib.util
import json
import sys
from pathlib import Path

RECIPE_EFFORTS = {"low": 25, "high": 50, "xhigh": 75, "max": 100}

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City name"},
        "days": {"type": "integer"}}, "required": ["city"]}}}
SEARCH_TOOL = {"type": "function", "function": {
    "name": "search", "description": "Search the web — returns JSON",
    "parameters": {"type": "object", "properties": {
        "query": {"type": "string"}, "filters": {"type": "object"}, "top_k": {"type": "integer"}}}}}

TOOL_TURN = [
    {"role": "system", "content": "You are a helpful agent."},
    {"role": "user", "content": "Weather in Paris and news about 東京?"},
    {"role": "assistant", "content": "Let me check.", "reasoning_content": "Two lookups needed.",
     "tool_calls": [
         {"id": "call_a", "type": "function",
          "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"days\": 2}"}},
         {"id": "call_b", "type": "function",
          "function": {"name": "search", "arguments": json.dumps(
              {"query": "東京 news 🗼", "filters": {"lang": ["ja", "en"], "recent": True}, "top_k": 3})}}]},
    # results arrive out of call order: the encoder sorts them back
    {"role": "tool", "tool_call_id": "call_b", "content": "[{\"title\": \"東京タワー\"}]"},
    {"role": "tool", "tool_call_id": "call_a", "content": "{\"temp_c\": 21}"},
]

CASES: list[dict] = [
    {"name": "user_default", "messages": [{"role": "user", "content": "Hello"}]},
    {"name": "user_thinking_off", "thinking": False, "messages": [{"role": "user", "content": "Hello"}]},
    *[{"name": f"system_user_effort_{e}", "reasoning_effort": e,
       "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]}
      for e in ("low", "high", "xhigh", "max", 1, 100, "none")],
    {"name": "thinking_true_effort_max", "thinking": True, "reasoning_effort": "max",
     "messages": [{"role": "user", "content": "Prove it."}]},
    {"name": "multi_turn_thinking", "messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet back."},
        {"role": "user", "content": "Name a prime."},
        {"role": "assistant", "content": "7", "reasoning_content": "Small prime."},
        {"role": "user", "content": "Another?"}]},
    {"name": "multi_turn_chat", "thinking": False, "messages": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"}]},
    {"name": "multi_turn_keep_thinking", "drop_thinking": False, "messages": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet back."},
        {"role": "user", "content": "Bye"}]},
    {"name": "tools_first_turn", "tools": [WEATHER_TOOL, SEARCH_TOOL], "messages": [
        {"role": "system", "content": "You are a helpful agent."},
        {"role": "user", "content": "Weather in Paris?"}]},
    {"name": "tools_without_system", "tools": [WEATHER_TOOL], "reasoning_effort": "low",
     "messages": [{"role": "user", "content": "Weather in Paris?"}]},
    {"name": "tools_chat_mode", "tools": [WEATHER_TOOL], "thinking": False,
     "messages": [{"role": "user", "content": "Weather in Paris?"}]},
    {"name": "tool_calls_and_results", "tools": [WEATHER_TOOL, SEARCH_TOOL], "messages": TOOL_TURN},
    {"name": "tool_results_then_user_text", "tools": [WEATHER_TOOL, SEARCH_TOOL],
     "messages": [*TOOL_TURN, {"role": "user", "content": "Summarize."}]},
    {"name": "agent_second_round", "tools": [WEATHER_TOOL, SEARCH_TOOL], "reasoning_effort": "xhigh",
     "messages": [*TOOL_TURN,
                  {"role": "assistant", "content": "Paris: 21°C. 東京: tower news.",
                   "reasoning_content": "Compose answer."},
                  {"role": "user", "content": "Thanks, and Berlin?"}]},
    {"name": "tool_call_argument_forms", "tools": [WEATHER_TOOL], "thinking": False, "messages": [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}},
            {"id": "2", "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps(json.dumps({"city": "Oslo"}))}},
            {"id": "3", "type": "function", "function": {"name": "get_weather", "arguments": "[1, 2]"}},
            {"id": "4", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "2", "content": "snow"},
        {"role": "tool", "tool_call_id": "3", "content": "?"},
        {"role": "tool", "tool_call_id": "4", "content": ""}]},
    {"name": "developer_message", "messages": [
        {"role": "developer", "content": "Answer in French."},
        {"role": "user", "content": "Hello"}]},
    {"name": "mid_conversation_system", "messages": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "r"},
        {"role": "system", "content": "Switch to English only."}]},
    {"name": "content_parts", "messages": [
        {"role": "system", "content": [{"type": "text", "text": "Part A."}, {"type": "text", "text": "Part B."}]},
        {"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "input_text", "text": "y"}]}]},
    {"name": "consecutive_users", "thinking": False, "messages": [
        {"role": "user", "content": "first"}, {"role": "user", "content": "second"}]},
    {"name": "assistant_last", "messages": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet."}]},
    {"name": "unicode_and_markup_text", "messages": [
        {"role": "user", "content": "emoji 😀 CJK 漢字 and a literal <think> tag\n\nnew paragraph"}]},
]


def _load_reference(path: str):
    spec = importlib.util.spec_from_file_location("reference_v41_encoding", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _flatten(content):
    if isinstance(content, list):
        return "\n\n".join(part["text"] for part in content)
    return content


def reference_prompt(encoder, case: dict) -> str:
    messages = [{**m, "content": _flatten(m.get("content"))} for m in copy.deepcopy(case["messages"])]
    tools = case.get("tools")
    if tools:
        system = next((m for m in messages if m["role"] == "system"), None)
        if system is None:
            system = {"role": "system", "content": ""}
            messages.insert(0, system)
        system["tools"] = tools
    thinking, effort = case.get("thinking"), case.get("reasoning_effort")
    if effort == "none":
        thinking, effort = False, None
    thinking = True if thinking is None else thinking
    effort = RECIPE_EFFORTS.get(effort, effort) if effort is not None else 50
    return encoder.encode_messages(messages, thinking_mode="thinking" if thinking else "chat",
                                   drop_thinking=case.get("drop_thinking", True), reasoning_effort=effort)


def main(reference_path: str) -> None:
    encoder = _load_reference(reference_path)
    goldens = [{**case, "expected": reference_prompt(encoder, case)} for case in CASES]
    out = Path(__file__).with_name("encoding_goldens.json")
    out.write_text(json.dumps(goldens, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {len(goldens)} cases to {out}")


if __name__ == "__main__":
    main(sys.argv[1])
