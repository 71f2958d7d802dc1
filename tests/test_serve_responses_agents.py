"""The OpenAI Agents SDK's default runner (its Responses model, streamed) with a function tool,
against a real server: the tool is called with the model's arguments, its result goes back as a
``function_call_output``, and the second request reads the first request's prompt and reply from
the cache."""

import agents
import pytest

from radixcache.integrations.serve.protocols.openai.responses_request import function_tools
from serve_helpers import Served, write_model_dir

BS = 16
INSTRUCTIONS = "Use the tools."
QUESTION = "Weather in Berlin?"
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Berlin"}}</tool_call>'
ANSWER = "It is sunny in Berlin."


@pytest.fixture
def served(tmp_path):
    directory = write_model_dir(tmp_path / "tiny-smol", max_positions=4096, weights=True)
    server = Served(directory, served_model_names=("m",))
    yield server
    server.stop()


def test_the_default_runner_calls_a_function_tool_and_hits_the_cache(served):
    from openai import AsyncOpenAI

    calls = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"sunny in {city}"

    agents.set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=served.base_url + "/v1", api_key="none", max_retries=0)
    agent = agents.Agent(name="weather", instructions=INSTRUCTIONS, tools=[get_weather],
                         model=agents.OpenAIResponsesModel("m", client),
                         model_settings=agents.ModelSettings(temperature=0))
    tools = function_tools([{"type": "function", "name": get_weather.name, "description": get_weather.description,
                             "parameters": get_weather.params_json_schema}])[0]
    first = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}]
    call = {"id": "any", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Berlin"}'}}
    second = first + [{"role": "assistant", "content": None, "tool_calls": [call]},
                      {"role": "tool", "tool_call_id": "any", "content": "sunny in Berlin"}]
    # the two replies by their prompts' lengths (the call id is not rendered by this template)
    served.say(first, CALL, tools)
    script = dict(served.model.script)
    served.say(second, ANSWER, tools)
    served.model.script.update(script)
    result = agents.Runner.run_sync(agent, QUESTION, max_turns=3)
    assert calls == ["Berlin"] and result.final_output == ANSWER
    one, two = result.raw_responses
    assert one.usage.input_tokens == len(served.render(first, tools))
    assert two.usage.input_tokens == len(served.render(second, tools))
    computed = one.usage.input_tokens + one.usage.output_tokens - 1  # the reply's last token has no K/V
    assert two.usage.input_tokens_details.cached_tokens >= computed // BS * BS
