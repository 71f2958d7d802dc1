"""One real agent client's multi-turn loop against a radixcache server; run by
``benchmarks/agent_clients.py`` inside its loopback-only sandbox, one process per client.

    python benchmarks/agent_client_loops.py CLIENT BASE_URL MODEL KEY TURNS WORKDIR

``CLIENT`` is one of ``CLIENTS``. Each loop is what a user of that framework writes: a task with
one function tool, the framework running its own steps (bounded by ``TURNS``). What the model
answers does not matter here (a 135M model is a poor agent); what the framework sends does: every
step resends the conversation so far, which the server should read from its cache. Claude Code and
Codex run as a two-call session (a call, then ``--continue`` / ``exec resume --last``).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

TASK = "What time is it in Paris? Use the tool, then answer in one sentence."
FOLLOW_UP = "And in Tokyo? Use the tool again."


def local_time(city: str) -> str:
    """The local time in a city.

    Args:
        city: the city's name.
    """
    return f"It is 10:42 in {city}."


def langchain_loop(base_url, model, key, turns, workdir) -> None:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    time_tool = tool(local_time)
    llm = ChatOpenAI(base_url=base_url + "/v1", api_key=key, model=model, temperature=0, max_tokens=48,
                     max_retries=0).bind_tools([time_tool])
    messages = [HumanMessage(TASK)]
    for turn in range(turns):
        reply = llm.invoke(messages)
        messages.append(reply)
        for call in reply.tool_calls:
            messages.append(ToolMessage(time_tool.invoke(call["args"]), tool_call_id=call["id"]))
        if not reply.tool_calls:
            messages.append(HumanMessage(FOLLOW_UP))


def smolagents_loop(base_url, model, key, turns, workdir) -> None:
    from smolagents import OpenAIServerModel, ToolCallingAgent, tool

    agent = ToolCallingAgent(tools=[tool(local_time)], max_steps=turns, verbosity_level=0,
                             model=OpenAIServerModel(model_id=model, api_base=base_url + "/v1", api_key=key,
                                                     temperature=0, max_tokens=48))
    agent.run(TASK)


def agents_sdk_loop(base_url, model, key, turns, workdir, responses: bool = False) -> None:
    from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner,
                        function_tool, set_tracing_disabled)
    from openai import AsyncOpenAI
    from agents.exceptions import MaxTurnsExceeded

    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=base_url + "/v1", api_key=key, max_retries=0)
    kind = OpenAIResponsesModel if responses else OpenAIChatCompletionsModel
    agent = Agent(name="clock", instructions="You answer questions about time, using tools.",
                  tools=[function_tool(local_time)], model=kind(model=model, openai_client=client),
                  model_settings=ModelSettings(temperature=0, max_tokens=48))
    conversation = [{"role": "user", "content": TASK}]
    for turn in range(turns):  # a chat with the agent: each user turn continues the last run's items
        try:
            result = Runner.run_sync(agent, conversation, max_turns=3)
        except MaxTurnsExceeded:
            return
        conversation = result.to_input_list() + [{"role": "user", "content": FOLLOW_UP}]


def agents_sdk_responses_loop(base_url, model, key, turns, workdir) -> None:
    agents_sdk_loop(base_url, model, key, turns, workdir, responses=True)


def claude_code_loop(base_url, model, key, turns, workdir) -> None:
    from agent_sandbox import claude_argv, claude_env

    env = claude_env(Path(workdir) / "home", base_url, model, api_key=key)
    for resume, prompt in ((False, "Run `echo hello` and tell me what it printed."), (True, "Now run `echo bye`.")):
        subprocess.run(claude_argv(prompt, resume=resume, max_turns=turns), env=env, cwd=workdir,
                       stdin=subprocess.DEVNULL, capture_output=True, timeout=600)


def codex_loop(base_url, model, key, turns, workdir) -> None:
    from agent_sandbox import codex_argv, codex_env, codex_home

    home = codex_home(Path(workdir) / "home", base_url, model)
    for resume, prompt in ((False, "Run `echo hello` and tell me what it printed."), (True, "Now run `echo bye`.")):
        subprocess.run(codex_argv(prompt, home, resume=resume), env=codex_env(home, api_key=key), cwd=workdir,
                       stdin=subprocess.DEVNULL, capture_output=True, timeout=600)


CLIENTS = {"langchain": langchain_loop, "smolagents": smolagents_loop, "agents-sdk-chat": agents_sdk_loop,
           "agents-sdk": agents_sdk_responses_loop, "claude-code": claude_code_loop, "codex": codex_loop}


if __name__ == "__main__":
    name, url, model_name, api_key, steps, work = sys.argv[1:7]
    CLIENTS[name](url, model_name, api_key, int(steps), work)
