"""Every error path of the Anthropic Messages endpoints, raised by the real ``anthropic`` SDK as its
own exception classes, in Anthropic's error shape; and ``tool_choice`` (auto with one call,
none, any / tool, which need constraint enforcement), server tools, retention from cache_control.
No refused request holds a block."""

import json
import logging

import anthropic
import httpx
import pytest

from serve_helpers import keyed_served

MODEL = "tiny-smol"
GREEDY = {"temperature": 0}
USER = [{"role": "user", "content": "Weather in Berlin?"}]
WEATHER = {"name": "get_weather", "description": "Weather of a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
WEATHER_OPENAI = {"type": "function", "function": {"name": "get_weather", "description": WEATHER["description"],
                                                   "parameters": WEATHER["input_schema"]}}
TWO_CALLS = ('<tool_call>{"name": "get_weather", "arguments": {"city": "Berlin"}}</tool_call>\n'
             '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>')


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    server = keyed_served(tmp_path_factory, "secret")
    yield server
    server.stop()


def client(served, **kwargs) -> anthropic.Anthropic:
    if "auth_token" not in kwargs:
        kwargs.setdefault("api_key", "secret")
    return served.anthropic(**kwargs)


def create(c, **kwargs):
    return c.messages.create(**{"model": MODEL, "max_tokens": 16, "messages": USER, **kwargs})


def error_of(exc) -> dict:
    assert exc.body["type"] == "error" and set(exc.body["error"]) >= {"type", "message"}, exc.body
    return exc.body["error"]


def test_a_wrong_or_missing_key_is_an_authentication_error_and_a_bearer_works(served):
    for kwargs in ({"api_key": "wrong"}, {"auth_token": "wrong"}):
        with client(served, **kwargs) as c, pytest.raises(anthropic.AuthenticationError) as raised:
            create(c)
        assert error_of(raised.value)["type"] == "authentication_error"
    with client(served, auth_token="secret", api_key=None) as c:
        assert create(c, extra_body=GREEDY).type == "message"
    served.assert_clean()


def test_an_unknown_model_or_path_is_not_found(served):
    with client(served) as c:
        with pytest.raises(anthropic.NotFoundError) as raised:
            create(c, model="claude-sonnet-9")
        assert error_of(raised.value) == {"type": "not_found_error",
                                          "message": "The model 'claude-sonnet-9' does not exist on this server."}
        with pytest.raises(anthropic.NotFoundError):
            c.messages.count_tokens(model="nope", messages=USER)
    response = httpx.post(served.base_url + "/v1/messages/elsewhere", json={}, headers={"x-api-key": "secret"})
    assert response.status_code == 404 and response.json()["error"]["type"] == "not_found_error"


@pytest.mark.parametrize("body, says", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                              "data": "AAAA"}}]}]},
     "messages.0.content.0: image content blocks are not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]}]},
     "only text blocks are supported"),
    ({"messages": [{"role": "user", "content": [{"type": "video"}]}]}, "does not match any of the expected tags"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content.0.text: Field required"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure"}]}, "prefilled"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "x", "input": {}}]}]},
     "a user message cannot hold 'tool_use' blocks"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "other"}}, "which is not in tools"),
    ({"tools": [WEATHER, WEATHER]}, "names must be unique"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": 1.5}, "temperature"),
    ({"stop_sequences": [""]}, "stop_sequences.0"),
    ({"messages": []}, "messages"),
])
def test_invalid_requests_are_invalid_request_errors(served, body, says):
    with client(served) as c, pytest.raises(anthropic.BadRequestError) as raised:
        c.messages.create(model=MODEL, max_tokens=16, messages=USER, extra_body=body)  # body's fields win
    error = error_of(raised.value)
    assert error["type"] == "invalid_request_error" and says in error["message"], error
    served.assert_clean()


def test_malformed_json_and_a_missing_max_tokens_are_invalid_requests(served):
    headers = {"x-api-key": "secret", "content-type": "application/json"}
    for content in (b"{not json", json.dumps({"model": MODEL, "messages": USER}).encode()):
        response = httpx.post(served.base_url + "/v1/messages?beta=true", content=content, headers=headers)
        assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"


def test_an_over_long_prompt_says_what_claude_code_parses(served):
    long = [{"role": "user", "content": "word " * 2500}]
    with client(served) as c:
        counted = c.messages.count_tokens(model=MODEL, messages=long).input_tokens
        with pytest.raises(anthropic.BadRequestError) as raised:
            create(c, messages=long)
    assert error_of(raised.value) == {"type": "invalid_request_error",
                                      "message": f"prompt is too long: {counted} tokens > 2047 maximum"}
    served.assert_clean()


def test_a_full_server_is_rate_limited_and_a_missing_engine_is_overloaded(served):
    gate = served.state.gate
    with client(served) as c:
        gate.in_flight += gate.limit
        try:
            with pytest.raises(anthropic.RateLimitError) as raised:
                create(c)
        finally:
            gate.in_flight -= gate.limit
        assert error_of(raised.value)["type"] == "rate_limit_error"
        served.state.attach_engine(None)
        try:
            with pytest.raises(anthropic.OverloadedError) as raised:
                create(c, stream=True)
        finally:
            served.state.attach_engine(served.engine)
        assert raised.value.status_code == 529 and error_of(raised.value)["type"] == "overloaded_error"
        assert create(c, extra_body=GREEDY).type == "message"
    served.assert_clean()


def test_disable_parallel_tool_use_answers_one_call_and_none_answers_text(served):
    served.say(USER, TWO_CALLS, tools=[WEATHER_OPENAI])
    with client(served) as c:
        both = create(c, max_tokens=64, tools=[WEATHER], extra_body=GREEDY)
        one = create(c, max_tokens=64, tools=[WEATHER], extra_body=GREEDY,
                     tool_choice={"type": "auto", "disable_parallel_tool_use": True})
        with c.messages.stream(model=MODEL, max_tokens=64, messages=USER, tools=[WEATHER], extra_body=GREEDY,
                               tool_choice={"type": "auto", "disable_parallel_tool_use": True}) as s:
            streamed = s.get_final_message()
        text = create(c, max_tokens=64, tools=[WEATHER], extra_body=GREEDY, tool_choice={"type": "none"})
    assert [b.input["city"] for b in both.content] == ["Berlin", "Paris"] and both.stop_reason == "tool_use"
    for message in (one, streamed):
        assert [b.input["city"] for b in message.content] == ["Berlin"] and message.stop_reason == "tool_use"
    assert text.stop_reason == "end_turn" and text.content[0].text == TWO_CALLS
    served.assert_clean()


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"},
                                    {"type": "any", "disable_parallel_tool_use": True}])
def test_any_and_tool_force_a_call_that_matches_the_schema(served, choice):
    """The model would answer in text; the grammar forces a call (its string bounded, so that the
    tiny model's forced choices cannot run a string past max_tokens)."""
    bounded = {**WEATHER, "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                                           "required": ["city"]}}
    bounded_openai = {"type": "function", "function": {"name": "get_weather", "description": WEATHER["description"],
                                                       "parameters": bounded["input_schema"]}}
    served.say(USER, "I will not call anything.", tools=[bounded_openai])
    with client(served) as c:
        message = create(c, max_tokens=512, tools=[bounded], tool_choice=choice, extra_body=GREEDY)
    calls = [b for b in message.content if b.type == "tool_use"]
    assert message.stop_reason == "tool_use" and calls and calls[0].name == "get_weather"
    assert all(isinstance(b.input.get("city"), str) for b in calls)
    if choice.get("disable_parallel_tool_use"):
        assert len(calls) == 1


def test_server_tools_are_dropped_with_a_debug_line_and_tool_choice_without_tools_is_ignored(served, caplog):
    web = {"type": "web_search_20250305", "name": "web_search", "max_uses": 3}
    with client(served) as c, caplog.at_level(logging.DEBUG, logger="radixcache.serve"):
        plain = c.messages.count_tokens(model=MODEL, messages=USER).input_tokens
        dropped = c.messages.count_tokens(model=MODEL, messages=USER, tools=[web]).input_tokens
        body = create(c, tools=[web], tool_choice={"type": "any"}, extra_body=GREEDY)
        with_weather = c.messages.count_tokens(model=MODEL, messages=USER, tools=[web, WEATHER]).input_tokens
    assert dropped == plain < with_weather and body.type == "message"
    assert "dropping server tool 'web_search'" in caplog.text
    served.assert_clean()


def test_an_engine_failure_is_an_api_error_and_in_a_stream_an_error_event(served, monkeypatch):
    real = served.lm.runner.forward
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        if len(calls) % 2 == 0:  # the prompt goes in; the first decode step fails
            raise RuntimeError("device fell over")
        return real(*args, **kwargs)

    served.say(USER, "A long enough answer to need several steps.")
    monkeypatch.setattr(served.lm.runner, "forward", broken)
    with client(served) as c:
        with pytest.raises(anthropic.InternalServerError) as raised:
            create(c, extra_body=GREEDY)
        assert error_of(raised.value)["type"] == "api_error" and "device fell over" in raised.value.message
        seen = []
        with pytest.raises(anthropic.APIStatusError) as raised:
            with c.messages.stream(model=MODEL, max_tokens=16, messages=USER, extra_body=GREEDY) as s:
                for event in s:
                    seen.append(event.type)
        assert seen[0] == "message_start"  # the stream had begun: the error comes as its error event
        assert error_of(raised.value) == {"type": "api_error", "message": "generation failed: RuntimeError: device fell over"}
        monkeypatch.setattr(served.lm.runner, "forward", real)
        assert create(c, extra_body=GREEDY).content[0].text.startswith("A long")
    served.assert_clean()
