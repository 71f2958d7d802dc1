"""Chat rendering (the embedded SmolLM2 template, a template with tools support, odd templates) and
tool calls in text: parsing, the canonical form, streaming hold-back."""

import json

import jinja2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixcache.integrations.serve.requests.chat_template import TOOLS_HEADER, ChatRenderer, RenderError
from radixcache.integrations.serve.requests.tool_calls import ToolCallStream, format_tool_call, parse_tool_calls
from serve_helpers import TOOLS_TEMPLATE, embedded_tokenizer, tokenizer_with_template

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city.",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}
SEARCH = {"type": "function", "function": {"name": "web_search", "parameters": {"type": "object"}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Berlin"}'}}
TOOL_TURN = [{"role": "system", "content": "You are Atlas."}, {"role": "user", "content": "Weather?"},
             {"role": "assistant", "content": None, "tool_calls": [CALL]},
             {"role": "tool", "tool_call_id": "call_1", "content": "rain, 9 C"}]
NAMES = {"get_weather", "web_search"}


@pytest.fixture(scope="module")
def smol():
    return ChatRenderer(embedded_tokenizer())


def test_plain_messages_render_exactly_as_the_tokenizer_does(smol):
    tok = embedded_tokenizer()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there!"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Why is the sky blue?"}]
    prompt = smol.render(messages)
    assert prompt.text == tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    want = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert list(prompt.token_ids) == list(want)
    assert not smol.native_tools and not smol.native_tool_calls and smol.tool_role


def test_smollm2_template_breaks_on_null_content_and_the_renderer_does_not(smol):
    with pytest.raises((jinja2.TemplateError, TypeError)):
        embedded_tokenizer().apply_chat_template(TOOL_TURN, tokenize=False)
    text = smol.render_text(TOOL_TURN, [WEATHER, SEARCH])
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nYou are Atlas.\n\n" + TOOLS_HEADER)
    for tool in (WEATHER, SEARCH):  # the schemas, one per line, in the system message
        assert "\n" + json.dumps(tool) + "\n" in system
    assert ("<|im_start|>assistant\n" + format_tool_call("get_weather", '{"city": "Berlin"}') + "<|im_end|>\n"
            "<|im_start|>tool\nrain, 9 C<|im_end|>\n<|im_start|>assistant\n") in text


def test_tools_without_a_system_message_get_one(smol):
    text = smol.render_text([{"role": "user", "content": "Weather?"}], [WEATHER])
    assert text.startswith("<|im_start|>system\n" + TOOLS_HEADER)
    assert "You are a helpful AI assistant" not in text  # the template's default system prompt is replaced


def test_content_parts_and_developer_role(smol):
    text = smol.render_text([{"role": "developer", "content": [{"type": "text", "text": "Rules"}]},
                             {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                             {"role": "assistant", "content": "Sure.", "tool_calls": [CALL]}],
                            add_generation_prompt=False)
    assert text.startswith("<|im_start|>system\nRules<|im_end|>\n<|im_start|>user\nab<|im_end|>\n")
    assert "<|im_start|>assistant\nSure.\n" + format_tool_call("get_weather", '{"city": "Berlin"}') in text


def test_template_with_tools_support_renders_them_itself():
    renderer = ChatRenderer(embedded_tokenizer(), TOOLS_TEMPLATE)
    assert renderer.native_tools and renderer.native_tool_calls and renderer.tool_role
    text = renderer.render_text(TOOL_TURN, [WEATHER])
    assert "# Tools\n<tools>\n" + json.dumps(WEATHER) + "\n</tools>" in text
    assert TOOLS_HEADER not in text
    assert '<|im_start|>assistant\n<tool_call>{"name": "get_weather", "arguments": {"city": "Berlin"}}</tool_call>' in text
    odd = dict(CALL, function={"name": "get_weather", "arguments": "not json"})
    text = renderer.render_text([TOOL_TURN[1], {"role": "assistant", "content": None, "tool_calls": [odd]}])
    assert '"arguments": "not json"}' in text  # arguments that are not JSON reach the template as a string


def test_chat_template_argument_replaces_the_tokenizers():
    renderer = ChatRenderer(embedded_tokenizer(), "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    assert renderer.render_text([{"role": "user", "content": "x"}]) == "[user] x\n"


def test_template_without_a_tool_role_gets_tool_results_as_user_messages():
    strict = ("{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
              "{{ raise_exception('Unknown role: ' + m['role']) }}{% endif %}"
              "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}")
    renderer = ChatRenderer(embedded_tokenizer(), strict)
    assert not renderer.tool_role
    text = renderer.render_text(TOOL_TURN, [WEATHER])
    assert "<|im_start|>user\n<tool_response>\nrain, 9 C\n</tool_response><|im_end|>" in text


def test_render_failures_and_missing_templates_are_clear():
    refusing = "{{ raise_exception('Conversation roles must alternate') }}"
    with pytest.raises(RenderError, match="roles must alternate"):
        ChatRenderer(embedded_tokenizer(), refusing).render([{"role": "user", "content": "x"}])
    with pytest.raises(ValueError, match="no chat template"):
        ChatRenderer(tokenizer_with_template(None))
    with pytest.raises(ValueError, match="not valid Jinja"):
        ChatRenderer(embedded_tokenizer(), "{% for %}")


# ---------------------------------------------------------------------- tool calls in text
def test_parse_canonical_blocks_and_surrounding_text():
    one = format_tool_call("get_weather", '{"city": "Berlin"}')
    assert parse_tool_calls(one, NAMES) == (None, [("get_weather", '{"city": "Berlin"}')])
    text = "Let me check.\n" + one + "\n" + format_tool_call("web_search", '{"query":"rain  gear"}')
    content, calls = parse_tool_calls(text, NAMES)
    assert content == "Let me check."
    assert calls == [("get_weather", '{"city": "Berlin"}'), ("web_search", '{"query":"rain  gear"}')]
    unclosed = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n'
    assert parse_tool_calls(unclosed, NAMES).tool_calls == [("get_weather", '{"city": "Rome"}')]


def test_parse_bare_json_shapes():
    demo_style = '{"tool": "get_weather", "arguments": {"city": "Berlin", "days": 1}}'
    assert parse_tool_calls(demo_style, NAMES) == (None, [("get_weather", '{"city": "Berlin", "days": 1}')])
    llama_style = ' {"name": "web_search", "parameters": {"query": "x"}} '
    assert parse_tool_calls(llama_style, NAMES).tool_calls == [("web_search", '{"query": "x"}')]
    listed = '[{"name": "web_search", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Oslo"}}]'
    assert [c.name for c in parse_tool_calls(listed, NAMES).tool_calls] == ["web_search", "get_weather"]
    as_string = '{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}'
    assert parse_tool_calls(as_string, NAMES).tool_calls == [("get_weather", '{"city": "Oslo"}')]


@pytest.mark.parametrize("text", [
    "It is sunny in Berlin.",
    '<tool_call>{"name": "delete_everything", "arguments": {}}</tool_call>',  # not a tool of the request
    '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',  # broken JSON
    format_tool_call("get_weather", "{}") + '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',
    '{"name": "get_weather", "arguments": [1, 2]}',  # arguments not an object
    '{"name": "get_weather"',
    "[]",
    '[{"name": "get_weather", "arguments": {}}, 3]',
])
def test_anything_doubtful_stays_plain_content(text):
    assert parse_tool_calls(text, NAMES) == (text, [])


def _stream(text, cuts, names=NAMES):
    stream, sent, pieces = ToolCallStream(names), "", []
    last = 0
    for cut in sorted(set(cuts)) + [len(text)]:
        piece = stream.push(text[last:cut])
        pieces.append(piece)
        sent += piece
        last = cut
    return sent, stream.finish(), pieces


def test_stream_sends_plain_text_at_once_and_holds_back_calls():
    sent, rest, pieces = _stream("Hello there, friend.", [3, 9])
    assert pieces == ["Hel", "lo the", "re, friend."] and rest == (None, [])
    call = format_tool_call("get_weather", '{"city": "Berlin"}')
    sent, rest, pieces = _stream("Checking. " + call, [10, 15, 30])
    assert sent == "Checking. " and rest == (None, [("get_weather", '{"city": "Berlin"}')])
    sent, rest, _ = _stream("  " + '{"tool": "get_weather", "arguments": {}}', [1, 5])
    assert sent == "" and rest.tool_calls == [("get_weather", "{}")]
    stream = ToolCallStream(NAMES)
    assert stream.push("a <tool_") == "a " and stream.push("x> b") == "<tool_x> b"


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(["Sure! ", "", "  ", "Ok <b>bold</b> ", '{"a": 1} ', "[x] "]),
       st.sampled_from([[], [("get_weather", '{"city": "Berlin"}')],
                        [("web_search", '{"query": "a < b"}'), ("get_weather", "{}")]]),
       st.sampled_from(["", " Done.", " <tool_ nope"]),
       st.lists(st.integers(0, 200), max_size=12))
def test_streaming_gives_what_parsing_the_whole_text_gives(lead, calls, tail, cuts):
    text = lead + "".join(format_tool_call(n, a) for n, a in calls) + (tail if not calls else "")
    sent, rest, _ = _stream(text, [c for c in cuts if c <= len(text)])
    whole = parse_tool_calls(text, NAMES)
    assert rest.tool_calls == whole.tool_calls
    if whole.tool_calls:
        assert (sent + (rest.content or "")).strip() == (whole.content or "")
    else:
        assert sent + (rest.content or "") == text
