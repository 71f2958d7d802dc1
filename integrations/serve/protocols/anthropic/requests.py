"""Request models of the Anthropic Messages endpoints (pydantic v2): ``POST /v1/messages`` and
``POST /v1/messages/count_tokens``.

``parse_messages_request(obj)`` / ``parse_count_tokens_request(obj)`` validate a decoded JSON body
or raise ``APIError`` 400 naming the first offending field (``messages.1.content.0.type``).

Content blocks: ``text``, ``tool_use``, ``tool_result`` (its content a string or text blocks,
``is_error``), ``thinking``, ``redacted_thinking``; ``image`` and ``document`` blocks are refused
(this server's models read text only), as is any other block type. ``cache_control`` may sit on
any block and on tools (its ``ttl``: "5m" or "1h"). Tools without a ``type`` (or ``custom``) are
the client's own; any other ``type`` is a server tool (web search, code execution, ...). Fields that
change nothing here (``context_management``, ``output_config``, ``service_tier``, ``container``,
``metadata`` beyond ``user_id``, a tool's ``defer_loading``, unknown fields) are accepted and
ignored.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Union

from pydantic import Field, field_validator, model_validator

from radixcache.integrations.serve.protocols.schema import MAX_STOP_SEQUENCES, APIModel, CacheSalt, parse_body

# cache_control.ttl -> seconds (Anthropic's cache lives 5 minutes unless "1h" is asked for)
TTL_SECONDS = {"5m": 300.0, "1h": 3600.0}


class CacheControl(APIModel):
    type: Literal["ephemeral"] = "ephemeral"
    ttl: Literal["5m", "1h"] | None = None

    @property
    def seconds(self) -> float:
        return TTL_SECONDS[self.ttl or "5m"]


def _as_blocks(content):
    """A string content as the one text block it equals (so both render the same)."""
    return [{"type": "text", "text": content}] if isinstance(content, str) else content


class _Block(APIModel):
    cache_control: CacheControl | None = None


class TextBlock(_Block):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str
    content: list[TextBlock] = []
    is_error: bool = False

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, content):
        content = _as_blocks(content)
        for i, part in enumerate(content if isinstance(content, list) else ()):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind != "text":
                raise ValueError(f"tool_result content block {i} has type {kind!r}; only text blocks are "
                                 "supported (this server's model reads no images or documents)")
        return content


class ThinkingBlock(_Block):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Block):
    type: Literal["redacted_thinking"]
    data: str


class _RefusedBlock(_Block):
    @model_validator(mode="after")
    def _refuse(self):
        raise ValueError(f"{self.type} content blocks are not supported: this server's model reads text only")


class ImageBlock(_RefusedBlock):
    type: Literal["image"]


class DocumentBlock(_RefusedBlock):
    type: Literal["document"]


BLOCK_TYPES = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking", "image", "document")
Block = Annotated[Union[TextBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock, RedactedThinkingBlock,
                        ImageBlock, DocumentBlock], Field(discriminator="type")]


class Message(APIModel):
    """One entry of ``messages``; ``role: "system"`` (sent by Claude Code) is rendered where it stands."""

    role: Literal["user", "assistant", "system"]
    content: list[Block]

    _blocks = field_validator("content", mode="before")(classmethod(lambda cls, content: _as_blocks(content)))


class Tool(APIModel):
    """A tool: the client's own (``type`` absent or "custom": name, description, input_schema) or a
    server tool (any other ``type``; dropped by the adapter)."""

    type: str | None = None
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    cache_control: CacheControl | None = None
    defer_loading: bool | None = None

    @property
    def custom(self) -> bool:
        return self.type in (None, "custom")

    @model_validator(mode="after")
    def _schema(self):
        if self.custom and self.input_schema is None:
            raise ValueError(f"tool {self.name!r} needs an input_schema")
        return self


class ToolChoice(APIModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _named(self):
        if (self.type == "tool") != (self.name is not None):
            raise ValueError('tool_choice needs a name exactly when its type is "tool"')
        return self


class Metadata(APIModel):
    user_id: str | None = None

    @property
    def session_id(self) -> str | None:
        """The ``session_id`` Claude Code writes into ``user_id`` (a JSON object as a string)."""
        try:
            value = json.loads(self.user_id) if self.user_id else None
        except ValueError:
            return None
        session = value.get("session_id") if isinstance(value, dict) else None
        return session if isinstance(session, str) and session else None


class Thinking(APIModel):
    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: int | None = None


class CountTokensRequest(APIModel):
    """``POST /v1/messages/count_tokens``: what ``create`` would prompt with, without generating."""

    model: str
    cache_salt: CacheSalt | None = None  # vLLM's field, here on every protocol
    messages: Annotated[list[Message], Field(min_length=1)]
    system: list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    cache_control: CacheControl | None = None  # automatic caching: only its ttl is used

    _system_blocks = field_validator("system", mode="before")(classmethod(lambda cls, system: _as_blocks(system)))

    @model_validator(mode="after")
    def _tools(self):
        names = [t.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools: names must be unique")
        if not self.tools:  # tool_choice without tools is ignored, not refused
            self.tool_choice = None
        elif self.tool_choice is not None and self.tool_choice.type == "tool" and self.tool_choice.name not in names:
            raise ValueError(f"tool_choice names tool {self.tool_choice.name!r}, which is not in tools")
        return self


class MessagesRequest(CountTokensRequest):
    """``POST /v1/messages``."""

    max_tokens: Annotated[int, Field(strict=True, ge=1)]
    stream: bool = False
    stop_sequences: list[Annotated[str, Field(min_length=1)]] | None = Field(None, max_length=MAX_STOP_SEQUENCES)
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(strict=True, ge=0)] | None = None
    metadata: Metadata | None = None

    @property
    def effective_temperature(self) -> float:
        """Anthropic's default temperature is 1; 0 is greedy."""
        return 1.0 if self.temperature is None else float(self.temperature)


def parse_messages_request(obj) -> MessagesRequest:
    """The validated ``/v1/messages`` request of a decoded JSON body; ``APIError`` 400 otherwise."""
    return parse_body(MessagesRequest, obj, BLOCK_TYPES)


def parse_count_tokens_request(obj) -> CountTokensRequest:
    """The validated ``/v1/messages/count_tokens`` request; ``APIError`` 400 otherwise."""
    return parse_body(CountTokensRequest, obj, BLOCK_TYPES)
