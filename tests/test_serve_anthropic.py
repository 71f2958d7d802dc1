"""The Anthropic Messages protocol over real HTTP with the real ``anthropic`` SDK.

A tiny scripted model (``Served.say``) answers; every prompt the server sends to the engine is read
back from ``--log-token-ids`` and compared with the chat template's rendering of the conversation
written by hand in OpenAI's shape (the one internal form), so each rule of the conversion is
checked token for token: billing header dropped whatever its ``cch=``, one-block lists equal to
strings, ``cache_control`` never rendered, inline system messages where they stand, tool results.
A Claude-Code-shaped session (moving ``cache_control``, list/string flips, a changing ``cch=``)
reads the whole previous turn from the cache on every turn after the first.
"""

import json

import anthropic
import httpx
import pytest

from radixcache.integrations.serve.protocols.anthropic import messages as anthropic_messages
from radixcache.integrations.serve.history.forms import history_tokens
from radixcache.integrations.serve.telemetry.token_log import read_token_log
from serve_helpers import TOOLS_TEMPLATE, Served, keyed_served, write_model_dir

BS = 16
MODEL = "tiny-smol"
GREEDY = {"temperature": 0}
EPHEMERAL = {"type": "ephemeral"}
AGENT_SDK = "You are a Claude agent, built on Anthropic's Claude Agent SDK."
SYSTEM = "You are a terse test agent. Answer briefly, run the tools you are given when asked to. " * 2
BASH = {"name": "Bash", "description": "Run a shell command.",
        "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}
BASH_OPENAI = {"type": "function", "function": {"name": "Bash", "description": BASH["description"],
                                                "parameters": BASH["input_schema"]}}
CALL = '<tool_call>{"name": "Bash", "arguments": {"command": "echo hi"}}</tool_call>'
# the model's own spacing, unlike the input the client echoes back (json.dumps): the history form
# must be rendered from the echo, not from the model's text
COMPACT_CALL = '<tool_call>{"name": "Bash", "arguments": {"command":"echo hi"}}</tool_call>'


@pytest.fixture(scope="module", params=["smollm2", "tools_template"])
def served(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param) / MODEL
    template = TOOLS_TEMPLATE if request.param == "tools_template" else None
    write_model_dir(directory, max_positions=2048, chat_template=template, weights=True)
    server = Served(directory, log_token_ids=directory.parent / "tokens.jsonl")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    server = keyed_served(tmp_path_factory, "secret")
    yield server
    server.stop()


def client(served, **kwargs) -> anthropic.Anthropic:
    return served.anthropic(**kwargs)


def last_prompt(served) -> list:
    return read_token_log(served.options.log_token_ids)[-1]["prompt_ids"]


def billing(cch: str) -> dict:
    return {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.327.df5; cc_entrypoint=sdk-cli; cch={cch};"}


def test_create_stream_and_count_tokens_agree(served):
    system = [billing("89fcf"), {"type": "text", "text": AGENT_SDK, "cache_control": EPHEMERAL},
              {"type": "text", "text": SYSTEM, "cache_control": EPHEMERAL}]
    messages = [{"role": "user", "content": [{"type": "text", "text": "Say hello.", "cache_control": EPHEMERAL}]}]
    expected = [{"role": "system", "content": AGENT_SDK + "\n\n" + SYSTEM}, {"role": "user", "content": "Say hello."}]
    served.say(expected, "Hello there, friend.")
    with client(served) as c:
        counted = c.messages.count_tokens(model=MODEL, system=system, messages=messages).input_tokens
        body = c.messages.create(model=MODEL, max_tokens=64, system=system, messages=messages, extra_body=GREEDY)
        assert last_prompt(served) == list(served.render(expected))
        with c.messages.stream(model=MODEL, max_tokens=64, system=system, messages=messages, extra_body=GREEDY) as s:
            streamed_text = "".join(s.text_stream)
            streamed = s.get_final_message()
    assert counted == len(served.render(expected))
    for message in (body, streamed):
        assert [b.type for b in message.content] == ["text"] and message.content[0].text == "Hello there, friend."
        assert message.stop_reason == "end_turn" and message.stop_sequence is None and message.role == "assistant"
        usage = message.usage
        assert usage.input_tokens + usage.cache_read_input_tokens == counted and usage.cache_creation_input_tokens == 0
        assert usage.output_tokens == len(served.state.tokenizer("Hello there, friend.")["input_ids"]) + 1
    assert streamed_text == "Hello there, friend."
    assert streamed.usage.cache_read_input_tokens >= (counted - 1) // BS * BS  # the same prompt again
    served.assert_clean()


def sse_events(served, body: dict) -> list:
    events = []
    with httpx.stream("POST", served.base_url + "/v1/messages?beta=true", json=body, timeout=120,
                      headers={"x-api-key": "none", "anthropic-version": "2023-06-01",
                               "anthropic-beta": "claude-code-20250219"}) as response:
        assert response.status_code == 200
        name = None
        for line in response.iter_lines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                data = json.loads(line.removeprefix("data: "))
                assert data["type"] == name  # every event has its event: line
                events.append(data)
                name = None
    return events


def test_the_stream_has_every_event_with_usage_from_the_start(served, monkeypatch):
    monkeypatch.setattr(anthropic_messages, "PING_S", 0.0001)  # every wait for the prefill is long
    messages = [{"role": "user", "content": "Run it."}]
    served.say(messages, "Sure. " + CALL, tools=[BASH_OPENAI])
    events = sse_events(served, {"model": MODEL, "max_tokens": 64, "stream": True, "tools": [BASH],
                                 "messages": messages, "temperature": 0})
    kinds = [e["type"] for e in events]
    start = kinds.index("message_start")
    assert start >= 1 and set(kinds[:start]) == {"ping"}
    assert kinds[start + 1:] == ["ping", "content_block_start"] + ["content_block_delta"] * (kinds.count("content_block_delta") - 1) + [
        "content_block_stop", "content_block_start", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop"]
    blocks = [e["content_block"] for e in events if e["type"] == "content_block_start"]
    assert blocks[0] == {"type": "text", "text": ""} and blocks[1]["type"] == "tool_use" and blocks[1]["input"] == {}
    text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta" and e["index"] == 0)
    assert text == "Sure. "  # the text before the call, as chat streams it
    partial = [e["delta"] for e in events if e["type"] == "content_block_delta" and e["index"] == 1]
    assert partial[0]["type"] == "input_json_delta" and json.loads(partial[0]["partial_json"]) == {"command": "echo hi"}
    first, delta = events[start]["message"]["usage"], events[-2]
    assert delta["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    for field in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"):
        assert delta["usage"][field] == first[field]
    assert first["input_tokens"] + first["cache_read_input_tokens"] == len(last_prompt(served))
    assert delta["usage"]["output_tokens"] == len(read_token_log(served.options.log_token_ids)[-1]["output_ids"][0])
    served.assert_clean()


def test_stop_sequences_and_max_tokens(served):
    messages = [{"role": "user", "content": "Count."}]
    with client(served) as c:
        served.say(messages, "one two STOP three four")
        body = c.messages.create(model=MODEL, max_tokens=64, messages=messages, stop_sequences=["XX", "STOP"],
                                 extra_body=GREEDY)
        assert body.stop_reason == "stop_sequence" and body.stop_sequence == "STOP"
        assert body.content[0].text == "one two "
        with c.messages.stream(model=MODEL, max_tokens=64, messages=messages, stop_sequences=["STOP"],
                               extra_body=GREEDY) as s:
            streamed = s.get_final_message()
        assert streamed.stop_reason == "stop_sequence" and streamed.stop_sequence == "STOP"
        cut = c.messages.create(model=MODEL, max_tokens=3, messages=messages, extra_body=GREEDY)
        assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3
        # Claude Code's max_tokens is 32000 on every request: a ceiling, clamped to what the context leaves
        whole = c.messages.create(model=MODEL, max_tokens=32000, messages=messages, extra_body=GREEDY)
        assert whole.stop_reason == "end_turn" and whole.content[0].text == "one two STOP three four"
    served.assert_clean()


def test_a_tool_round_trip_renders_like_chat_and_hits_the_previous_turn(served):
    """tool_use comes back with its input; the tool_result (a string, then blocks with is_error)
    renders as chat's tool message; the next turn reads the whole previous turn from the cache."""
    user = {"role": "user", "content": "Please run: echo hi"}
    expected = [user]
    served.say(expected, COMPACT_CALL, tools=[BASH_OPENAI])
    with client(served) as c:
        first = c.messages.create(model=MODEL, max_tokens=64, tools=[BASH], messages=[user], extra_body=GREEDY)
        assert first.stop_reason == "tool_use" and len(first.content) == 1
        call = first.content[0]
        assert call.type == "tool_use" and call.name == "Bash" and call.input == {"command": "echo hi"}
        reply = {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": "Bash", "arguments": '{"command": "echo hi"}'}}]}
        previous = history_tokens(served.state.renderer, expected + [reply], [BASH_OPENAI])
        results = [{"type": "tool_result", "tool_use_id": call.id, "content": "hi"},
                   {"type": "tool_result", "tool_use_id": call.id, "is_error": True,
                    "content": [{"type": "text", "text": "exit 1"}, {"type": "text", "text": "no such file"}]}]
        messages = [user, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                    {"role": "user", "content": results + [{"type": "text", "text": "And now?"}]}]
        expected = expected + [reply, {"role": "tool", "tool_call_id": call.id, "content": "hi"},
                               {"role": "tool", "tool_call_id": call.id, "content": "Error: exit 1\n\nno such file"},
                               {"role": "user", "content": "And now?"}]
        served.say(expected, "It printed hi.", tools=[BASH_OPENAI])
        served.quiet()  # the reply's history form is precomputed (a client faster than that computes it itself)
        with c.messages.stream(model=MODEL, max_tokens=64, tools=[BASH], messages=messages, extra_body=GREEDY) as s:
            second = s.get_final_message()
    prompt = last_prompt(served)
    assert prompt == list(served.render(expected, [BASH_OPENAI]))
    assert second.content[0].text == "It printed hi." and second.stop_reason == "end_turn"
    assert prompt[:len(previous)] == list(previous)
    assert second.usage.cache_read_input_tokens >= min(len(previous), len(prompt) - 1) // BS * BS > 0
    served.assert_clean()


def claude_system(cch: str) -> list:
    return [billing(cch), {"type": "text", "text": AGENT_SDK, "cache_control": EPHEMERAL},
            {"type": "text", "text": SYSTEM, "cache_control": EPHEMERAL}]


def marked(text: str) -> list:
    return [{"type": "text", "text": text, "cache_control": EPHEMERAL}]


def test_a_claude_code_session_reads_each_previous_turn_from_the_cache(served):
    """As Claude Code sends it: the billing block's cch= differs per request, cache_control moves to
    the newest message, a one-block list becomes a string once its marker moves on, an inline
    system message follows the first user turn, a tool result stays a list."""
    renderer = served.state.renderer
    inline = renderer.render_text([{"role": "user", "content": "u"}, {"role": "system", "content": "\x1eS"}]).count("\x1eS")
    date = "Today's date is 2026-12-02."
    date_expected = {"role": "system", "content": date} if inline else {"role": "user", "content": f"<system>\n{date}\n</system>"}
    expected = [{"role": "system", "content": AGENT_SDK + "\n\n" + SYSTEM}, {"role": "user", "content": "Please run: echo hi"},
                date_expected]
    turns = [[{"role": "user", "content": marked("Please run: echo hi")}, {"role": "system", "content": marked(date)}]]
    replies = [CALL, "It printed hi, all done now.", "Bye for now, and thanks.", "Anything else?"]
    seen, previous = [], None
    with client(served) as c:
        for turn, text in enumerate(replies):
            messages = turns[-1]
            served.say(expected, text, tools=[BASH_OPENAI])
            kwargs = dict(model=MODEL, max_tokens=32000, system=claude_system(f"{turn * 7919:05x}"), tools=[BASH],
                          messages=messages, metadata={"user_id": json.dumps({"session_id": "s-1"})}, extra_body=GREEDY)
            if turn % 2:
                with c.messages.stream(**kwargs) as s:
                    message = s.get_final_message()
            else:
                message = c.messages.create(**kwargs)
            prompt = last_prompt(served)
            assert prompt == list(served.render(expected, [BASH_OPENAI]))
            cached = message.usage.cache_read_input_tokens
            assert message.usage.input_tokens + cached == len(prompt)
            if previous is not None:
                assert prompt[:len(previous)] == list(previous)
                seen.append((cached, min(len(previous), len(prompt) - 1) // BS * BS))
            # the reply as Claude Code echoes it, and the turn it sends next
            echoed = [b.model_dump(exclude_none=True) for b in message.content]
            if message.stop_reason == "tool_use":
                call = message.content[0]
                reply = {"role": "assistant", "content": None, "tool_calls": [{"id": call.id, "type": "function", "function": {
                    "name": "Bash", "arguments": json.dumps(call.input)}}]}
                nxt = [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "hi",
                                                     "is_error": False, "cache_control": EPHEMERAL}]}]
                follow = [{"role": "tool", "tool_call_id": call.id, "content": "hi"}]
            else:
                assert message.content[0].text == text
                reply = {"role": "assistant", "content": text}
                nxt = [{"role": "user", "content": marked(f"Next step {turn}.")}]
                follow = [{"role": "user", "content": f"Next step {turn}."}]
            previous = history_tokens(renderer, expected + [reply], [BASH_OPENAI])
            flipped = [unmark(m) for m in messages]
            turns.append(flipped + [{"role": "assistant", "content": echoed}] + nxt)
            expected = expected + [reply] + follow
            served.quiet()
    assert len(seen) == 3
    for cached, ideal in seen:
        assert ideal > len(served.render(expected[:2], [BASH_OPENAI])) // 2 and cached >= ideal
    served.assert_clean()


def unmark(message: dict) -> dict:
    """The message as Claude Code resends it once the marker moved on: a one-text-block list becomes
    a string; other lists lose only their cache_control."""
    content = message["content"]
    if isinstance(content, list) and len(content) == 1 and content[0]["type"] == "text":
        return {**message, "content": content[0]["text"]}
    if isinstance(content, list):
        return {**message, "content": [{k: v for k, v in b.items() if k != "cache_control"} for b in content]}
    return message
