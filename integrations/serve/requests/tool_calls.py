"""Tool calls in the model's text: the canonical way to write one, parsing them back, and streaming.

The server parses tool calls only for requests that have ``tools`` (and ``tool_choice`` is not
"none"). Two shapes are recognised:

- ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, anywhere in the reply (the
  shape this server asks for when it writes tool schemas into the system message, and the one
  Hermes/Qwen-style templates teach); text outside the blocks is the message content;
- a reply that is nothing but one JSON object (or an array of them) with ``name`` (or ``tool``) and
  ``arguments`` (or ``parameters``).

A call counts only if its name is one of the request's tools and its arguments are a JSON object;
if any candidate fails, the whole reply is returned as plain content (never a half-parsed call).
A reply whose calls were enforced by a grammar (``complete_only``) can only be cut short by
``max_tokens``: its unfinished last call is dropped and the complete calls before it are kept.
``arguments`` is returned exactly as the model wrote it (the JSON text), so a client that echoes it
back and a template that writes it again reproduce the model's own characters where they can.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import NamedTuple

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|\Z)", re.S)
_ARGS_KEY = re.compile(r'"(?:arguments|parameters)"\s*:\s*')


class ParsedToolCall(NamedTuple):
    """A call found in the text: the function name and the arguments' JSON text (an object)."""

    name: str
    arguments: str


class ParsedReply(NamedTuple):
    """The reply split into content (None when nothing but calls) and the calls, in order."""

    content: str | None
    tool_calls: list


def format_tool_call(name: str, arguments: str) -> str:
    """The canonical text of one call: ``<tool_call>{"name": NAME, "arguments": ARGS}</tool_call>``.

    ``arguments`` (a JSON text) is written as given, so arguments the model produced come back as
    the same characters.
    """
    return f'{OPEN}{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": {arguments}}}{CLOSE}'


def _call_from_json(text: str, tool_names) -> ParsedToolCall | None:
    """The call in one JSON object's text, or None if it is not a valid call of a known tool."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    name = obj.get("name", obj.get("tool"))
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
        raw = json.dumps(args, ensure_ascii=False)
    else:
        raw = _raw_arguments(text, args)
    if not isinstance(name, str) or name not in tool_names or not isinstance(args, dict):
        return None
    return ParsedToolCall(name, raw)


def _raw_arguments(text: str, args) -> str:
    """The arguments' JSON exactly as written in ``text`` when it can be located, else re-serialized."""
    key = _ARGS_KEY.search(text)
    if key is not None:
        try:
            value, end = json.JSONDecoder().raw_decode(text, key.end())
        except ValueError:
            value = None
        if value == args and isinstance(value, dict):
            return text[key.end():end]
    return json.dumps(args, ensure_ascii=False)


def parse_tool_calls(text: str, tool_names, complete_only: bool = False) -> ParsedReply:
    """Split ``text`` into content and tool calls of the tools named in ``tool_names``.

    Returns ``ParsedReply(text, [])`` when the text holds no valid call (or any candidate is invalid).
    With ``complete_only`` (a grammar-enforced reply: nothing but calls joined by newlines), what
    follows the last ``</tool_call>`` is an unfinished call (a ``max_tokens`` cut) and is dropped.
    """
    names = set(tool_names)
    if complete_only:  # only calls and newlines can be there: after the last close, a cut call
        last = text.rfind(CLOSE)
        text = text[:last + len(CLOSE)] if last >= 0 else ""
        if not text:
            return ParsedReply(None, [])
    if OPEN in text:
        calls, outside, pos = [], [], 0
        for block in _BLOCK.finditer(text):
            call = _call_from_json(block.group(1).strip(), names)
            if call is None:
                return ParsedReply(text, [])
            calls.append(call)
            outside.append(text[pos:block.start()])
            pos = block.end()
        outside.append(text[pos:])
        content = "".join(outside).strip()
        return ParsedReply(content or None, calls)
    stripped = text.strip()
    if stripped.startswith("{"):
        call = _call_from_json(stripped, names)
        return ParsedReply(None, [call]) if call else ParsedReply(text, [])
    if stripped.startswith("["):
        try:
            items = json.loads(stripped)
        except ValueError:
            return ParsedReply(text, [])
        if not isinstance(items, list) or not items:
            return ParsedReply(text, [])
        calls = [_call_from_json(json.dumps(item, ensure_ascii=False), names) for item in items]
        return ParsedReply(None, calls) if all(calls) else ParsedReply(text, [])
    return ParsedReply(text, [])


class ToolCallStream:
    """Streams content while holding back whatever may turn out to be a tool call.

    ``complete_only`` as in ``parse_tool_calls``. ``push(delta)`` returns the text that is safe to
    send as content now: everything before a ``<tool_call>`` (or a partial one at the end), and nothing at all while the reply so far is
    blank or starts like JSON. ``finish()`` parses the rest and returns ``ParsedReply`` of the text
    not yet sent: the remaining content and the calls. Content sent plus ``finish().content`` is
    the content a non-streaming response would have had, up to whitespace around call blocks.
    """

    def __init__(self, tool_names, complete_only: bool = False):
        self.names = set(tool_names)
        self.complete_only = complete_only
        self.text = ""
        self.sent = 0

    def push(self, delta: str) -> str:
        self.text += delta
        if self.sent == 0:
            lead = self.text.lstrip()
            if not lead or lead[0] in "{[":
                return ""
        start = self.text.find(OPEN, self.sent)
        if start < 0:
            start = len(self.text)
            for held in range(min(len(OPEN) - 1, len(self.text) - self.sent), 0, -1):
                if OPEN.startswith(self.text[-held:]):
                    start = len(self.text) - held
                    break
        out, self.sent = self.text[self.sent:start], start
        return out

    def finish(self) -> ParsedReply:
        rest = self.text[self.sent:]
        self.sent = len(self.text)
        parsed = parse_tool_calls(rest, self.names, self.complete_only)
        if parsed.tool_calls:
            return parsed
        return ParsedReply(rest or None, [])


def tool_call_objects(calls, id_prefix: str = "call") -> list[dict]:
    """OpenAI ``tool_calls`` entries for parsed calls (``.name``, ``.arguments`` JSON text)."""
    return [{"id": f"{id_prefix}_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": call.name, "arguments": call.arguments}} for call in calls]
