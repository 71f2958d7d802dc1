"""What a request's output must satisfy, in the one form every protocol builds.

Each protocol adapter maps its own fields to an ``OutputConstraint`` (or None for free text) and
hands it to ``job.new_job``:

- chat: ``response_format`` json_object / json_schema, ``tool_choice`` "required" or a named function
  (with ``parallel_tool_calls``);
- Responses: ``text.format``, ``tool_choice`` "required" or a named function;
- Anthropic Messages: ``tool_choice`` any / tool (with ``disable_parallel_tool_use``).

``tool_choice`` "auto" and "none" are not constraints (None): the model may answer in text.
"""

from __future__ import annotations

from typing import NamedTuple


class OutputConstraint(NamedTuple):
    """``kind`` is "json_object" (any JSON object), "json_schema" (a document valid for ``schema``;
    ``strict`` as OpenAI's flag), or "tool_calls" (only tool calls in the template's format, each
    naming one of ``tool_names`` with arguments valid for that tool's parameter schema in
    ``tools``; at most one call unless ``parallel``). ``param`` names the request field it came
    from, for the 400 a schema the compiler refuses gets."""

    kind: str
    schema: dict | None = None
    strict: bool = False
    tools: tuple = ()  # OpenAI function-tool dicts, for "tool_calls"
    tool_names: tuple = ()  # the names a call may use: every tool's, or the one that is forced
    parallel: bool = True
    param: str | None = None


def json_constraint(schema: dict | None = None, strict: bool = False,
                    param: str = "response_format") -> OutputConstraint:
    """A JSON object (``schema`` None) or a document valid for ``schema``, asked for by ``param``."""
    if schema is None:
        return OutputConstraint("json_object", param=param)
    return OutputConstraint("json_schema", schema=schema, strict=strict, param=param)


def tool_call_constraint(tools, forced: str | None = None, parallel: bool = True,
                         param: str = "tools") -> OutputConstraint:
    """Only tool calls to ``tools`` (OpenAI function-tool dicts, the request's ``param``): any of
    them, or only ``forced``."""
    tools = tuple(tools)
    names = tuple(t["function"]["name"] for t in tools)
    if forced is not None and forced not in names:
        raise ValueError(f"the forced tool {forced!r} is not among the tools")
    return OutputConstraint("tool_calls", tools=tools, tool_names=(forced,) if forced else names,
                            parallel=parallel, param=param)
