"""The Anthropic Messages request -> internal conversation rules, one by one (no server)."""

import json

import pytest

from radixcache.integrations.serve.protocols.anthropic.convert import (conversation_of, echoed_reply, renders_inline_system,
                                                             reply_blocks, retain_seconds, tool_mode)
from radixcache.integrations.serve.protocols.anthropic.requests import parse_messages_request
from radixcache.integrations.serve.requests.chat_template import ChatRenderer
from radixcache.integrations.serve.errors import APIError
from serve_helpers import TOOLS_TEMPLATE, embedded_tokenizer, tokenizer_with_template

E = {"type": "ephemeral"}
TOOL = {"name": "Bash", "description": "Run.", "input_schema": {"type": "object", "properties": {}}}


def request(**body):
    return parse_messages_request({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], **body})


def test_system_blocks_join_and_the_billing_block_is_dropped_whatever_it_says():
    bodies = [request(system=[{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.327.df5; cch={cch};"},
                              {"type": "text", "text": "A", "cache_control": E}, {"type": "text", "text": "B"}])
              for cch in ("89fcf", "85c57")]
    first, second = (conversation_of(b, True).messages for b in bodies)
    assert first == second == [{"role": "system", "content": "A\n\nB"}, {"role": "user", "content": "hi"}]
    assert conversation_of(request(system="A\n\nB"), True).messages == first


def test_a_one_block_list_is_the_string_it_equals_and_cache_control_is_never_rendered():
    as_list = request(messages=[{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": E}]}])
    assert conversation_of(as_list, True) == conversation_of(request(), True)
    two = request(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    assert conversation_of(two, True).messages == [{"role": "user", "content": "a\n\nb"}]


def test_tool_use_and_tool_results_become_chat_messages_in_order():
    body = request(tools=[TOOL], messages=[
        {"role": "user", "content": "run"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "Let me run it.", "signature": "s"},
                                          {"type": "redacted_thinking", "data": "opaque"},
                                          {"type": "text", "text": "Running."},
                                          {"type": "tool_use", "id": "t1", "name": "Bash", "input": {"c": "ls", "n": "é"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "a.txt"},
                                     {"type": "tool_result", "tool_use_id": "t1", "is_error": True,
                                      "content": [{"type": "text", "text": "denied"}]},
                                     {"type": "text", "text": "go on"}]}])
    conversation = conversation_of(body, True)
    assert conversation.messages == [
        {"role": "user", "content": "run"},
        {"role": "assistant", "content": "Running.", "reasoning_content": "Let me run it.",
         "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "Bash", "arguments": '{"c": "ls", "n": "é"}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "a.txt"},
        {"role": "tool", "tool_call_id": "t1", "content": "Error: denied"},
        {"role": "user", "content": "go on"}]
    assert conversation.tools == [{"type": "function", "function": {"name": "Bash", "description": "Run.",
                                                                    "parameters": TOOL["input_schema"]}}]


def test_inline_system_messages_stand_where_they_are_or_become_a_marked_user_turn():
    plain = ChatRenderer(embedded_tokenizer())
    first_only = ChatRenderer(tokenizer_with_template(TOOLS_TEMPLATE))  # writes only a leading system message
    assert renders_inline_system(plain) and not renders_inline_system(first_only)
    body = request(system="S", messages=[{"role": "user", "content": "hi"},
                                         {"role": "system", "content": [{"type": "text", "text": "date", "cache_control": E}]},
                                         {"role": "user", "content": "more"}])
    assert conversation_of(body, True).messages[2] == {"role": "system", "content": "date"}
    assert conversation_of(body, False).messages[2] == {"role": "user", "content": "<system>\ndate\n</system>"}
    text = plain.render_text(conversation_of(body, True).messages)
    assert text.index("hi") < text.index("date") < text.index("more")  # never hoisted


def test_the_reply_comes_back_as_the_client_echoes_it():
    reply = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "Bash", "arguments": '{"c":"ls"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "Bash", "arguments": '{"c": "pwd"}'}}]}
    assert reply_blocks(reply) == [{"type": "tool_use", "id": "call_1", "name": "Bash", "input": {"c": "ls"}},
                                   {"type": "tool_use", "id": "call_2", "name": "Bash", "input": {"c": "pwd"}}]
    echoed = echoed_reply(reply)  # the arguments as the echo will write them
    assert echoed == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "Bash", "arguments": json.dumps({"c": "ls"})}},
        {"id": "call_2", "type": "function", "function": {"name": "Bash", "arguments": json.dumps({"c": "pwd"})}}]}
    assert echoed_reply({"role": "assistant", "content": "Hi."}) == {"role": "assistant", "content": "Hi."}


def test_retention_comes_from_the_longest_ttl_or_the_session():
    assert retain_seconds(request(), None) is None
    assert retain_seconds(request(), "session-1") == 300.0
    marked = request(system=[{"type": "text", "text": "S", "cache_control": E}],
                     messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
                         {"type": "text", "text": "x", "cache_control": {"type": "ephemeral", "ttl": "1h"}}]}]}])
    assert retain_seconds(marked, None) == 3600.0
    assert retain_seconds(request(cache_control={"type": "ephemeral", "ttl": "5m"}), None) == 300.0
    assert parse_messages_request({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}],
                                   "metadata": {"user_id": json.dumps({"session_id": "abc"})}}).metadata.session_id == "abc"


def test_tool_choice_modes():
    tools = request(tools=[TOOL], tool_choice={"type": "any", "disable_parallel_tool_use": True})
    mode = tool_mode(tools, conversation_of(tools, True))
    assert mode.parse_tools and mode.single_call and mode.constraint.kind == "tool_calls"
    assert mode.constraint.tool_names == ("Bash",) and not mode.constraint.parallel
    none = request(tools=[TOOL], tool_choice={"type": "none"})
    assert tool_mode(none, conversation_of(none, True)) == (False, None, False)
    bare = request(tool_choice={"type": "any"})
    assert tool_mode(bare, conversation_of(bare, True)) == (False, None, False)
    server_tool = request(tools=[{"type": "web_search_20250305", "name": "web"}, TOOL], tool_choice={"type": "tool", "name": "web"})
    with pytest.raises(APIError, match="forced tool 'web'"):
        tool_mode(server_tool, conversation_of(server_tool, True))
