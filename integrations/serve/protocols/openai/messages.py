"""Message and tool models of chat requests (pydantic v2), shared by ``requests`` and ``responses_request``.

Roles: system, developer (OpenAI's newer name for system), user, assistant (``content`` may be
null when it has ``tool_calls``; one of the two is required), tool (``tool_call_id`` required).
Content is a string or a list of text parts; other part types (images, audio) are refused, naming
the part. ``ROLES`` lists the roles in the order pydantic reports them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Field, field_validator, model_validator

from radixcache.integrations.serve.protocols.schema import APIModel

ROLES = ("system", "developer", "user", "assistant", "tool")



def _text_of(content) -> str | None:
    """A message content (str, list of text parts, or None) as one string (None stays None)."""
    if content is None or isinstance(content, str):
        return content
    return "".join(part["text"] for part in content)


def _validate_parts(content):
    if isinstance(content, list):
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"content part {i} has type {kind!r}; only text parts "
                                 '({"type": "text", "text": ...}) are supported')
    return content


Content = Union[str, list[dict]]


class FunctionCall(APIModel):
    """A call the assistant made: the function's name and its arguments as a JSON string."""

    name: str
    arguments: str


class ToolCall(APIModel):
    """One entry of an assistant message's ``tool_calls``."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class _Message(APIModel):
    name: str | None = None

    @field_validator("content", check_fields=False)
    @classmethod
    def _text_parts_only(cls, content):
        return _validate_parts(content)

    @property
    def text(self) -> str | None:
        """The content as one string (text parts joined); None when there is no content."""
        return _text_of(getattr(self, "content", None))


class SystemMessage(_Message):
    role: Literal["system"]
    content: Content


class DeveloperMessage(_Message):
    """OpenAI's newer name for system instructions; rendered as a system message."""

    role: Literal["developer"]
    content: Content


class UserMessage(_Message):
    role: Literal["user"]
    content: Content


class AssistantMessage(_Message):
    role: Literal["assistant"]
    content: Content | None = None
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _content_or_calls(self):
        if self.content is None and not self.tool_calls:
            raise ValueError("an assistant message needs content or tool_calls")
        return self


class ToolMessage(_Message):
    role: Literal["tool"]
    content: Content
    tool_call_id: str


Message = Annotated[Union[SystemMessage, DeveloperMessage, UserMessage, AssistantMessage, ToolMessage],
                    Field(discriminator="role")]


class FunctionDefinition(APIModel):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(APIModel):
    """One entry of ``tools``: a function the model may call."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class _NamedFunction(APIModel):
    name: str


class NamedToolChoice(APIModel):
    type: Literal["function"] = "function"
    function: _NamedFunction
