"""`/tokenize` and `/detokenize` (vLLM's routes): a prompt gets BOS as `/v1/completions` gives it, chat messages
the chat endpoint's encoding under the same server defaults; ids back to text; bad input is a 400 naming the
field, a model without a tokenizer too."""

from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from serving.api.server import build_app
from serving.text.encoding import encode_messages_to_ids
from serving.text.template_kwargs import ChatTemplateKwargs
from tests.serving.api.scripted import TOK, ScriptedEngine, scripted_app

CHAT = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def client():
    with TestClient(scripted_app(ScriptedEngine(), defaults=ChatTemplateKwargs(False))) as c:
        yield c


def test_a_prompt_gets_bos_unless_asked_not_to(client):
    r = client.post("/tokenize", json={"prompt": "Hi there", "return_token_strs": True}).json()
    assert r["tokens"] == [TOK.bos_id] + TOK.encode("Hi there") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 4096 and "".join(r["token_strs"][1:]) == "Hi there"
    bare = client.post("/tokenize", json={"prompt": "Hi there", "add_special_tokens": False}).json()
    assert bare["tokens"] == TOK.encode("Hi there") and "token_strs" not in bare


def test_messages_are_encoded_as_chat_is_under_the_server_defaults(client):
    assert client.post("/tokenize", json={"messages": CHAT}).json()["tokens"] == \
        encode_messages_to_ids(TOK, CHAT, thinking=False)  # the server's default: thinking off
    on = client.post("/tokenize", json={"messages": CHAT, "chat_template_kwargs": {"reasoning_effort": "max"}})
    assert on.json()["tokens"] == encode_messages_to_ids(TOK, CHAT, reasoning_effort="max")
    open_ended = client.post("/tokenize", json={"messages": CHAT, "add_generation_prompt": False}).json()
    assert open_ended["tokens"] == encode_messages_to_ids(TOK, CHAT, thinking=False, add_generation_prompt=False)


def test_detokenize_round_trips(client):
    ids = TOK.encode("Anne was proud")
    assert client.post("/detokenize", json={"tokens": ids}).json() == {"prompt": "Anne was proud"}


@pytest.mark.parametrize("route,body,needle", [
    ("/tokenize", {}, "prompt: give either"),
    ("/tokenize", {"prompt": "x", "messages": CHAT}, "prompt: give either"),
    ("/tokenize", {"messages": [{"role": "bot", "content": "x"}]}, "messages[0].role"),
    ("/tokenize", {"messages": CHAT, "chat_template_kwargs": {"thinking": "yes"}}, "thinking"),
    ("/tokenize", {"prompt": "x", "model": "other"}, "does not exist"),
    ("/detokenize", {"tokens": [5, 600]}, "tokens[1]"),
    ("/detokenize", {"tokens": [-1]}, "tokens.0"),
    ("/detokenize", {}, "tokens"),
])
def test_bad_input_is_4xx_naming_the_field(client, route, body, needle):
    r = client.post(route, json=body)
    assert 400 <= r.status_code < 500 and needle in r.json()["error"]["message"], r.text


def test_a_model_without_a_tokenizer_says_so():
    engine = SimpleNamespace(engine=SimpleNamespace(metrics=None))
    with TestClient(build_app(engine, None, model_name="m", max_model_len=16)) as c:
        for route, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
            r = c.post(route, json=body)
            assert r.status_code == 400 and "no tokenizer" in r.json()["error"]["message"]
