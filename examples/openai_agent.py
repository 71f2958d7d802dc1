"""A tool-calling agent loop with the ``openai`` client against ``radixcache serve``.

Start the server first (``radixcache serve`` or ``make serve``; add ``--api-key KEY`` to require a
key), then run::

    python examples/openai_agent.py [--base-url http://127.0.0.1:8000/v1] [--api-key KEY]

The agent sends the whole conversation every step, as agent frameworks do; the server renders it
with the model's chat template and, thanks to the radix cache and its token-exact history, computes
only the new messages. Each step prints how many prompt tokens the server served from its cache
(``usage.prompt_tokens_details.cached_tokens``). The tools are local Python functions.

Step 1 asks for a tool call (``tool_choice: "required"``: a grammar makes the reply one valid call,
which a small model would not write on its own; it needs the server's grammar extra, and without it
the step falls back to letting the model choose); later steps let the model choose
(``tool_choice: "auto"``): call another tool, or answer.
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import os
import sys

import openai

# The patterns bound the arguments: under a forced call a 135M model would otherwise keep writing
# inside a JSON string until max_tokens.
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Za-z .-]{1,40}$"}},
                       "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "calculator", "description": "Evaluate an arithmetic expression such as (12 * 7) + 3.",
        "parameters": {"type": "object", "properties": {
            "expression": {"type": "string", "pattern": "^[0-9+*/%(). -]{1,60}$"}},
                       "required": ["expression"]}}},
]
WEATHER = {"berlin": "rain showers, 9 C, wind 31 km/h", "paris": "sunny, 14 C", "oslo": "snow, -2 C"}
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.Pow: operator.pow, ast.USub: operator.neg, ast.Mod: operator.mod}


def get_weather(city: str) -> str:
    return WEATHER.get(city.strip().lower(), f"no weather data for {city}")


def calculator(expression: str) -> str:
    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError("only numbers and + - * / ** % are allowed")
    try:
        return str(value(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError) as exc:
        return f"error: {exc}"


FUNCTIONS = {"get_weather": get_weather, "calculator": calculator}


def call_tool(name: str, arguments: str) -> str:
    """Run one tool call; a bad call becomes an error message the model can read."""
    try:
        args = json.loads(arguments or "{}")
        return FUNCTIONS[name](**args)
    except (KeyError, TypeError, ValueError) as exc:
        return f"error: cannot call {name} with {arguments!r} ({exc})"


def ask(client, model: str, messages: list, tool_choice: str):
    """One step: the whole conversation, the tools, greedy. A server without structured output
    (no grammar extra) refuses ``tool_choice: "required"``; the step then lets the model choose."""
    try:
        return client.chat.completions.create(model=model, messages=messages, tools=TOOLS, temperature=0,
                                              max_tokens=128, tool_choice=tool_choice)
    except openai.BadRequestError as exc:
        if tool_choice != "required" or "xgrammar" not in str(exc):
            raise
        print("  (this server has no structured output: the model chooses whether to call a tool)")
        return ask(client, model, messages, "auto")


def run_agent(client, model: str, task: str, max_steps: int = 6) -> str:
    """Ask, run the tools the model calls, send their results back, until it answers in text."""
    messages = [{"role": "system", "content": "You are a helpful assistant. Use the tools when they help."},
                {"role": "user", "content": task}]
    for step in range(1, max_steps + 1):
        response = ask(client, model, messages, "required" if step == 1 else "auto")
        message, usage = response.choices[0].message, response.usage
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        print(f"step {step}: {usage.prompt_tokens} prompt tokens, {cached} from the cache, "
              f"{usage.completion_tokens} generated")
        if not message.tool_calls:
            return message.content or ""
        messages.append({"role": "assistant", "content": message.content,
                         "tool_calls": [call.model_dump() for call in message.tool_calls]})
        for call in message.tool_calls:
            result = call_tool(call.function.name, call.function.arguments)
            print(f"  {call.function.name}({call.function.arguments}) -> {result}")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return "(no answer within the step limit)"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default=os.environ.get("RADIXCACHE_API_KEY", "none"))
    parser.add_argument("--model", default=None, help="served model name (default: the server's first)")
    parser.add_argument("--task", default="What is the weather in Berlin, and what is 17 * 23?")
    args = parser.parse_args(argv)
    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0)
    try:
        model = args.model or client.models.list().data[0].id
        answer = run_agent(client, model, args.task)
    except openai.APIConnectionError:
        print(f"no server at {args.base_url}; start one with: radixcache serve", file=sys.stderr)
        return 1
    except openai.APIStatusError as exc:
        print(f"the server answered {exc.status_code}: {exc.message}", file=sys.stderr)
        return 1
    print(f"answer: {answer}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
