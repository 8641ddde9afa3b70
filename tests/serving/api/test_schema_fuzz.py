"""A schema fuzz of the agent routes: bodies drawn from the server's own OpenAPI schema (`schema_strategies`),
valid ones and, for about half the examples, one field's value broken; each is posted to the real app in front of a
scripted engine (the engine's admission checks included) and must never get a 5xx, streamed or not. Then the
schema states the limits a client needs: required fields, ranges, enums."""

import json

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serving.text.encoding import dsml_tool_calls
from tests.serving.api.schema_strategies import from_schema
from tests.serving.api.scripted import TOK, ScriptedEngine, scripted_app

ROUTES = {"/v1/responses": "ResponsesRequest", "/v1/messages": "MessagesRequest",
          "/v1/messages/count_tokens": "CountTokensRequest", "/tokenize": "TokenizeRequest",
          "/detokenize": "DetokenizeRequest"}
EXAMPLES = 60  # per route, the same ones each run (derandomized: CI stays reproducible); raise it to search wider
SCRIPT = "Weigh it.</think>Here. " + dsml_tool_calls([("get_weather", {"city": "Bath"})])
APP = scripted_app(ScriptedEngine(SCRIPT, step=6))
OPENAPI = APP.openapi()
BROKEN = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False),
                   st.text(max_size=8), st.lists(st.integers(), max_size=2),
                   st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))


@pytest.fixture(scope="module")
def client():
    with TestClient(APP, raise_server_exceptions=True) as c:
        yield c


@pytest.mark.parametrize("route", list(ROUTES))
def test_no_body_drawn_from_the_schema_gets_a_5xx(client, route):
    schema = from_schema({"$ref": ROUTES[route]}, OPENAPI["components"]["schemas"])

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large])
    @given(body=schema, data=st.data())
    def check(body, data):
        if isinstance(body, dict) and body and data.draw(st.booleans(), label="break a field"):
            key = data.draw(st.sampled_from(sorted(body)), label="field")
            body = {**body, key: data.draw(BROKEN, label="value")}
        if route in ("/v1/responses", "/v1/messages") and isinstance(body, dict) and "model" in body:
            body = {**body, "model": data.draw(st.sampled_from(["m", body["model"]]), label="model")}
        r = client.post(route, content=json.dumps(body), headers={"Content-Type": "application/json"})  # \u escapes
        assert r.status_code < 500, (body, r.status_code, r.text)
        if r.status_code >= 400:
            payload = r.json()
            message = payload["error"]["message"]
            assert message and (payload.get("type") == "error") == route.startswith("/v1/messages"), payload

    check()


@pytest.mark.parametrize("route,body,where", [
    ("/v1/responses", '{"input": "", "user": "\\ud800"}', "user"),  # echoed back in the response object
    ("/v1/messages", '{"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}], '
                     '"metadata": {"user_id": "a\\udfff"}}', "metadata.user_id"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": ["x", "\\udc00"]}]}', "messages.0.content.1"),
    ("/tokenize", '{"prompt": "ok", "\\ud8ff": 1}', "'\\ud8ff'"),
])
def test_a_lone_surrogate_anywhere_is_a_400_naming_where(client, route, body, where):
    r = client.post(route, content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert message.startswith(f"{where}: not valid Unicode text"), message


def test_a_surrogate_pair_is_one_character_and_passes(client):
    r = client.post("/tokenize", content='{"prompt": "\\ud83d\\ude00"}', headers={"Content-Type": "application/json"})
    assert r.status_code == 200 and r.json()["tokens"][1:] == TOK.encode("\U0001f600"), r.text


def test_the_schema_states_the_limits():
    s = OPENAPI["components"]["schemas"]
    assert {"model", "messages", "max_tokens"} <= set(s["MessagesRequest"]["required"])
    assert s["ResponsesRequest"]["required"] == ["input"]
    temperature = s["MessagesRequest"]["properties"]["temperature"]["anyOf"][0]
    assert (temperature["minimum"], temperature["maximum"]) == (0, 1)
    assert s["MessagesRequest"]["properties"]["max_tokens"]["minimum"] == 1
    effort = s["ReasoningConfig"]["properties"]["effort"]["anyOf"][0]["enum"]
    assert effort == ["none", "minimal", "low", "medium", "high", "xhigh", "max"]
    assert s["ThinkingEnabled"]["properties"]["budget_tokens"]["minimum"] == 1024
    assert s["DetokenizeRequest"]["properties"]["tokens"]["items"]["maximum"] == 2**31 - 1
