"""``/v1/responses`` over real HTTP with the ``openai`` SDK's ``client.responses``, on the embedded
SmolLM2 template: stateless items (echoed ids, namespace and hosted tools), stored responses and
``previous_response_id`` (token-exact appends, proved against the whole render), streaming events,
GET / DELETE, and every error path. The model is told what to say (``Served.say``)."""

import json
import logging

import httpx
import openai
import pytest

from radixcache.integrations.serve.history.forms import history_tokens
from radixcache.integrations.serve.protocols.openai.responses_request import function_tools
from radixcache.integrations.serve.telemetry.token_log import read_token_log
from serve_helpers import Served, metric, write_model_dir

BS = 16
KEY = "test-key"
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
          "strict": False},
         {"type": "namespace", "name": "agents", "description": "Sub-agents.",
          "tools": [{"type": "function", "name": "spawn_agent", "parameters": {"type": "object", "properties": {}}}]},
         {"type": "web_search", "external_web_access": True}]
CHAT_TOOLS = function_tools(TOOLS)[0]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    directory = tmp_path_factory.mktemp("responses") / "tiny-smol"
    write_model_dir(directory, max_positions=2048, weights=True)
    log = directory.parent / "tokens.jsonl"
    server = Served(directory, served_model_names=("m",), api_keys=(KEY,), log_token_ids=log)
    server.log = log
    yield server
    server.stop()


@pytest.fixture
def client(served):
    served.model.script = {}  # no test sees the reply another test told the model to say
    return served.client(api_key=KEY)


def last_logged(served, n=1):
    served.quiet()
    return read_token_log(served.log)[-n:]


def say_ids(served, messages, ids, tools=None, prompt_len=None):
    """Make the next reply to ``messages`` (or to any prompt of ``prompt_len`` tokens) be exactly
    the token ids ``ids`` (then EOS)."""
    prompt_len = prompt_len or len(served.render(messages, tools))
    served.model.script = {prompt_len - 1 + i: t for i, t in enumerate(list(ids) + [2])}


def appended_len(served, stored_ids, messages):
    """The length of ``stored_ids`` plus the tokens of the rest of the whole render's text."""
    past = served.state.tokenizer.decode(stored_ids, skip_special_tokens=False)
    return len(stored_ids) + len(tokens(served, served.state.renderer.render(messages).text[len(past):]))


def tokens(served, text):
    return served.state.tokenizer(text, add_special_tokens=False)["input_ids"]


def test_a_string_input_is_one_user_message_and_usage_counts_the_rendered_prompt(served, client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}]
    served.say(messages, "Hi!")
    r = client.responses.create(model="m", input="Say hi.", instructions="Be brief.", temperature=0)
    assert r.status == "completed" and r.output_text == "Hi!" and r.id.startswith("resp")
    [item] = r.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    assert r.usage.input_tokens == len(served.render(messages))
    assert r.usage.output_tokens == len(tokens(served, "Hi!")) + 1
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.instructions == "Be brief." and r.store is True
    served.assert_clean()


def test_echoed_items_render_like_the_same_chat_and_hosted_tools_are_dropped(served, client, caplog):
    """Codex's shape: a developer message first, items with ids and statuses, a function call and
    its output; a namespace tool flattened, web_search dropped: the prompt is chat's prompt."""
    caplog.set_level(logging.DEBUG, logger="radixcache.serve")
    items = [{"type": "message", "id": "msg_a", "role": "developer", "content": [{"type": "input_text", "text": "Terse."}]},
             {"type": "message", "id": "msg_b", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
             {"type": "function_call", "status": "completed", "id": "fc_1", "name": "get_weather",
              "arguments": '{"city": "Paris"}', "call_id": "call_1"},
             {"type": "function_call_output", "id": "fco_1", "call_id": "call_1", "output": "sunny"},
             {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "opaque"}]
    chat = [{"role": "developer", "content": "Terse."}, {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    assert [t["function"]["name"] for t in CHAT_TOOLS] == ["get_weather", "spawn_agent"]
    served.say(chat, "Sunny.", CHAT_TOOLS)
    r = client.responses.create(model="m", input=items, tools=TOOLS, tool_choice="auto", parallel_tool_calls=True,
                                store=False, include=["reasoning.encrypted_content"], reasoning={"summary": "auto"},
                                prompt_cache_key="session-1", temperature=0)
    assert r.output_text == "Sunny."
    assert r.usage.input_tokens == len(served.render(chat, CHAT_TOOLS))
    assert last_logged(served)[0]["prompt_ids"] == list(served.render(chat, CHAT_TOOLS))
    assert "dropped hosted tool 'web_search'" in caplog.text
    served.assert_clean()


def test_a_stateless_tool_round_trip_hits_the_replys_history_form(served, client):
    """The model writes its call unlike the template (no spaces): the history form is precomputed,
    and the echoed function_call (our ids, our arguments) renders to exactly that form."""
    question = [{"role": "user", "content": "Weather in Oslo?"}]
    served.say(question, '<tool_call>{"name":"get_weather","arguments":{"city": "Oslo"}}</tool_call>', CHAT_TOOLS)
    first = client.responses.create(model="m", input="Weather in Oslo?", tools=TOOLS, store=False, temperature=0)
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.arguments == '{"city": "Oslo"}' and call.call_id.startswith("call_")
    reply = {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.call_id, "type": "function", "function": {"name": "get_weather", "arguments": call.arguments}}]}
    form = history_tokens(served.state.renderer, question + [reply], CHAT_TOOLS)
    served.quiet()
    echoed = [{"role": "user", "content": "Weather in Oslo?"}, call.model_dump(exclude_none=True),
              {"type": "function_call_output", "call_id": call.call_id, "output": "rain"}]
    nxt = question + [reply, {"role": "tool", "tool_call_id": call.call_id, "content": "rain"}]
    served.say(nxt, "Rain.", CHAT_TOOLS)
    second = client.responses.create(model="m", input=echoed, tools=TOOLS, store=False, temperature=0)
    prompt = served.render(nxt, CHAT_TOOLS)
    assert second.output_text == "Rain." and prompt[:len(form)] == form
    assert second.usage.input_tokens_details.cached_tokens >= len(form) // BS * BS
    served.assert_clean()


def test_a_namespaced_call_names_its_namespace(served, client):
    question = [{"role": "user", "content": "Spawn."}]
    served.say(question, '<tool_call>{"name": "spawn_agent", "arguments": {}}</tool_call>', CHAT_TOOLS)
    r = client.responses.create(model="m", input="Spawn.", tools=TOOLS, temperature=0)
    [call] = r.output
    assert call.name == "spawn_agent" and call.namespace == "agents"
    served.assert_clean()


def test_previous_response_id_appends_only_the_new_items_to_the_stored_ids(served, client):
    """The reply is made of tokens the tokenizer would not choose ("H" + "ello"): the next prompt
    keeps them (the stored ids are its prefix), decodes to the whole render, and hits all of them."""
    first_turn = [{"role": "user", "content": "Greet me."}]
    reply_ids = tokens(served, "H") + tokens(served, "ello there")
    assert reply_ids != tokens(served, "Hello there")
    say_ids(served, first_turn, reply_ids)
    r1 = client.responses.create(model="m", input="Greet me.", temperature=0)
    assert r1.output_text == "Hello there"
    stored = last_logged(served)[0]
    stored_ids = stored["prompt_ids"] + stored["output_ids"][0]
    convo = first_turn + [{"role": "assistant", "content": "Hello there"}, {"role": "user", "content": "Again."}]
    say_ids(served, convo, tokens(served, "Hi."), prompt_len=appended_len(served, stored_ids, convo))
    r2 = client.responses.create(model="m", input=[{"role": "user", "content": "Again."}],
                                 previous_response_id=r1.id, temperature=0)
    prompt = last_logged(served)[0]["prompt_ids"]
    whole = served.state.renderer.render(convo)
    assert prompt[:len(stored_ids)] == stored_ids and prompt != list(whole.token_ids)
    assert served.state.tokenizer.decode(prompt, skip_special_tokens=False) == whole.text
    assert r2.usage.input_tokens_details.cached_tokens >= (len(stored_ids) - 1) // BS * BS
    assert r2.output_text == "Hi." and r2.previous_response_id == r1.id
    # a third turn chains on the second's stored ids
    convo3 = convo + [{"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Bye."}]
    say_ids(served, convo3, tokens(served, "Bye."), prompt_len=appended_len(served, prompt + tokens(served, "Hi.") + [2], convo3))
    r3 = client.responses.create(model="m", input="Bye.", previous_response_id=r2.id, temperature=0)
    third = last_logged(served)[0]["prompt_ids"]
    assert third[:len(prompt)] == prompt and r3.output_text == "Bye."
    assert served.state.tokenizer.decode(third, skip_special_tokens=False) == served.state.renderer.render(convo3).text
    served.assert_clean()


def test_changed_instructions_render_anew_and_report_the_short_hit(served, client):
    served.say([{"role": "system", "content": "Old."}, {"role": "user", "content": "One."}], "A.")
    r1 = client.responses.create(model="m", input="One.", instructions="Old.", temperature=0)
    before = metric(served.metrics(), "prefix_cache_short_hits_total", reason="previous_response_rendered_anew")
    convo = [{"role": "system", "content": "New."}, {"role": "user", "content": "One."},
             {"role": "assistant", "content": "A."}, {"role": "user", "content": "Two."}]
    served.say(convo, "B.")
    r2 = client.responses.create(model="m", input="Two.", instructions="New.", previous_response_id=r1.id,
                                 temperature=0)
    assert r2.output_text == "B." and last_logged(served)[0]["prompt_ids"] == list(served.render(convo))
    after = metric(served.metrics(), "prefix_cache_short_hits_total", reason="previous_response_rendered_anew")
    assert after == before + 1
    # without instructions the old ones do not carry over either
    convo = convo[1:3] + [{"role": "user", "content": "Three."}]
    served.say(convo, "C.")
    r3 = client.responses.create(model="m", input="Three.", previous_response_id=r1.id, temperature=0)
    assert r3.output_text == "C." and last_logged(served)[0]["prompt_ids"] == list(served.render(convo))
    served.assert_clean()


def test_a_reply_the_template_writes_differently_is_rendered_anew(served, client):
    """The model's call text is not the template's: appending to its tokens would not be the
    conversation's text, so the prompt is the whole render (the history form makes it a hit)."""
    question = [{"role": "user", "content": "Weather in Rome?"}]
    served.say(question, '<tool_call>{"name":"get_weather","arguments":{"city":"Rome"}}</tool_call>', CHAT_TOOLS)
    r1 = client.responses.create(model="m", input="Weather in Rome?", tools=TOOLS, temperature=0)
    [call] = r1.output
    reply = {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.call_id, "type": "function", "function": {"name": "get_weather", "arguments": call.arguments}}]}
    convo = question + [reply, {"role": "tool", "tool_call_id": call.call_id, "content": "hot"}]
    served.quiet()
    served.say(convo, "Hot.", CHAT_TOOLS)
    before = metric(served.metrics(), "prefix_cache_short_hits_total", reason="previous_response_rendered_anew")
    r2 = client.responses.create(model="m", input=[{"type": "function_call_output", "call_id": call.call_id,
                                                    "output": "hot"}], tools=TOOLS, previous_response_id=r1.id,
                                 temperature=0)
    assert r2.output_text == "Hot." and last_logged(served)[0]["prompt_ids"] == list(served.render(convo, CHAT_TOOLS))
    form = history_tokens(served.state.renderer, question + [reply], CHAT_TOOLS)
    assert r2.usage.input_tokens_details.cached_tokens >= len(form) // BS * BS
    assert metric(served.metrics(), "prefix_cache_short_hits_total", reason="previous_response_rendered_anew") == before + 1
    served.assert_clean()


def test_get_delete_and_unknown_ids(served, client):
    served.say([{"role": "user", "content": "Keep."}], "Kept.")
    r = client.responses.create(model="m", input="Keep.", temperature=0)
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == "Kept." and got.usage.input_tokens == r.usage.input_tokens
    client.responses.delete(r.id)
    for call in (lambda: client.responses.retrieve(r.id), lambda: client.responses.delete(r.id)):
        with pytest.raises(openai.NotFoundError, match=r.id):
            call()
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model="m", input="x", previous_response_id="resp_nope")
    assert err.value.body["param"] == "previous_response_id" and "resp_nope" in err.value.body["message"]
    unstored = client.responses.create(model="m", input="Keep.", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="m", input="x", previous_response_id=unstored.id)
    served.assert_clean()


def test_a_stored_response_is_found_only_with_its_own_key_and_the_server_cap_holds(tmp_path):
    directory = write_model_dir(tmp_path / "tiny", max_positions=512, weights=True)
    server = Served(directory, api_keys=("a", "b"), max_output_tokens=3)
    try:
        a, b = server.client(api_key="a"), server.client(api_key="b")
        capped = a.responses.create(input="Ramble.", max_output_tokens=100)  # --max-output-tokens 3 wins
        assert capped.status == "incomplete" and capped.usage.output_tokens == 3
        r = a.responses.create(input="hi", max_output_tokens=2)
        assert a.responses.retrieve(r.id).id == r.id
        with pytest.raises(openai.NotFoundError):
            b.responses.retrieve(r.id)
        with pytest.raises(openai.NotFoundError):
            b.responses.create(input="x", previous_response_id=r.id, max_output_tokens=2)
    finally:
        server.stop()


def test_a_streamed_response_has_every_event_in_order(served, client):
    messages = [{"role": "user", "content": "Stream."}]
    served.say(messages, "Streamed text here.")
    with client.responses.stream(model="m", input="Stream.", temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Streamed text here."
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [(i.id, i.content[0].text) for i in done] == [(i.id, i.content[0].text) for i in final.output]
    assert final.output_text == "Streamed text here." and final.usage.input_tokens == len(served.render(messages))
    assert client.responses.retrieve(final.id).output_text == final.output_text
    served.assert_clean()


def test_a_streamed_tool_call_has_its_argument_events(served, client):
    messages = [{"role": "user", "content": "Weather in Lima?"}]
    served.say(messages, '<tool_call>{"name": "get_weather", "arguments": {"city": "Lima"}}</tool_call>', CHAT_TOOLS)
    with client.responses.stream(model="m", input="Weather in Lima?", tools=TOOLS, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    assert events[4].arguments == '{"city": "Lima"}' and final.output[0].call_id == events[5].item.call_id
    served.assert_clean()


def test_tool_choice_none_renders_the_tools_but_parses_no_call_and_no_tools_ignores_it(served, client):
    messages = [{"role": "user", "content": "No calls."}]
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    served.say(messages, text, CHAT_TOOLS)
    r = client.responses.create(model="m", input="No calls.", tools=TOOLS, tool_choice="none", temperature=0)
    assert [i.type for i in r.output] == ["message"] and r.output_text == text
    served.say(messages, "Fine.")
    r = client.responses.create(model="m", input="No calls.", tool_choice="required", temperature=0)
    assert r.output_text == "Fine." and r.tool_choice == "auto"
    served.assert_clean()


def test_the_output_cap_ends_incomplete(served, client):
    r = client.responses.create(model="m", input="Ramble.", max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    raw = httpx.post(served.base_url + "/v1/responses", headers={"authorization": f"Bearer {KEY}"}, timeout=60,
                     json={"model": "m", "input": "Ramble.", "max_output_tokens": 3, "stream": True})
    kinds = [json.loads(line[6:])["type"] for line in raw.text.splitlines() if line.startswith("data: ")]
    assert kinds[-1] == "response.incomplete" and "event: response.incomplete" in raw.text
    served.assert_clean()


@pytest.mark.parametrize("body, status, param", [
    ({"input": []}, 400, "input"),
    ({"input": [{"type": "computer_call", "id": "x"}]}, 400, "input.0"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400, "input.0.content"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, 400, "input.0.call_id"),
    ({"input": "x", "tool_choice": "sometimes", "tools": TOOLS}, 400, "tool_choice"),
    ({"input": "x", "tool_choice": {"type": "function", "name": "nope"}, "tools": TOOLS}, 400, None),
    ({"input": "x", "tools": [{"type": "function", "name": "f"}, {"type": "function", "name": "f"}]}, 400, None),
    ({"input": "x", "background": True}, 400, None),
    ({"input": "x", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"input": "x", "temperature": 3}, 400, "temperature"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a"}}}, 400, "text.format"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": "strin"}}}}, 400,
     "text.format"),
    ({"input": "x", "tool_choice": "required", "tools": [{"type": "function", "name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}]}, 400, "tools"),
    ({"input": "x", "prompt_cache_retention": "forever"}, 400, "prompt_cache_retention"),
    ({"input": "x", "previous_response_id": "resp_gone"}, 404, "previous_response_id"),
    ({"input": "x", "model": "other"}, 404, "model"),
    ({"input": "x " * 3000}, 400, "input"),
])
def test_bad_requests_get_openai_errors(served, client, body, status, param):
    r = httpx.post(served.base_url + "/v1/responses", json=body, headers={"authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["param"] == param
    served.assert_clean()


def test_a_wrong_key_and_a_bad_body(served):
    url = served.base_url + "/v1/responses"
    assert httpx.post(url, json={"input": "x"}, headers={"authorization": "Bearer no"}).status_code == 401
    assert httpx.get(url + "/resp_x", headers={"x-api-key": "no"}).status_code == 401
    r = httpx.post(url, content=b"{", headers={"authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(url, json=[1], headers={"authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]


def test_a_json_schema_format_is_enforced(served, client):
    """``text.format`` json_schema through the grammar: the tiny random model writes a valid
    document (its one string bounded, so the forced choices end within the cap)."""
    schema = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 8}}, "required": ["word"],
              "additionalProperties": False}
    r = client.responses.create(model="m", input="A word.", max_output_tokens=60, temperature=0,
                                text={"format": {"type": "json_schema", "name": "w", "schema": schema, "strict": True}})
    assert r.status == "completed" and isinstance(json.loads(r.output_text)["word"], str)


def test_parallel_tool_calls_false_keeps_the_first_call_under_auto(served, client):
    question = [{"role": "user", "content": "Weather in Oslo and Rome?"}]
    two = ('<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>\n'
           '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>')
    served.say(question, two, CHAT_TOOLS)
    both = client.responses.create(model="m", input="Weather in Oslo and Rome?", tools=TOOLS, store=False,
                                   temperature=0)
    one = client.responses.create(model="m", input="Weather in Oslo and Rome?", tools=TOOLS, store=False,
                                  temperature=0, parallel_tool_calls=False)
    assert [json.loads(i.arguments)["city"] for i in both.output] == ["Oslo", "Rome"]
    assert [json.loads(i.arguments)["city"] for i in one.output] == ["Oslo"]
    served.assert_clean()


def test_a_required_tool_choice_is_enforced(served, client):
    bounded = [{"type": "function", "name": "get_weather", "description": "The weather in a city.",
                "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                               "required": ["city"]}}]
    r = client.responses.create(model="m", input="Anything.", tools=bounded, tool_choice="required",
                                parallel_tool_calls=False, max_output_tokens=120, temperature=0)
    assert [i.type for i in r.output] == ["function_call"]


def test_a_model_failure_mid_stream_ends_with_response_failed(tmp_path):
    """The model raises after the first tokens: the stream ends with ``response.failed`` carrying
    the error, nothing is stored, nothing leaks, and the server serves the next request."""
    directory = write_model_dir(tmp_path / "tiny", max_positions=512, weights=True)
    server = Served(directory)
    forward = server.model.forward

    def failing(*args, **kwargs):
        positions = kwargs.get("position_ids")
        if positions is not None and positions.numel() == 1 and int(positions.max()) > 40:
            raise RuntimeError("the device fell over")
        return forward(*args, **kwargs)

    try:
        server.model.forward = failing
        raw = httpx.post(server.base_url + "/v1/responses", timeout=60,
                         json={"input": "Tell me a story.", "max_output_tokens": 50, "stream": True})
        events = [json.loads(line[6:]) for line in raw.text.splitlines() if line.startswith("data: ")]
        assert raw.status_code == 200 and events[-1]["type"] == "response.failed", raw.text
        failed = events[-1]["response"]
        assert failed["status"] == "failed" and "the device fell over" in failed["error"]["message"]
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        assert httpx.get(server.base_url + f"/v1/responses/{failed['id']}").status_code == 404
        server.assert_clean()
        server.model.forward = forward
        assert server.client().responses.create(input="Again.", max_output_tokens=3).status == "incomplete"
    finally:
        server.model.forward = forward
        server.stop()


def test_a_client_that_leaves_mid_stream_stores_nothing_and_holds_nothing(served, client):
    with httpx.stream("POST", served.base_url + "/v1/responses", headers={"authorization": f"Bearer {KEY}"},
                      json={"input": "Ramble on.", "max_output_tokens": 400, "stream": True}, timeout=60) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
    rid = json.loads(first[6:])["response"]["id"]
    served.assert_clean()
    assert httpx.get(served.base_url + f"/v1/responses/{rid}", headers={"x-api-key": KEY}).status_code == 404
