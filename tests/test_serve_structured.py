"""Structured output, enforced tool calls and logprobs over HTTP, with the ``openai`` client and
LangChain's ``with_structured_output``, against a live server on a tiny scripted Llama (the
embedded tokenizer and template: tools go into the system message, calls come back as
``<tool_call>`` blocks)."""

import json

import jsonschema
import openai
import pytest
import torch

from radixcache.integrations.serve.requests.tool_calls import format_tool_call, parse_tool_calls
from serve_helpers import Served, write_model_dir

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"type": "string", "maxLength": 6}}, "required": ["zone"]}}}]
SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                           "score": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["answer", "score"]}
TWO_CALLS = "\n".join([format_tool_call("get_weather", '{"city": "Paris", "unit": "c"}'),
                       format_tool_call("get_time", '{"zone": "CET"}')])


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    s = Served(write_model_dir(tmp_path_factory.mktemp("model"), weights=True), served_model_names=["tiny"])
    yield s
    s.stop()


@pytest.fixture
def client(served):
    served.model.script = {}
    yield served.client()
    served.model.script = {}
    served.assert_clean()


def chat(client, **kwargs):
    return client.chat.completions.create(model="tiny", messages=kwargs.pop("messages", MESSAGES),
                                          temperature=kwargs.pop("temperature", 0), **kwargs)


# ---------------------------------------------------------------------- response_format
def test_json_schema_reply_validates(client):
    reply = chat(client, max_tokens=100, response_format={
        "type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA, "strict": True}})
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    assert ": " in choice.message.content and "\n" not in choice.message.content


def test_json_object_reply_is_the_models_own_when_valid(served, client):
    """json_object changes nothing in a reply that already is an object, and ends it there."""
    served.say(MESSAGES, '{"a": [1, true]}', eos=False)
    free = chat(client, max_tokens=12)
    assert free.choices[0].message.content.startswith('{"a": [1, true]}') and free.choices[0].finish_reason == "length"
    constrained = chat(client, max_tokens=12, response_format={"type": "json_object"}, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in constrained if c.choices)
    assert text == '{"a": [1, true]}'


# ---------------------------------------------------------------------- enforced tool calls
def test_required_tool_call_parses_and_matches_the_schema(client):
    """The random model would never call a tool: "required" makes it, in the template's format."""
    assert chat(client, max_tokens=40, tools=TOOLS).choices[0].message.tool_calls is None
    choice = chat(client, max_tokens=120, tools=TOOLS, tool_choice="required").choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_parallel_false_allows_one_call_and_a_named_tool_is_the_one_called(served, client):
    served.say(MESSAGES, TWO_CALLS, tools=TOOLS)
    free = chat(client, max_tokens=80, tools=TOOLS).choices[0]
    assert [c.function.name for c in free.message.tool_calls] == ["get_weather", "get_time"]
    forced = chat(client, max_tokens=80, tools=TOOLS, tool_choice="required").choices[0]
    assert [c.function.name for c in forced.message.tool_calls] == ["get_weather", "get_time"]
    one = chat(client, max_tokens=80, tools=TOOLS, tool_choice="required", parallel_tool_calls=False).choices[0]
    assert [c.function.arguments for c in one.message.tool_calls] == ['{"city": "Paris", "unit": "c"}']
    assert one.finish_reason == "tool_calls"
    named = chat(client, max_tokens=80, tools=TOOLS, parallel_tool_calls=False,
                 tool_choice={"type": "function", "function": {"name": "get_time"}}).choices[0]
    assert [c.function.name for c in named.message.tool_calls] == ["get_time"]
    jsonschema.validate(json.loads(named.message.tool_calls[0].function.arguments), TOOLS[1]["function"]["parameters"])


def test_parallel_false_under_auto_keeps_the_first_call(served, client):
    """No grammar binds an "auto" reply; the model writes two calls and the client asked for one
    at most: the first is the answer, streamed or not (both were returned before)."""
    served.say(MESSAGES, TWO_CALLS, tools=TOOLS)
    one = chat(client, max_tokens=80, tools=TOOLS, parallel_tool_calls=False).choices[0]
    assert [c.function.name for c in one.message.tool_calls] == ["get_weather"]
    assert one.finish_reason == "tool_calls" and one.message.content is None
    streamed = chat(client, max_tokens=80, tools=TOOLS, parallel_tool_calls=False, stream=True)
    names, finish = [], None
    for chunk in streamed:
        for choice in chunk.choices:
            names += [c.function.name for c in choice.delta.tool_calls or [] if c.function.name]
            finish = choice.finish_reason or finish
    assert names == ["get_weather"] and finish == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
def test_complete_calls_survive_a_max_tokens_cut(served, client, stream):
    served.say(MESSAGES, TWO_CALLS, tools=TOOLS)
    tokenizer = served.state.tokenizer
    first = len(tokenizer(TWO_CALLS.split("\n")[0] + "\n", add_special_tokens=False)["input_ids"])
    reply = chat(client, max_tokens=first + 4, tools=TOOLS, tool_choice="required", stream=stream)
    if stream:
        chunks = [c for c in reply if c.choices]
        calls = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
        finish = chunks[-1].choices[0].finish_reason
        content = "".join(c.choices[0].delta.content or "" for c in chunks)
    else:
        calls, finish = reply.choices[0].message.tool_calls, reply.choices[0].finish_reason
        content = reply.choices[0].message.content or ""
    assert [c.function.name for c in calls] == ["get_weather"] and finish == "tool_calls" and content == ""


def test_parser_keeps_complete_calls_of_an_enforced_reply_cut_short():
    cut = TWO_CALLS[:-20]
    names = ["get_weather", "get_time"]
    assert parse_tool_calls(cut, names).tool_calls == []  # free text: a broken call is all content
    for end in (-20, TWO_CALLS.index("\n") + 5, TWO_CALLS.index("\n") + 1):
        parsed = parse_tool_calls(TWO_CALLS[:end], names, complete_only=True)
        assert [c.name for c in parsed.tool_calls] == ["get_weather"] and parsed.content is None
    assert parse_tool_calls("<tool_call>{", names, complete_only=True) == (None, [])


# ---------------------------------------------------------------------- logprobs
def reference(served, prompt, generated):
    ids = torch.tensor([list(prompt) + list(generated)])
    with torch.no_grad():
        logits = served.model(ids).logits[0, len(prompt) - 1:-1]
    return torch.log_softmax(logits.float(), dim=-1)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_are_the_models_for_every_completion_token(served, client, stream):
    prompt = served.render(MESSAGES)
    reply = chat(client, max_tokens=6, logprobs=True, top_logprobs=3, stream=stream,
                 stream_options={"include_usage": True} if stream else None)
    if stream:
        chunks = list(reply)
        entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
        usage = chunks[-1].usage
    else:
        entries, usage = reply.choices[0].logprobs.content, reply.usage
    assert len(entries) == usage.completion_tokens == 6
    with torch.no_grad():
        generated = served.model.generate(torch.tensor([list(prompt)]), max_new_tokens=6, do_sample=False,
                                          pad_token_id=0)[0, len(prompt):].tolist()
    expected = reference(served, prompt, generated)
    decode = served.state.tokenizer.decode
    for entry, token, row in zip(entries, generated, expected):
        assert entry.token == decode([token]) and entry.logprob == pytest.approx(float(row[token]), abs=1e-4)
        top = row.topk(3)
        assert [t.token for t in entry.top_logprobs] == [decode([i]) for i in top.indices.tolist()]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)
        assert entry.bytes == list(entry.token.encode())


def test_logprobs_include_the_stop_token_and_completions_have_them_too(served, client):
    served.say(MESSAGES, "Sunny.")
    reply = chat(client, max_tokens=20, logprobs=True)
    assert reply.choices[0].finish_reason == "stop"
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens and content[-1].token == "<|im_end|>"
    assert all(e.top_logprobs == [] for e in content)
    assert chat(client, max_tokens=3).choices[0].logprobs is None
    done = client.completions.create(model="tiny", prompt="Once upon", max_tokens=4, temperature=0, logprobs=2)
    lp = done.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == done.usage.completion_tokens == 4
    assert "".join(lp.tokens) == done.choices[0].text and lp.text_offset[0] == 0
    assert all(len(top) == 2 and max(top.values()) >= v for top, v in zip(lp.top_logprobs, lp.token_logprobs))


# ---------------------------------------------------------------------- errors
@pytest.mark.parametrize("kwargs,words,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     'the JSON schema is invalid or unsupported: Unsupported type "strin"', "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "bad", "parameters": {"type": "object", "properties": {
        "a": {"$ref": "#/nowhere"}}}}}], "tool_choice": "required"}, "parameters schema of tool 'bad'", "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot both", None),
    ({"response_format": {"type": "yaml"}}, "response_format.type", None),
])
def test_bad_constraints_are_400s_that_name_them(client, kwargs, words, param):
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, max_tokens=5, **kwargs)
    assert info.value.status_code == 400 and words in info.value.body["message"]
    if param is not None:  # a schema the compiler refuses: the field it came from
        assert info.value.body["param"] == param


# ---------------------------------------------------------------------- LangChain
def test_langchain_with_structured_output(served, client):
    """LangChain's default structured output (a strict json_schema response_format) parses into the
    pydantic model."""
    from typing import Literal

    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Verdict(BaseModel):
        answer: Literal["yes", "no"]
        score: int = Field(ge=0, le=9)
        sure: bool

    llm = ChatOpenAI(model="tiny", base_url=served.base_url + "/v1", api_key="none", temperature=0,
                     max_tokens=60, max_retries=0)
    verdict = llm.with_structured_output(Verdict).invoke("Is Paris in France?")
    assert isinstance(verdict, Verdict)
    raw = llm.with_structured_output(Verdict, include_raw=True).invoke("Is Paris in France?")
    assert raw["parsing_error"] is None and raw["parsed"] == verdict


# ---------------------------------------------------------------------- the compiler's cache
def test_grammars_are_cached_by_kind_schema_and_options():
    import asyncio

    from grammar_cases import grammars
    from radixcache.integrations.serve.requests.structured import json_constraint, tool_call_constraint
    from radixcache.integrations.serve.requests.structured import ConstraintError

    g = grammars()
    reordered = dict(reversed(list(SCHEMA.items())))
    first = g.compile_now(json_constraint(SCHEMA, strict=True))
    assert g.compile_now(json_constraint(reordered, strict=True)) is first  # canonical JSON
    assert g.compile_now(json_constraint(SCHEMA, strict=False)) is not first
    assert g.compile_now(tool_call_constraint(TOOLS, parallel=False)) is not g.compile_now(tool_call_constraint(TOOLS))

    async def together():
        c = tool_call_constraint(TOOLS, "get_time")
        return await asyncio.gather(g.compile(c), g.compile(c))

    a, b = asyncio.run(together())
    assert a is b
    for _ in range(2):  # a refused schema is not cached: the error names it every time
        with pytest.raises(ConstraintError, match='Unsupported type "strin"'):
            g.compile_now(json_constraint({"type": "strin"}))
