"""Request models (every field the server honours, every refusal) and response shapes, checked
against the ``openai`` client's own types."""

import json

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from radixcache.integrations.serve.protocols.openai import bodies as R
from radixcache.integrations.serve.requests.job import assistant_message
from radixcache.integrations.serve.requests.tool_calls import tool_call_objects, ParsedToolCall
from radixcache.integrations.serve.errors import APIError
from radixcache.integrations.serve.protocols.openai.messages import AssistantMessage, ToolMessage
from radixcache.integrations.serve.protocols.openai.requests import parse_chat_request, parse_completion_request

USER = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Berlin"}'}}


def refused(parse, body, param=None, words=""):
    with pytest.raises(APIError) as info:
        parse(body)
    err = info.value
    assert err.status == 400 and err.type == "invalid_request_error"
    assert err.param == param
    assert words in err.message
    assert set(err.body()["error"]) == {"message", "type", "param", "code"}
    return err


def test_every_role_and_defaults():
    req = parse_chat_request({"model": "m", "messages": [
        {"role": "system", "content": "s"}, {"role": "developer", "content": "d"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
        {"role": "assistant", "content": "It rains."}], "tools": TOOLS})
    assert [m.role for m in req.messages] == ["system", "developer", "user", "assistant", "tool", "assistant"]
    assert req.messages[2].text == "ab"
    assert isinstance(req.messages[3], AssistantMessage) and req.messages[3].content is None
    assert req.messages[3].tool_calls[0].function.arguments == '{"city": "Berlin"}'
    assert isinstance(req.messages[4], ToolMessage)
    assert req.effective_temperature == 1.0 and req.effective_top_p == 1.0  # OpenAI: default samples
    assert req.n == 1 and req.max_new_tokens is None and req.stop_strings == []
    assert req.parses_tool_calls and not req.stream and not req.include_usage


def test_sampling_fields():
    req = parse_chat_request({"messages": USER, "temperature": 0, "top_p": 0.5, "n": 3, "seed": 7,
                              "stop": "\n", "max_tokens": 9, "stream": True,
                              "stream_options": {"include_usage": True}, "prompt_cache_key": "conv-1",
                              "prompt_cache_retention": "24h", "user": "u", "metadata": {"x": 1}})
    assert (req.effective_temperature, req.effective_top_p, req.n, req.seed) == (0.0, 0.5, 3, 7)
    assert req.stop_strings == ["\n"] and req.max_new_tokens == 9 and req.include_usage
    assert req.prompt_cache_key == "conv-1" and req.prompt_cache_retention == "24h"
    assert req.keep_s == 86400.0  # a day
    retained = lambda **f: parse_chat_request({"messages": USER, **f}).keep_s  # noqa: E731
    assert retained() is None and retained(prompt_cache_key="s") == 300.0  # a key alone: in_memory
    assert retained(prompt_cache_retention="in_memory") == 300.0
    assert parse_completion_request({"prompt": "x", "prompt_cache_retention": "24h"}).keep_s == 86400.0
    both = parse_chat_request({"messages": USER, "max_tokens": 9, "max_completion_tokens": 4})
    assert both.max_new_tokens == 4  # the newer field wins
    assert not parse_chat_request({"messages": USER, "tools": TOOLS, "tool_choice": "none"}).parses_tool_calls
    named = parse_chat_request({"messages": USER, "tools": TOOLS,
                                "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    assert named.parses_tool_calls
    assert not parse_chat_request({"messages": USER}).parses_tool_calls  # no tools: never parse


@pytest.mark.parametrize("extra", [{"tool_choice": "auto"}, {"tool_choice": "required"}, {"tools": []},
                                   {"tools": [], "tool_choice": "required"},
                                   {"tool_choice": {"type": "function", "function": {"name": "x"}}}])
def test_tool_choice_without_tools_is_ignored(extra):
    """Routers (SMG) add ``tool_choice: "auto"`` to every body they forward: without tools (or with an
    empty list) it means nothing and is ignored, never refused."""
    req = parse_chat_request({"messages": USER, **extra})
    assert req.tools is None and req.tool_choice is None and not req.parses_tool_calls


@pytest.mark.parametrize("body,param,words", [
    ({}, "messages", "required"),
    ({"messages": []}, "messages", "at least 1"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0", "robot"),
    ({"messages": [{"content": "x"}]}, "messages.0", "role"),
    ({"messages": [{"role": "assistant", "content": None}]}, "messages.0", "content or tool_calls"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.tool_call_id", "required"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]},
     "messages.0.content", "only text parts"),
    ({"messages": USER, "max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ({"messages": USER, "max_completion_tokens": 0}, "max_completion_tokens", "greater than or equal to 1"),
    ({"messages": USER, "max_tokens": "3"}, "max_tokens", "integer"),
    ({"messages": USER, "max_tokens": 2.5}, "max_tokens", "integer"),
    ({"messages": USER, "n": 0}, "n", "greater than or equal to 1"),
    ({"messages": USER, "n": True}, "n", "integer"),
    ({"messages": USER, "temperature": 2.5}, "temperature", "less than or equal to 2"),
    ({"messages": USER, "top_p": 0}, "top_p", "greater than 0"),
    ({"messages": USER, "stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
    ({"messages": USER, "stop": [""]}, "stop", "must not be empty"),
    ({"messages": USER, "stop": ["a", 3]}, "stop", "string"),
    ({"messages": USER, "seed": "7"}, "seed", "integer"),
    ({"messages": USER, "stream_options": {"include_usage": True}}, None, "only allowed when stream"),
    ({"messages": USER, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     None, "not in tools"),
    ({"messages": USER, "tools": TOOLS + TOOLS}, None, "unique"),
    ({"messages": USER, "tools": [{"type": "function", "function": {"name": "has space"}}]},
     "tools.0.function.name", "pattern"),
    ({"messages": USER, "logprobs": "yes"}, "logprobs", "boolean"),
    ({"messages": USER, "top_logprobs": 2}, None, "top_logprobs requires logprobs"),
    ({"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
    ({"messages": USER, "presence_penalty": 0.5}, None, "presence_penalty"),
    ({"messages": USER, "frequency_penalty": 1}, None, "frequency_penalty"),
    ({"messages": USER, "logit_bias": {"1": 5}}, None, "logit_bias"),
    ({"messages": USER, "response_format": {"type": "yaml"}}, None, "response_format.type"),
    ({"messages": USER, "response_format": {"type": "json_schema"}}, None, "response_format.json_schema"),
    ({"messages": USER, "response_format": {"type": "json_schema", "json_schema": {"schema": 3}}}, None,
     "response_format.json_schema.schema must be a JSON object"),
    ({"messages": USER, "parallel_tool_calls": "no"}, "parallel_tool_calls", "boolean"),
    ({"messages": USER, "prompt_cache_retention": "forever"}, "prompt_cache_retention", "in_memory"),
])
def test_chat_refusals_name_the_field(body, param, words):
    refused(parse_chat_request, body, param, words)


def test_body_must_be_an_object():
    refused(parse_chat_request, [USER], None, "JSON object")
    refused(parse_completion_request, "hi", None, "JSON object")


def test_completion_prompt_forms():
    assert parse_completion_request({"prompt": "Once"}).prompt == "Once"
    req = parse_completion_request({"prompt": [1, 2, 3]})
    assert req.prompt == [1, 2, 3] and req.max_new_tokens == 16  # OpenAI's default for completions
    for prompt, words in [("", "empty"), ([], "empty"), (["a", "b"], "one prompt"), ([[1, 2]], "one prompt"),
                          ([1, -2], "non-negative"), ([1, True], "non-negative"), ([1.0], "non-negative"),
                          (3, "string or a list")]:
        refused(parse_completion_request, {"prompt": prompt}, "prompt", words)
    for extra, words in [({"echo": True}, "echo"), ({"suffix": "x"}, "suffix"), ({"best_of": 2}, "best_of"),
                         ({"max_tokens": 0}, "greater than or equal to 1")]:
        refused(parse_completion_request, {"prompt": "x", **extra}, "max_tokens" if "max_tokens" in extra else None,
                words)


# ---------------------------------------------------------------------- responses, as the client reads them
def test_chat_completion_body_parses_as_the_clients_type():
    calls = tool_call_objects([ParsedToolCall("get_weather", '{"city": "Berlin"}')])
    choices = [R.chat_choice(0, assistant_message("It rains.", None), "stop"),
               R.chat_choice(1, assistant_message(None, calls), "tool_calls")]
    body = R.chat_completion("chatcmpl-1", 1, "m", choices, R.usage(100, 7, 96))
    parsed = ChatCompletion.model_validate(json.loads(json.dumps(body)))
    assert parsed.usage.prompt_tokens_details.cached_tokens == 96
    assert parsed.usage.total_tokens == 107
    assert parsed.choices[1].message.content is None
    assert parsed.choices[1].message.tool_calls[0].function.name == "get_weather"
    assert parsed.choices[1].message.tool_calls[0].id.startswith("call_")
    assert parsed.choices[1].finish_reason == "tool_calls"


def test_stream_chunks_parse_as_the_clients_type():
    first = R.chat_chunk("c", 1, "m", [R.delta_choice(0, {"role": "assistant", "content": ""})], usage_null=True)
    assert json.loads(R.sse(first)[len("data: "):])["usage"] is None
    calls = tool_call_objects([ParsedToolCall("f", "{}")])
    middle = R.chat_chunk("c", 1, "m", [R.delta_choice(0, {"tool_calls": R.tool_call_deltas(calls)}, "tool_calls")])
    last = R.chat_chunk("c", 1, "m", [], R.usage(10, 2, 8))
    for chunk in (first, middle, last):
        text = R.sse(chunk)
        assert text.startswith("data: ") and text.endswith("\n\n")
        ChatCompletionChunk.model_validate(json.loads(text[len("data: "):]))
    parsed = ChatCompletionChunk.model_validate(middle)
    assert parsed.choices[0].delta.tool_calls[0].index == 0
    assert ChatCompletionChunk.model_validate(last).usage.prompt_tokens_details.cached_tokens == 8
    assert R.SSE_DONE == "data: [DONE]\n\n"


def test_completion_body_parses_as_the_clients_type():
    body = R.completion("cmpl-1", 1, "m", [R.text_choice(0, "upon a time", "length")], R.usage(3, 4, 0))
    parsed = Completion.model_validate(body)
    assert parsed.choices[0].text == "upon a time" and parsed.usage.prompt_tokens_details.cached_tokens == 0
    chunk = R.completion("cmpl-1", 1, "m", [R.text_choice(0, "up", None)], None, usage_null=True)
    # OpenAI's streamed completions carry finish_reason null until the end, as here (the client
    # builds stream chunks without validating that field)
    assert chunk["usage"] is None and chunk["choices"] == [{"index": 0, "text": "up", "logprobs": None,
                                                            "finish_reason": None}]
