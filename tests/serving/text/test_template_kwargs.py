"""Chat-template defaults: what a request states lies over the server's defaults (an effort asks for thinking; a
request turning thinking on drops a default "none"), bad values are refused naming where they came from, and a
checkpoint folder states its own in tokenizer_config.json - the built-in nano-austen states thinking off."""

import json

import pytest

from dsv41.nano import NANO_DIR
from serving.text.template_kwargs import ChatTemplateKwargs, read_checkpoint_defaults

OFF, RECIPE = ChatTemplateKwargs(False), ChatTemplateKwargs()


@pytest.mark.parametrize("stated,defaults,resolved", [
    (RECIPE, OFF, (False, 50)),  # states nothing: the server's default
    (RECIPE, RECIPE, (True, 50)),  # V4.1's recipe
    (ChatTemplateKwargs(True), OFF, (True, 50)),
    (ChatTemplateKwargs(reasoning_effort="max"), OFF, (True, 100)),  # an effort asks for thinking
    (ChatTemplateKwargs(reasoning_effort="none"), RECIPE, (False, 50)),
    (ChatTemplateKwargs(True), ChatTemplateKwargs(reasoning_effort="none"), (True, 50)),
    (ChatTemplateKwargs(True), ChatTemplateKwargs(reasoning_effort=75), (True, 75)),
    (ChatTemplateKwargs(False), ChatTemplateKwargs(True, "max"), (False, 100)),
])
def test_a_request_lies_over_the_defaults(stated, defaults, resolved):
    assert stated.over(defaults).resolve() == resolved


def test_parse_takes_the_aliases_and_refuses_naming_where():
    assert ChatTemplateKwargs.parse({"enable_thinking": False}, "x") == OFF
    assert ChatTemplateKwargs.parse_json('{"reasoning_effort": 30}', "x") == ChatTemplateKwargs(None, 30)
    for value, needle in [([1], "must be a JSON object"), ({"temp": 1}, "unknown key(s) ['temp']"),
                          ({"thinking": "no"}, "flag.thinking: must be true or false"),
                          ({"reasoning_effort": "huge"}, "flag.reasoning_effort: must be")]:
        with pytest.raises(ValueError, match=None) as e:
            ChatTemplateKwargs.parse(value, "flag")
        assert needle in str(e.value) and str(e.value).startswith("flag")
    with pytest.raises(ValueError, match="not valid JSON"):
        ChatTemplateKwargs.parse_json("{thinking", "flag")


def test_describe_says_what_a_silent_request_gets():
    assert OFF.describe() == "thinking off"
    assert RECIPE.describe() == "thinking on at effort 50 (V4.1's recipe)"
    assert ChatTemplateKwargs(reasoning_effort="max").describe() == "thinking on at effort 100"


def test_a_checkpoint_states_its_defaults_in_tokenizer_config(tmp_path):
    assert read_checkpoint_defaults(tmp_path) is None  # no file
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    assert read_checkpoint_defaults(tmp_path) is None  # states nothing
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template_kwargs": {"thinking": True,
                                                                                          "reasoning_effort": "low"}}))
    assert read_checkpoint_defaults(tmp_path) == ChatTemplateKwargs(True, "low")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template_kwargs": {"think": 1}}))
    with pytest.raises(ValueError, match="tokenizer_config.json: chat_template_kwargs: unknown key"):
        read_checkpoint_defaults(tmp_path)


def test_the_built_in_model_states_thinking_off():
    assert read_checkpoint_defaults(NANO_DIR) == OFF
