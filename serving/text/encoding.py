"""The DeepSeek-V4.1 prompt encoding, in code (no chat template): OpenAI-style messages -> prompt text.

A thinking-mode conversation with a tool call and its result renders as (one piece per line here):

    <｜begin▁of▁sentence｜>                                   BOS, once
    <｜System｜>Reasoning Effort: 50 (range 1-100, ...)\n\n     thinking mode only, before message 0
    You are helpful.\n\n## Tools\n\nYou have access to ...     system prompt + tool definitions block
    <｜User｜>Weather in Paris?
    <｜Assistant｜><think>Use the tool.</think>                  reasoning kept (tools present)
    \n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">\n
    <｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n
    </｜DSML｜ invoke>\n</｜DSML｜ calls><｜end▁of▁sentence｜>      the previous call, rendered back in DSML
    <｜User｜><tool_result>21C</tool_result>                     tool messages become user turns
    <｜Assistant｜><think>                                      generation prompt: the model starts thinking

Without tools, the reasoning of turns before the last user message is dropped and those turns open
with `</think>`: `<｜User｜>Hi<｜Assistant｜></think>Hello!<｜end▁of▁sentence｜><｜User｜>Bye<｜Assistant｜><think>`.
Chat mode (thinking off) has no effort line and every assistant turn opens with `</think>`.

Rules follow DeepSeek's reference encoder as shipped in vLLM 0.33.0 (`deepseek_v41_encoding.py`);
output matches it byte for byte on the tested cases. Serving controls follow the V4.1 recipe: thinking
is ON at effort 50 when neither `thinking` nor `reasoning_effort` is given, and the named efforts are
low/high/xhigh/max = 25/50/75/100 (vLLM 0.33.0 maps them to 50/75/75/100 and defaults to 75).
Image parts are rejected: the served model is text only.
"""

from __future__ import annotations

import json
from typing import Any

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
SYSTEM = "<｜System｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"

TOOL_CALLS_START = f"<{DSML} calls>"
TOOL_CALLS_END = f"</{DSML} calls>"
INVOKE_START = f'<{DSML} invoke name="'
INVOKE_END = f"</{DSML} invoke>"
PARAMETER_START = f"<{DSML} parameter"
PARAMETER_END = f"</{DSML} parameter>"

EFFORT_LEVELS = {"low": 25, "high": 50, "xhigh": 75, "max": 100}
DEFAULT_EFFORT = 50
EFFORT_PROMPT = ("Reasoning Effort: {effort} "
                 "(range 1-100, the higher the value, the more thorough the reasoning)\n\n")

TOOLS_PROMPT = f"""## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "{TOOL_CALLS_START}" block like the following:

{TOOL_CALLS_START}
{INVOKE_START}$TOOL_NAME">
{PARAMETER_START} name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE{PARAMETER_END}
...
{INVOKE_END}
{INVOKE_START}$TOOL_NAME2">
...
{INVOKE_END}
{TOOL_CALLS_END}

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {THINK_START}), you MUST output your complete reasoning inside {THINK_START}...{THINK_END} BEFORE any tool calls or final response.

Otherwise, output directly after {THINK_END} with tool calls or final response.

### Available Tool Schemas

{{tool_schemas}}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""

_ROLES = ("system", "developer", "user", "assistant", "tool")
_TEXT_PART_TYPES = ("text", "input_text", "output_text")


def _to_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


# ============================================================================ serving controls
def resolve_thinking(thinking: bool | None, reasoning_effort: str | int | None) -> tuple[bool, int]:
    """(thinking on?, effort 1-100) from the request's controls; ValueError names the bad field.

    Neither given -> thinking at effort 50. `reasoning_effort="none"` turns thinking off.
    """
    if thinking is not None and not isinstance(thinking, bool):
        raise ValueError(f"thinking: must be true or false, got {thinking!r}")
    if reasoning_effort == "none":
        return False, DEFAULT_EFFORT
    if reasoning_effort is None:
        effort = DEFAULT_EFFORT
    elif type(reasoning_effort) is int and 1 <= reasoning_effort <= 100:
        effort = reasoning_effort
    elif isinstance(reasoning_effort, str) and reasoning_effort in EFFORT_LEVELS:
        effort = EFFORT_LEVELS[reasoning_effort]
    else:
        raise ValueError("reasoning_effort: must be low/high/xhigh/max (or none) or an integer 1-100, "
                         f"got {reasoning_effort!r}")
    return (True if thinking is None else thinking), effort


# ============================================================================ input checks
def _text_of(content: Any, path: str) -> str:
    """A message's content as text: str, None (-> ""), or a list of text parts joined by a blank line."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{path}: must be a string or a list of content parts, got {type(content).__name__}")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise ValueError(f"{path}[{j}]: must be an object with a 'type', got {type(part).__name__}")
        kind = part.get("type")
        if kind not in _TEXT_PART_TYPES:
            raise ValueError(f"{path}[{j}].type: only text parts are supported (text-only model), got {kind!r}")
        text = part.get("text")
        if not isinstance(text, str):
            raise ValueError(f"{path}[{j}].text: must be a string")
        texts.append(text)
    return "\n\n".join(texts)


def _tool_call_of(call: Any, path: str) -> tuple[str, Any, str]:
    """(name, arguments as given, id) of one OpenAI assistant tool call."""
    if not isinstance(call, dict):
        raise ValueError(f"{path}: must be an object")
    function = call.get("function")
    if not isinstance(function, dict):
        raise ValueError(f"{path}.function: must be an object with 'name' and 'arguments'")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{path}.function.name: must be a non-empty string")
    if "arguments" not in function:
        raise ValueError(f"{path}.function.arguments: missing")
    call_id = call.get("id") or function.get("id") or ""
    return name, function["arguments"], call_id if isinstance(call_id, str) else ""


def _check_tools(tools: Any) -> list[dict]:
    """The `function` objects of OpenAI tools, in order (rendered as JSON lines, keys as given)."""
    if not isinstance(tools, list):
        raise ValueError(f"tools: must be a list, got {type(tools).__name__}")
    functions = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise ValueError(f"tools[{i}]: must be an object")
        if tool.get("type", "function") != "function":
            raise ValueError(f"tools[{i}].type: only 'function' tools are supported, got {tool.get('type')!r}")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise ValueError(f"tools[{i}].function: must be an object")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise ValueError(f"tools[{i}].function.name: must be a non-empty string")
        functions.append(function)
    return functions


def _normalize(messages: Any) -> list[dict]:
    """Validated messages as {role, content: str, reasoning, tool_calls: [(name, args, id)], tool_call_id}."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages: must be a non-empty list")
    result = []
    for i, msg in enumerate(messages):
        path = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise ValueError(f"{path}: must be an object with a 'role'")
        role = msg.get("role")
        if role not in _ROLES:
            raise ValueError(f"{path}.role: unknown role {role!r} (expected one of {', '.join(_ROLES)})")
        out = {"role": role, "content": _text_of(msg.get("content"), f"{path}.content")}
        if role == "developer" and not out["content"]:
            raise ValueError(f"{path}.content: a developer message must have content")
        if role == "assistant":
            reasoning = msg.get("reasoning_content", msg.get("reasoning"))
            if reasoning is not None and not isinstance(reasoning, str):
                raise ValueError(f"{path}.reasoning_content: must be a string")
            calls = msg.get("tool_calls") or []
            if not isinstance(calls, list):
                raise ValueError(f"{path}.tool_calls: must be a list")
            out["reasoning"] = reasoning
            out["tool_calls"] = [_tool_call_of(c, f"{path}.tool_calls[{j}]") for j, c in enumerate(calls)]
        if role == "tool":
            call_id = msg.get("tool_call_id", "")
            out["tool_call_id"] = call_id if isinstance(call_id, str) else ""
        result.append(out)
    return result


# ============================================================================ conversation shaping
def _merge_tool_results(messages: list[dict]) -> list[dict]:
    """V4.1 has no tool role: tool results and consecutive user messages merge into one user turn.

    A user turn carries `blocks`: ("text", text) or ("tool_result", text, tool_call_id).
    """
    merged: list[dict] = []
    for msg in messages:
        role = msg["role"]
        if role in ("user", "tool"):
            block = (("text", msg["content"]) if role == "user"
                     else ("tool_result", msg["content"], msg["tool_call_id"]))
            if merged and merged[-1]["role"] == "user":
                merged[-1]["blocks"].append(block)
            else:
                merged.append({"role": "user", "blocks": [block]})
        else:
            merged.append(dict(msg))
    return merged


def _sort_tool_results(turns: list[dict]) -> None:
    """Tool results of a user turn in the order of the calls of the latest assistant turn (in place)."""
    call_order: dict[str, int] = {}
    for turn in turns:
        if turn["role"] == "assistant" and turn["tool_calls"]:
            call_order = {call_id: j for j, (_, _, call_id) in enumerate(turn["tool_calls"]) if call_id}
        elif turn["role"] == "user" and call_order:
            results = [b for b in turn["blocks"] if b[0] == "tool_result"]
            if len(results) > 1:
                ordered = iter(sorted(results, key=lambda b: call_order.get(b[2], 0)))
                turn["blocks"] = [next(ordered) if b[0] == "tool_result" else b for b in turn["blocks"]]


def _last_user_index(turns: list[dict]) -> int:
    """Index of the last turn that starts a user request (user with text, developer, mid system), or -1."""
    for i in range(len(turns) - 1, -1, -1):
        role = turns[i]["role"]
        if role == "user" and any(b[0] == "text" for b in turns[i]["blocks"]):
            return i
        if role == "developer" or (role == "system" and i > 0):
            return i
    return -1


def _drop_old_thinking(turns: list[dict]) -> list[dict]:
    """Before the last user request: assistant reasoning is dropped, developer turns are dropped."""
    last_user = _last_user_index(turns)
    kept = []
    for i, turn in enumerate(turns):
        if i >= last_user or turn["role"] in ("user", "system"):
            kept.append(turn)
        elif turn["role"] == "assistant":
            kept.append({**turn, "reasoning": None})
    return kept


# ============================================================================ rendering
def dsml_arguments(arguments: Any) -> str:
    """Tool-call arguments as DSML parameter lines: strings as is (`string="true"`), others as JSON.

    Arguments may be a dict or its JSON text (double-encoded JSON is tolerated); anything that is not
    an object renders as one parameter named "arguments".
    """
    value = arguments
    for _ in range(2):
        if not isinstance(value, str):
            break
        try:
            value = json.loads(value)
        except ValueError:
            break
    if not isinstance(value, dict):
        value = {"arguments": arguments}
    return "\n".join(
        f'{PARAMETER_START} name="{key}" string="{"true" if isinstance(v, str) else "false"}">'
        f"{v if isinstance(v, str) else _to_json(v)}{PARAMETER_END}"
        for key, v in value.items())


def dsml_tool_calls(calls: list[tuple[str, Any]]) -> str:
    """A `<｜DSML｜ calls>` block for [(name, arguments)], as the model writes it."""
    invokes = [f'{INVOKE_START}{name}">\n{dsml_arguments(args)}\n{INVOKE_END}' for name, args in calls]
    return f"{TOOL_CALLS_START}\n" + "\n".join(invokes) + f"\n{TOOL_CALLS_END}"


def _render_tools(functions: list[dict]) -> str:
    return TOOLS_PROMPT.replace("{tool_schemas}", "\n".join(_to_json(f) for f in functions))


def _render_turn(i: int, turns: list[dict], *, thinking: bool, drop_thinking: bool, effort: int,
                 add_generation_prompt: bool) -> str:
    turn, role = turns[i], turns[i]["role"]
    last_user = _last_user_index(turns)
    effort_prompt = EFFORT_PROMPT.format(effort=effort) if i == 0 and thinking else ""
    text = SYSTEM if i == 0 and (effort_prompt or role == "system") else ""
    text += effort_prompt

    if role in ("system", "developer"):
        if role == "developer":
            text += USER
        elif i > 0:
            text += SYSTEM  # a mid-conversation system message
        text += turn["content"]
        if turn.get("tools"):
            text += "\n\n" + _render_tools(turn["tools"])
    elif role == "user":
        parts = [b[1] if b[0] == "text" else f"<tool_result>{b[1]}</tool_result>" for b in turn["blocks"]]
        text += USER + "\n\n".join(parts)
    else:  # assistant
        reasoning = ""
        if thinking and (not drop_thinking or i > last_user):
            reasoning = (turn["reasoning"] or "") + THINK_END
        calls = ("\n\n" + dsml_tool_calls([(name, args) for name, args, _ in turn["tool_calls"]])
                 if turn["tool_calls"] else "")
        text += reasoning + turn["content"] + calls + EOS

    is_last = i + 1 == len(turns)
    if not is_last and turns[i + 1]["role"] != "assistant":
        return text
    if is_last and not add_generation_prompt:
        return text
    if role in ("user", "developer") or (role == "system" and i > 0):
        opens_thinking = thinking and (not drop_thinking or i >= last_user)
        text += ASSISTANT + (THINK_START if opens_thinking else THINK_END)
    return text


def encode_messages(messages: list[dict], *, tools: list[dict] | None = None, thinking: bool | None = None,
                    reasoning_effort: str | int | None = None, add_generation_prompt: bool = True,
                    drop_thinking: bool = True) -> str:
    """The V4.1 prompt text of an OpenAI chat request (module docstring shows the format).

    messages: dicts with role system/developer/user/assistant/tool; content a string or a list of text
      parts; assistant `tool_calls` (OpenAI format) and `reasoning_content`; tool `tool_call_id`.
    tools: OpenAI function tools; rendered into the first system message (an empty one is added first).
    thinking / reasoning_effort: see `resolve_thinking`.
    add_generation_prompt: end with `<｜Assistant｜>` + `<think>` (thinking) or `</think>` after a
      final user/tool/developer message.
    drop_thinking: drop the reasoning of turns before the last user request (ignored when tools are given,
      as in the reference encoder).
    Raises ValueError naming the offending field, e.g. `messages[2].role: unknown role 'bot' (...)`.
    """
    thinking_on, effort = resolve_thinking(thinking, reasoning_effort)
    turns = _normalize(messages)
    functions = _check_tools(tools) if tools is not None else []
    if functions:
        system = next((t for t in turns if t["role"] == "system"), None)
        if system is None:
            system = {"role": "system", "content": ""}
            turns.insert(0, system)
        system["tools"] = functions
    turns = _merge_tool_results(turns)
    _sort_tool_results(turns)
    drop = drop_thinking and not functions
    if thinking_on and drop:
        turns = _drop_old_thinking(turns)
    return BOS + "".join(
        _render_turn(i, turns, thinking=thinking_on, drop_thinking=drop, effort=effort,
                     add_generation_prompt=add_generation_prompt)
        for i in range(len(turns)))


def encode_messages_to_ids(tokenizer, messages: list[dict], **options) -> list[int]:
    """Token ids of `encode_messages(messages, **options)` under `tokenizer` (a serving.api Tokenizer)."""
    return tokenizer.encode(encode_messages(messages, **options))
