"""Token-exact history: the history form of turn k is a prefix of turn k+1's prompt, token for token,
with the embedded SmolLM2 template and two drifting ones; divergences are found and explained."""

import pytest

from radixcache.app.demo import build_system_prompt
from radixcache.integrations.serve.history import forms as H
from radixcache.integrations.serve.requests.chat_template import ChatRenderer
from radixcache.integrations.serve.history.forms import (classify_hit, common_prefix, history_after_reply,
                                                   history_tokens)
from radixcache.integrations.serve.requests.job import assistant_message
from radixcache.integrations.serve.requests.tool_calls import (tool_call_objects, format_tool_call,
                                                               parse_tool_calls)
from serve_helpers import DRIFT_GENERATION_THINK, DRIFT_STRIP_THINK, TOOLS_TEMPLATE, embedded_tokenizer

EOS = 2
TEMPLATES = {"smollm2": None, "generation-think": DRIFT_GENERATION_THINK, "strip-think": DRIFT_STRIP_THINK}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
# Qwen3-style: reasoning is dropped only from assistant turns before the last user message
STRIP_BEFORE_LAST_USER = (
    "{%- set ns = namespace(last=0) %}"
    "{%- for m in messages %}{%- if m['role'] == 'user' %}{%- set ns.last = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}{%- set c = m['content'] %}"
    "{%- if m['role'] == 'assistant' and loop.index0 < ns.last and '</think>' in c %}"
    "{%- set c = c.split('</think>')[-1].lstrip('\n') %}{%- endif %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + c + '<|im_end|>\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}")


def ids_of(text):
    return embedded_tokenizer()(text, add_special_tokens=False)["input_ids"]


def reply_text(template, turn):
    think = "<think>\nThe user wants the weather; answer briefly.\n</think>\n\n" if template == "strip-think" else ""
    return think + f"Turn {turn}: it will rain in Berlin, so take the train!"


@pytest.mark.parametrize("template", list(TEMPLATES))
def test_history_form_is_a_prefix_of_the_next_prompt(template):
    renderer = ChatRenderer(embedded_tokenizer(), TEMPLATES[template])
    system, _ = build_system_prompt(embedded_tokenizer(), 300)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Weather in Berlin?"}]
    for turn in range(4):
        prompt = renderer.render(messages).token_ids
        text = reply_text(template, turn)
        generated = ids_of(text) + [EOS]  # what the model produced, ending at EOS
        reply = assistant_message(text, None)
        history = history_after_reply(renderer, messages, None, prompt, generated, reply)
        new_user = f"And question number {turn + 2}?"
        messages = messages + [reply, {"role": "user", "content": new_user}]
        following = renderer.render(messages)
        assert following.token_ids[:len(history.token_ids)] == history.token_ids  # token for token
        before_new = following.text[:following.text.rindex(new_user)]
        assert embedded_tokenizer().decode(history.token_ids) == before_new  # the whole past, no less
        if template == "smollm2":
            # the whole prompt and reply, but the reply's last token (EOS, never fed back) has no K/V
            assert history.divergence is None and history.computed == len(prompt) + len(generated) - 1
        elif template == "generation-think":
            opening = len(renderer.render(messages[:-2], add_generation_prompt=False).token_ids)
            assert history.divergence.reason == H.GENERATION_PROMPT
            assert opening <= history.divergence.token_index < len(prompt)
        else:
            assert history.divergence.reason == H.REASONING
            assert history.divergence.token_index == len(prompt)  # the think block was dropped
        assert history.blocks_to_compute(16) == len(history.token_ids) // 16 - history.computed // 16


def test_retokenized_reply_is_found_and_still_a_prefix():
    renderer = ChatRenderer(embedded_tokenizer())
    messages = [{"role": "user", "content": "Say something."}]
    text = "Hello world, this is radixcache speaking."
    odd = [t for piece in ("Hel", "lo world, this is radixcache speaking.") for t in ids_of(piece)]
    assert embedded_tokenizer().decode(odd) == text and odd != ids_of(text)
    prompt = renderer.render(messages).token_ids
    history = history_after_reply(renderer, messages, None, prompt, odd + [EOS], assistant_message(text, None))
    assert history.divergence.reason == H.RETOKENIZATION
    assert history.divergence.token_index == len(prompt)
    following = renderer.render(messages + [assistant_message(text, None), {"role": "user", "content": "More."}])
    assert following.token_ids[:len(history.token_ids)] == history.token_ids


def tool_turn(renderer, model_text, tools=(WEATHER,)):
    messages = [{"role": "system", "content": "You are Atlas."}, {"role": "user", "content": "Weather in Berlin?"}]
    tools = list(tools)
    prompt = renderer.render(messages, tools).token_ids
    content, calls = parse_tool_calls(model_text, {"get_weather"})
    assert calls, "the model text must hold a call"
    reply = assistant_message(content, tool_call_objects(calls))
    history = history_after_reply(renderer, messages, tools, prompt, ids_of(model_text) + [EOS], reply)
    call_id = reply["tool_calls"][0]["id"]
    following = renderer.render(messages + [reply, {"role": "tool", "tool_call_id": call_id, "content": "rain"}],
                                tools)
    assert following.token_ids[:len(history.token_ids)] == history.token_ids
    assert following.text.endswith("rain<|im_end|>\n<|im_start|>assistant\n")
    return history, len(prompt)


def test_tool_calls_in_the_canonical_form_round_trip_token_exact():
    renderer = ChatRenderer(embedded_tokenizer())  # SmolLM2: calls are written into content
    history, _ = tool_turn(renderer, format_tool_call("get_weather", '{"city":"Berlin"}'))
    assert history.divergence is None


def test_tool_calls_written_anew_are_found():
    renderer = ChatRenderer(embedded_tokenizer())
    spaced = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Berlin"}}\n</tool_call>'
    history, n_prompt = tool_turn(renderer, spaced)
    assert history.divergence.reason == H.TOOL_CALLS and history.divergence.token_index >= n_prompt
    native = ChatRenderer(embedded_tokenizer(), TOOLS_TEMPLATE)  # tojson writes ": " and ", "
    history, n_prompt = tool_turn(native, format_tool_call("get_weather", '{"city":"Berlin"}'))
    assert history.divergence.reason == H.TOOL_CALLS and history.divergence.token_index >= n_prompt
    history, _ = tool_turn(native, format_tool_call("get_weather", '{"city": "Berlin"}'))
    assert history.divergence is None  # the template writes exactly what the model wrote


def test_history_mismatch_when_the_past_is_written_differently_later():
    renderer = ChatRenderer(embedded_tokenizer(), STRIP_BEFORE_LAST_USER)
    messages = [{"role": "user", "content": "Weather in Berlin?"}]
    text = "<think>\nCall the tool.\n</think>\n\nChecking the forecast."
    prompt = renderer.render(messages).token_ids
    reply = assistant_message(text, None)
    # the history form assumes a user message comes next: the reasoning is dropped from it
    history = history_after_reply(renderer, messages, None, prompt, ids_of(text) + [EOS], reply)
    assert history.divergence.reason == H.REASONING
    following = renderer.render(messages + [reply, {"role": "user", "content": "Thanks."}]).token_ids
    assert following[:len(history.token_ids)] == history.token_ids
    # the same reply followed by a tool message keeps its reasoning: that prompt departs early
    other = renderer.render(messages + [reply, {"role": "tool", "tool_call_id": "c", "content": "x"}]).token_ids
    short = classify_hit(history.token_ids, other, cached_tokens=len(prompt) // 16 * 16, block_size=16)
    assert short.reason == H.HISTORY_MISMATCH and short.cached_tokens < short.expected_tokens


def test_template_without_a_next_message_falls_back_to_the_conversation_alone():
    only_two = ("{% if messages|length > 2 %}{{ raise_exception('two messages at most') }}{% endif %}"
                "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
                "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    renderer = ChatRenderer(embedded_tokenizer(), only_two)
    conversation = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    alone = renderer.render(conversation, add_generation_prompt=False).token_ids
    assert history_tokens(renderer, conversation) == alone[:-1]


# ---------------------------------------------------------------------- classify_hit
def test_classify_hit():
    history = tuple(range(100))
    following = history + (500, 501, 502)
    assert classify_hit(history, following, cached_tokens=96, block_size=16) is None
    assert classify_hit(history, following, cached_tokens=64, block_size=16) == (H.EVICTED, 96, 64)
    departs = history[:40] + (900,) * 70
    assert classify_hit(history, departs, cached_tokens=32, block_size=16) == (H.HISTORY_MISMATCH, 96, 32)
    assert classify_hit(history, departs, cached_tokens=96, block_size=16) is None  # hit anyway (other cache)
    assert classify_hit(history, history[:50], cached_tokens=48, block_size=16) is None  # prompt[:-1] is the cap
    assert classify_hit(history, history[:50], cached_tokens=32, block_size=16) == (H.EVICTED, 48, 32)
    # only 40 tokens of the history form were computed and nothing precomputed the rest
    assert classify_hit(history, following, 32, 16, computed=40) == (H.NOT_PRECOMPUTED, 96, 32)
    assert classify_hit(history, following, 32, 16, computed=99) == (H.EVICTED, 96, 32)


def test_common_prefix_of_token_runs():
    assert common_prefix((1, 2, 3), (1, 2, 4)) == 2 and common_prefix((), (1,)) == 0
