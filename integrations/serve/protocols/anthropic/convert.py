"""Anthropic Messages requests in the one internal ``Conversation`` (OpenAI-shaped), and replies back.

Every rule is deterministic, so the same conversation renders the same tokens whatever shape the
client gives it this turn (Claude Code moves ``cache_control`` and turns one-block lists into
strings from one request to the next):

- ``system`` (a string or text blocks) is one system message: the blocks' texts joined with a blank
  line (``JOIN``). The ``x-anthropic-billing-header:`` block Claude Code puts first is dropped
  whole: its ``cch=`` (and ``cc_prompt_id``, ``cc_turn_index``, ...) change per request and would
  change the prompt's first tokens.
- A message's text blocks are joined the same way, so a one-block list renders exactly like the
  string it equals. ``cache_control`` is never rendered (only its ``ttl`` is used: the retention).
- ``role: "system"`` messages stand where they are sent, never hoisted; a template that does not
  render a system message after other turns gets them as a user turn marked
  ``<system>...</system>`` instead.
- A user message becomes a user message per run of text blocks and one ``tool`` message per
  ``tool_result`` (its text joined; with ``is_error`` the text is prefixed ``ERROR_PREFIX``), in
  the order sent. An assistant message becomes one assistant message: its text, its ``tool_use``
  blocks as ``tool_calls`` (the input written as ``json.dumps(input, ensure_ascii=False)``), its
  ``thinking`` text as ``reasoning_content`` (what a template with reasoning support reads; others
  ignore it, as they do for chat). ``redacted_thinking`` is opaque and dropped.
- Custom tools become OpenAI function tools (``input_schema`` is the parameters); server tools are
  dropped with a log line.

``reply_blocks`` makes the response's content blocks of the generated reply, and
``echoed_reply`` is that reply as the client sends it back (through the same rules), which is what
the reply's history form is rendered from.
"""

from __future__ import annotations

import json
import logging
import weakref
from typing import NamedTuple

from radixcache.integrations.serve.protocols.anthropic.requests import CountTokensRequest, Message
from radixcache.integrations.serve.requests.chat_template import ChatRenderer, RenderError
from radixcache.integrations.serve.requests.structured import OutputConstraint, tool_call_constraint
from radixcache.integrations.serve.errors import bad_request
from radixcache.integrations.serve.requests.job import Conversation

logger = logging.getLogger("radixcache.serve")

JOIN = "\n\n"
BILLING_HEADER = "x-anthropic-billing-header:"
ERROR_PREFIX = "Error: "
SESSION_RETAIN_S = 300.0  # a session without a cache_control ttl: Anthropic's default 5 minutes
_INLINE_SYSTEM: "weakref.WeakKeyDictionary[ChatRenderer, bool]" = weakref.WeakKeyDictionary()


class ToolMode(NamedTuple):
    """What ``tool_choice`` asks: whether calls are parsed out of the reply, the constraint (any /
    tool), and whether one call at most is answered (``disable_parallel_tool_use``)."""

    parse_tools: bool
    constraint: OutputConstraint | None
    single_call: bool


def renders_inline_system(renderer: ChatRenderer) -> bool:
    """Whether the template writes a system message that follows other turns where it stands
    (probed once per renderer)."""
    known = _INLINE_SYSTEM.get(renderer)
    if known is None:
        probe = [{"role": "user", "content": "\x1eU\x1e"}, {"role": "system", "content": "\x1eS\x1e"},
                 {"role": "user", "content": "\x1eV\x1e"}]
        try:
            text = renderer.render_text(probe)
            known = text.find("\x1eU\x1e") < text.find("\x1eS\x1e") < text.find("\x1eV\x1e")
        except RenderError:
            known = False
        _INLINE_SYSTEM[renderer] = known
    return known


def _texts(blocks, where: str) -> str:
    for block in blocks:
        if block.type != "text":
            raise bad_request(f"{where} may hold only text blocks, not {block.type!r}", param=where)
    return JOIN.join(block.text for block in blocks)


def system_text(blocks) -> str:
    """The system prompt of ``system`` blocks: billing header dropped, texts joined."""
    return JOIN.join(b.text for b in blocks or () if not b.text.startswith(BILLING_HEADER))


def _user(message: Message, index: int) -> list[dict]:
    out, run = [], []
    for block in message.content + [None]:
        if block is not None and block.type == "text":
            run.append(block.text)
            continue
        if run:
            out.append({"role": "user", "content": JOIN.join(run)})
            run = []
        if block is None:
            break
        if block.type != "tool_result":
            raise bad_request(f"messages.{index}: a user message cannot hold {block.type!r} blocks",
                              param=f"messages.{index}.content")
        text = JOIN.join(part.text for part in block.content)
        out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                    "content": ERROR_PREFIX + text if block.is_error else text})
    return out or [{"role": "user", "content": ""}]


def _assistant(message: Message, index: int) -> dict:
    text, calls, thinking = [], [], []
    for block in message.content:
        if block.type == "text":
            text.append(block.text)
        elif block.type == "tool_use":
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name,
                                       "arguments": json.dumps(block.input, ensure_ascii=False)}})
        elif block.type == "thinking":
            thinking.append(block.thinking)
        elif block.type != "redacted_thinking":
            raise bad_request(f"messages.{index}: an assistant message cannot hold {block.type!r} blocks",
                              param=f"messages.{index}.content")
    out = {"role": "assistant", "content": JOIN.join(text) if text or not calls else None}
    if calls:
        out["tool_calls"] = calls
    if thinking:
        out["reasoning_content"] = JOIN.join(thinking)
    return out


def _system(message: Message, index: int, inline: bool) -> dict:
    text = _texts(message.content, f"messages.{index}.content")
    return {"role": "system", "content": text} if inline else {"role": "user", "content": f"<system>\n{text}\n</system>"}


def function_tools(tools) -> list[dict] | None:
    """The custom tools as OpenAI function tools (None when there are none); server tools dropped."""
    out = []
    for tool in tools or ():
        if not tool.custom:
            logger.debug("dropping server tool %r (type %s): this server runs no server tools", tool.name, tool.type)
            continue
        function = {"name": tool.name, "parameters": tool.input_schema}
        if tool.description is not None:
            function = {"name": tool.name, "description": tool.description, "parameters": tool.input_schema}
        out.append({"type": "function", "function": function})
    return out or None


def conversation_of(req: CountTokensRequest, inline_system: bool, thinking_switch: bool = False) -> Conversation:
    """The internal conversation of a Messages request (see the module docstring). With a
    template that has a thinking switch (``thinking_switch``), ``thinking`` sets it: ``enabled`` and
    ``adaptive`` on, ``disabled`` off, absent: the template's default."""
    if req.messages[-1].role == "assistant":
        raise bad_request("the last message is an assistant message: continuing a prefilled reply is not "
                          "supported by this server", param="messages")
    messages = []
    system = system_text(req.system)
    if system:
        messages.append({"role": "system", "content": system})
    for i, message in enumerate(req.messages):
        if message.role == "user":
            messages.extend(_user(message, i))
        elif message.role == "assistant":
            messages.append(_assistant(message, i))
        else:
            messages.append(_system(message, i, inline_system or not messages))
    args = ()
    if thinking_switch and req.thinking is not None:
        args = (("enable_thinking", req.thinking.type != "disabled"),)
    return Conversation(messages, function_tools(req.tools), args)


def tool_mode(req: CountTokensRequest, conversation: Conversation) -> ToolMode:
    """``tool_choice`` (auto when absent) over the conversation's function tools; ignored without them."""
    choice = req.tool_choice
    if not conversation.tools or (choice is not None and choice.type == "none"):
        return ToolMode(False, None, False)
    single = choice is not None and choice.disable_parallel_tool_use
    if choice is None or choice.type == "auto":
        return ToolMode(True, None, single)
    try:
        constraint = tool_call_constraint(conversation.tools, choice.name, parallel=not single)
    except ValueError as exc:  # the named tool is a server tool
        raise bad_request(str(exc), param="tool_choice") from None
    return ToolMode(True, constraint, single)


def retain_seconds(req: CountTokensRequest, session_id: str | None) -> float | None:
    """The retention hint: the longest ``cache_control`` ttl in the request (5 minutes without a
    ttl), else 5 minutes for a session (``metadata.user_id``'s ``session_id``), else None."""
    marks = [req.cache_control] + [b.cache_control for b in req.system or ()]
    marks += [t.cache_control for t in req.tools or ()]
    for message in req.messages:
        for block in message.content:
            marks.append(block.cache_control)
            marks += [part.cache_control for part in getattr(block, "content", None) or ()
                      if block.type == "tool_result"]
    seconds = [mark.seconds for mark in marks if mark is not None]
    if seconds:
        return max(seconds)
    return SESSION_RETAIN_S if session_id else None


def reply_blocks(reply: dict) -> list[dict]:
    """The response's content blocks of a reply (an OpenAI assistant message): its text, then one
    ``tool_use`` per call."""
    blocks = [{"type": "text", "text": reply["content"]}] if reply.get("content") else []
    for call in reply.get("tool_calls") or []:
        blocks.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                       "input": json.loads(call["function"]["arguments"])})
    return blocks


def echoed_reply(reply: dict) -> dict:
    """The reply as the client sends it back next turn (its content blocks, converted again)."""
    return _assistant(Message.model_validate({"role": "assistant", "content": reply_blocks(reply)}), 0)
