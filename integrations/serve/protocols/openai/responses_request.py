"""The request model of ``POST /v1/responses`` (pydantic v2) and its items as chat messages.

``parse_responses_request(obj)`` validates a decoded JSON body into a ``ResponsesRequest`` or raises
``APIError`` 400 naming the first offending field (``param`` its dotted path, e.g. ``input.2.type``).

- ``input``: a string (one user message) or a list of items: ``message`` (``type`` may be left out;
  roles user, system, developer, assistant; content a string or ``input_text`` / ``output_text``
  parts), ``function_call``, ``function_call_output`` and ``reasoning``. The ``id`` and ``status`` a
  stateless client echoes back are accepted and change nothing. Image, file and audio parts, and
  other item types, are refused naming them.
- ``tools``: function tools; a ``namespace`` tool's functions are flattened into the list (its calls
  come back with ``namespace`` set); hosted tools (``web_search``, ``file_search``, ...) are dropped
  with a log line (this server cannot run them). Function names must be unique after flattening.
- ``tool_choice`` "auto" / "none" / "required" / ``{"type": "function", "name": ...}``; ignored when
  there are no tools. ``text.format`` text / json_object / json_schema.
- ``prompt_cache_key`` / ``prompt_cache_retention`` are the session and retention hint as in chat.
- Accepted and ignored: ``include``, ``reasoning``, ``metadata``, ``user``, ``client_metadata``,
  ``truncation``, ``service_tier`` and unknown fields. Refused: ``background``, ``conversation``,
  ``top_logprobs`` (not implemented here).

``to_messages(items)`` makes the internal chat messages of the items (see its docstring);
``function_tools(tools)`` the chat-shaped tool list and each function's namespace.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal, Union

from pydantic import Field, PrivateAttr, ValidationError, field_validator, model_validator

from radixcache.integrations.serve.errors import APIError, bad_request
from radixcache.integrations.serve.protocols.openai.requests import keep_seconds
from radixcache.integrations.serve.protocols.schema import APIModel, CacheSalt, parse_body

logger = logging.getLogger("radixcache.serve")

PositiveInt = Annotated[int, Field(strict=True, ge=1)]
_TEXT_PARTS = ("input_text", "output_text", "text")


def _joined_text(content, what: str) -> str:
    """A string, or the text of a list of text parts (any other part is refused, naming it)."""
    if isinstance(content, str):
        return content
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        elif kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            raise ValueError(f"{what} part {i} has type {kind!r}; only input_text / output_text parts "
                             "are supported by this server")
    return "".join(texts)


class MessageItem(APIModel):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Union[str, list[Any]]
    id: str | None = None
    status: str | None = None

    @field_validator("content")
    @classmethod
    def _text_only(cls, content):
        _joined_text(content, "content")
        return content

    @property
    def text(self) -> str:
        return _joined_text(self.content, "content")


class FunctionCallItem(APIModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    namespace: str | None = None
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(APIModel):
    type: Literal["function_call_output"]
    call_id: str
    output: Union[str, list[Any]]
    id: str | None = None
    status: str | None = None

    @field_validator("output")
    @classmethod
    def _text_only(cls, output):
        _joined_text(output, "output")
        return output


class ReasoningItem(APIModel):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[Any] = []
    content: list[Any] | None = None
    encrypted_content: str | None = None


Item = Annotated[Union[MessageItem, FunctionCallItem, FunctionCallOutputItem, ReasoningItem],
                 Field(discriminator="type")]
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


class TextFormat(APIModel):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("text.format json_schema needs a schema")
        return self


class TextOptions(APIModel):
    format: TextFormat = TextFormat()


class NamedFunction(APIModel):
    type: Literal["function"]
    name: str


class ResponsesRequest(APIModel):
    """``POST /v1/responses`` (see the module docstring)."""

    model: str | None = None
    cache_salt: CacheSalt | None = None  # vLLM's field, here on every protocol
    input: Union[Annotated[str, Field(min_length=1)], Annotated[list[Item], Field(min_length=1)]]
    instructions: str | None = None
    tools: list[dict] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedFunction, None] = None
    parallel_tool_calls: bool = True
    max_output_tokens: PositiveInt | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    text: TextOptions | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    include: list[str] | None = None
    reasoning: dict | None = None
    store: bool = True
    stream: bool = False
    previous_response_id: str | None = None
    metadata: dict | None = None
    background: bool | None = None
    conversation: Any = None
    top_logprobs: int | None = None
    _functions: list = PrivateAttr(default_factory=list)
    _namespaces: dict = PrivateAttr(default_factory=dict)

    @field_validator("input", mode="before")
    @classmethod
    def _message_by_default(cls, value):
        if isinstance(value, list):  # an item with a role and no type is a message (EasyInputMessage)
            return [{**v, "type": "message"} if isinstance(v, dict) and "type" not in v and "role" in v else v
                    for v in value]
        return value

    @model_validator(mode="after")
    def _check(self):
        for name in ("background", "top_logprobs"):
            if getattr(self, name):
                raise ValueError(f"{name} is not supported by this server")
        if self.conversation is not None:
            raise ValueError("conversation is not supported by this server (use previous_response_id)")
        self._functions, self._namespaces = function_tools(self.tools or [])
        if not self._functions:  # routers add tool_choice to every body: ignored without tools
            self.tool_choice = None
        if isinstance(self.tool_choice, NamedFunction) and self.tool_choice.name not in self._namespaces:
            raise ValueError(f"tool_choice names function {self.tool_choice.name!r}, which is not in tools")
        return self

    @property
    def functions(self) -> list | None:
        """The function tools in chat's shape (namespaces flattened), or None."""
        return self._functions or None

    @property
    def namespaces(self) -> dict:
        """Function name -> the namespace it came from (None for a top-level function)."""
        return self._namespaces

    @property
    def items(self) -> list:
        """``input`` as items (a string is one user message)."""
        return [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) else self.input

    @property
    def keep_s(self) -> float | None:
        """Seconds to keep the prefix: as chat (``protocol.keep_seconds``)."""
        return keep_seconds(self.prompt_cache_key, self.prompt_cache_retention)

    @property
    def text_format(self) -> TextFormat:
        return self.text.format if self.text is not None else TextFormat()


def _function(tool: dict, where: str) -> dict:
    name = tool.get("name")
    if not isinstance(name, str) or not name or len(name) > 64:
        raise ValueError(f"{where}: a function tool needs a name (1 to 64 characters)")
    params = tool.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise ValueError(f"{where}: parameters must be a JSON schema object")
    function = {"name": name}
    if tool.get("description") is not None:
        function["description"] = str(tool["description"])
    if params is not None:
        function["parameters"] = params
    return {"type": "function", "function": function}


def function_tools(tools: list) -> tuple[list, dict]:
    """``(chat tools, name -> namespace)`` of Responses ``tools`` (see the module docstring)."""
    out, namespaces = [], {}
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "function":
            entries = [(tool, None, f"tools.{i}")]
        elif kind == "namespace":
            inner = tool.get("tools")
            if not isinstance(inner, list):
                raise ValueError(f"tools.{i}: a namespace tool needs a list of tools")
            entries = [(t, tool.get("name"), f"tools.{i}.tools.{j}") for j, t in enumerate(inner)
                       if isinstance(t, dict) and t.get("type", "function") == "function"]
        elif isinstance(kind, str):
            logger.debug("responses: dropped hosted tool %r (this server cannot run it)", kind)
            continue
        else:
            raise ValueError(f"tools.{i}: a tool needs a type")
        for entry, namespace, where in entries:
            function = _function(entry, where)
            name = function["function"]["name"]
            if name in namespaces:
                raise ValueError(f"{where}: function names must be unique ({name!r} twice)")
            namespaces[name] = namespace
            out.append(function)
    return out, namespaces


def to_messages(items) -> list[dict]:
    """The chat messages of Responses items, in order: a message item is a message (developer stays
    developer: the template writes it as system); ``function_call`` items join the assistant message
    right before them (or start one with no content), as ``tool_calls`` with ``call_id`` as the id;
    a ``function_call_output`` is a ``tool`` message; ``reasoning`` items are dropped (this server
    makes none, and the template would not write them back). The reply of a response, echoed back
    this way, is exactly the assistant message its history form was made from."""
    messages: list[dict] = []
    for item in items:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": item.text})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": _joined_text(item.output, "output")})
    return messages


def _as_api_error(exc: ValidationError, obj: dict) -> APIError:
    errors = exc.errors(include_url=False)
    if isinstance(obj.get("input"), list):  # report the list branch of ``input``, not the string one
        errors = [e for e in errors if e["loc"][:2] != ("input", "constrained-str")] or errors
    first = errors[0]
    loc = ".".join(str(p) for p in first["loc"] if p not in ITEM_TYPES and p != "str" and not str(p).startswith(
        ("constrained-str", "list[", "function-after", "literal")))
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "union_tag_invalid":
        message = f"input item type {first['input'].get('type')!r} is not supported by this server"
    return bad_request(f"{loc}: {message}" if loc else message, param=loc or None)


def parse_responses_request(obj) -> ResponsesRequest:
    """The validated request of a decoded JSON body; ``APIError`` 400 otherwise."""
    return parse_body(ResponsesRequest, obj, as_error=_as_api_error)
