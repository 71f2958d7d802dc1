"""Tool calls over real HTTP, with the embedded SmolLM2 template (no tools support: the server
writes the schemas into the system message and past calls into content) and with a template that
renders ``tools`` and ``tool_calls`` itself.

The model is told what to say (``Served.say``): a reply with ``<tool_call>`` blocks comes back as
``tool_calls`` (streamed or not), the client sends the results back as ``tool`` messages, and the
next turn hits the whole previous conversation; ``examples/openai_agent.py`` runs its loop against
the server.
"""

import importlib.util
import json
from pathlib import Path

import pytest

from radixcache.integrations.serve.history.forms import history_tokens
from serve_helpers import TOOLS_TEMPLATE, Served, write_model_dir

ROOT = Path(__file__).resolve().parents[1]
BS = 16


def load_example():
    spec = importlib.util.spec_from_file_location("openai_agent_example", ROOT / "examples" / "openai_agent.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


AGENT = load_example()
CALLS = ('<tool_call>{"name": "get_weather", "arguments": {"city": "Berlin"}}</tool_call>\n'
         '<tool_call>{"name": "calculator", "arguments": {"expression": "17 * 23"}}</tool_call>')


@pytest.fixture(scope="module", params=["smollm2", "tools_template"])
def served(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param) / "tiny-smol"
    template = TOOLS_TEMPLATE if request.param == "tools_template" else None
    write_model_dir(directory, max_positions=2048, chat_template=template, weights=True)
    server = Served(directory)
    yield server
    server.stop()


def streamed_calls(stream):
    """(content, {index: (name, arguments)}, finish reason) of a streamed reply."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                name, args = calls.get(call.index, ("", ""))
                calls[call.index] = (name + (call.function.name or ""), args + (call.function.arguments or ""))
            finish = choice.finish_reason or finish
    return content, calls, finish


def test_tool_calls_round_trip_and_the_next_turn_hits_the_conversation(served):
    messages = [{"role": "system", "content": "You are a helpful assistant. Use the tools when they help."},
                {"role": "user", "content": "What is the weather in Berlin, and what is 17 * 23?"}]
    served.say(messages, CALLS, tools=AGENT.TOOLS)
    with served.client() as client:
        body = client.chat.completions.create(model="tiny-smol", messages=messages, tools=AGENT.TOOLS,
                                              temperature=0, max_tokens=80)
        choice = body.choices[0]
        assert choice.finish_reason == "tool_calls" and not choice.message.content
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
        assert calls == [("get_weather", {"city": "Berlin"}), ("calculator", {"expression": "17 * 23"})]
        assert len({c.id for c in choice.message.tool_calls}) == 2
        content, pieces, finish = streamed_calls(client.chat.completions.create(
            model="tiny-smol", messages=messages, tools=AGENT.TOOLS, temperature=0, max_tokens=80, stream=True))
        assert finish == "tool_calls" and not content
        assert [(n, json.loads(a)) for _, (n, a) in sorted(pieces.items())] == calls
        # without tools in the request the same text is plain content
        served.say(messages, CALLS)
        plain = client.chat.completions.create(model="tiny-smol", messages=messages, temperature=0, max_tokens=80)
        assert plain.choices[0].message.content == CALLS and not plain.choices[0].message.tool_calls
        reply = {"role": "assistant", "content": None,
                 "tool_calls": [c.model_dump() for c in choice.message.tool_calls]}
        previous = history_tokens(served.state.renderer, messages + [reply], AGENT.TOOLS)
        messages.append(reply)
        for call in choice.message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": AGENT.call_tool(call.function.name, call.function.arguments)})
        prompt = served.render(messages, AGENT.TOOLS)
        assert prompt[:len(previous)] == previous
        served.say(messages, "It rains in Berlin, and 17 * 23 is 391.", tools=AGENT.TOOLS)
        served.quiet()
        answer = client.chat.completions.create(model="tiny-smol", messages=messages, tools=AGENT.TOOLS,
                                                temperature=0, max_tokens=40)
    assert answer.choices[0].message.content == "It rains in Berlin, and 17 * 23 is 391."
    assert answer.choices[0].finish_reason == "stop"
    assert answer.usage.prompt_tokens_details.cached_tokens >= len(previous) // BS * BS
    served.assert_clean()


def test_the_openai_agent_example_runs_its_loop_against_the_server(served, capsys):
    messages = [{"role": "system", "content": "You are a helpful assistant. Use the tools when they help."},
                {"role": "user", "content": "What is the weather in Berlin, and what is 17 * 23?"}]
    served.say(messages, CALLS, tools=AGENT.TOOLS)  # the first step calls both tools; then its own words
    assert AGENT.main(["--base-url", served.base_url + "/v1"]) == 0
    out = capsys.readouterr().out
    assert 'get_weather({"city": "Berlin"}) -> rain' in out and "calculator(" in out and "-> 391" in out
    step2 = next(line for line in out.splitlines() if line.startswith("step 2:"))
    assert int(step2.split(", ")[1].split()[0]) > 0  # "N from the cache"
    assert "answer: " in out
    served.assert_clean()
