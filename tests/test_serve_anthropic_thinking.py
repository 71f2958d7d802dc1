"""Anthropic's ``thinking`` drives the template's thinking switch where it has one: a ChatML
template that reads ``enable_thinking`` (as Qwen3's does) writes an empty ``<think>`` block after
the generation prompt when thinking is off. ``thinking: disabled`` turns it off, ``enabled`` and
``adaptive`` on, and without the field the template's default holds; a template without the switch
renders the same whatever ``thinking`` says. ``count_tokens`` counts the same prompt, and a returning
turn with the same setting reads the whole previous turn from the cache (its history form was
rendered with the same switch)."""

import anthropic
import pytest

from radixcache.integrations.serve.telemetry.token_log import read_token_log
from serve_helpers import Served, write_model_dir

MODEL = "tiny-smol"
SWITCH_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}{%- endif %}"
    "{%- endif %}")
USER = [{"role": "user", "content": "Say hello to the nice people here, please."}]
OFF = "<think>\n\n</think>\n\n"


@pytest.fixture(scope="module", params=["switch", "no_switch"])
def served(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param) / MODEL
    template = SWITCH_TEMPLATE if request.param == "switch" else SWITCH_TEMPLATE.replace("enable_thinking", "x_off")
    write_model_dir(directory, max_positions=2048, chat_template=template, weights=True)
    server = Served(directory, log_token_ids=directory.parent / "tokens.jsonl")
    yield request.param, server
    server.stop()


def ask(served, thinking, messages=USER):
    kwargs = {} if thinking is None else {"thinking": thinking}
    with anthropic.Anthropic(base_url=served.base_url, api_key="none", max_retries=0, timeout=120) as c:
        counted = c.messages.count_tokens(model=MODEL, messages=messages, **kwargs).input_tokens
        reply = c.messages.create(model=MODEL, max_tokens=8, messages=messages, extra_body={"temperature": 0}, **kwargs)
    served.quiet()
    prompt = read_token_log(served.options.log_token_ids)[-1]["prompt_ids"]
    assert counted == len(prompt) == reply.usage.input_tokens + reply.usage.cache_read_input_tokens
    return served.state.tokenizer.decode(prompt), reply


@pytest.mark.parametrize("thinking,off", [(None, False), ({"type": "disabled"}, True),
                                          ({"type": "enabled", "budget_tokens": 1024}, False),
                                          ({"type": "adaptive"}, False)])
def test_thinking_sets_the_templates_switch(served, thinking, off):
    kind, server = served
    text, _ = ask(server, thinking)
    assert text.endswith(OFF) == (off and kind == "switch"), text[-60:]
    server.assert_clean()


def test_a_returning_turn_with_thinking_off_hits_the_whole_previous_turn(served):
    kind, server = served
    server.say(USER, "Hello, nice people.")
    _, first = ask(server, {"type": "disabled"})
    messages = USER + [{"role": "assistant", "content": first.content[0].text},
                       {"role": "user", "content": "And now goodbye to them, please."}]
    server.quiet()
    _, second = ask(server, {"type": "disabled"}, messages)
    first_total = first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert second.usage.cache_read_input_tokens >= (first_total + first.usage.output_tokens - 1) // 16 * 16
    server.assert_clean()
