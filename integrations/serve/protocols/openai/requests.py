"""Request models of the OpenAI endpoints the server answers (pydantic v2).

``parse_chat_request(obj)`` / ``parse_completion_request(obj)`` take the decoded JSON body and return
a validated request, or raise ``APIError`` 400 naming the first offending field (``param`` is its
dotted path, e.g. ``messages.2.role``). Numbers are strict: ``"3"`` is not a ``max_tokens``.

What is honoured: every message role (system, developer, user, assistant with ``tool_calls`` and
``content: null``, tool), ``tools`` / ``tool_choice``, ``stream`` and ``stream_options.include_usage``,
``n``, ``temperature`` (OpenAI's meaning: 0 is greedy, the default 1 samples), ``top_p``,
``max_tokens`` / ``max_completion_tokens``, ``stop``, ``seed``, ``logprobs`` (chat: with
``top_logprobs`` up to 20; completions: an int up to 5), and structured output
(``output_constraint``): chat's ``response_format`` json_object / json_schema, and ``tool_choice``
"required" or a named function with ``parallel_tool_calls``. The cache finds a prefix by its
tokens alone; ``prompt_cache_key`` (a session) and ``prompt_cache_retention`` ("in_memory": a few
minutes, "24h": a day; anything else is a 400) become a retention hint (``keep_s``): what the
request computed is evicted only after prefixes without a live hint. A key without a retention means
"in_memory", OpenAI's default. ``cache_salt`` (vLLM's) narrows which requests share cached blocks. Fields that would change
the output but are not implemented (penalties, ``logit_bias``, ``echo``, ``suffix``, ``best_of`` > 1)
are refused with 400 rather than ignored; fields that change nothing here (``user``, ``metadata``,
``store``, ...) and unknown fields are accepted and ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from radixcache.integrations.serve.errors import bad_request
from radixcache.integrations.serve.protocols.openai.messages import ROLES, Message, NamedToolChoice, Tool
from radixcache.integrations.serve.protocols.schema import MAX_STOP_SEQUENCES, APIModel, CacheSalt, parse_body
from radixcache.integrations.serve.requests.structured import (OutputConstraint, json_constraint,
                                                               tool_call_constraint)

MAX_N = 128
MAX_TOP_LOGPROBS = 20  # chat's top_logprobs (OpenAI's bound)
MAX_COMPLETION_LOGPROBS = 5  # completions' logprobs (OpenAI's bound)

PositiveInt = Annotated[int, Field(strict=True, ge=1)]
# prompt_cache_retention -> seconds a finished request's prefix is retained (OpenAI keeps "in_memory"
# prefixes for 5-10 minutes of inactivity, "24h" ones for a day)
RETENTION_SECONDS = {"in_memory": 300.0, "24h": 86400.0}


class StreamOptions(APIModel):
    include_usage: bool = False


# ---------------------------------------------------------------------- shared sampling fields
def keep_seconds(prompt_cache_key, prompt_cache_retention) -> float | None:
    """The keep hint of OpenAI's cache fields (chat, completions, Responses): the retention asked
    for, or the in-memory one for a request with a ``prompt_cache_key``; None without either."""
    if prompt_cache_retention is not None:
        return RETENTION_SECONDS[prompt_cache_retention]
    return RETENTION_SECONDS["in_memory"] if prompt_cache_key is not None else None


class _Sampling(APIModel):
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(strict=True, ge=1, le=MAX_N)] = 1
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    stop: Any = None
    seed: Annotated[int, Field(strict=True)] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    cache_salt: CacheSalt | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict | None = None

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop):
        if stop is not None and not isinstance(stop, str) and not (
                isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
            raise ValueError("stop must be a string or a list of strings")
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences, got {len(stops)}")
        if any(s == "" for s in stops):
            raise ValueError("a stop sequence must not be empty")
        return stop

    @model_validator(mode="after")
    def _refuse_unimplemented(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise ValueError(f"{name} is not supported by this server (only 0)")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported by this server")
        return self

    @property
    def stop_strings(self) -> list[str]:
        """``stop`` as a list (empty when absent)."""
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def effective_temperature(self) -> float:
        """The temperature to sample at: OpenAI's default is 1; 0 means greedy."""
        return 1.0 if self.temperature is None else float(self.temperature)

    @property
    def effective_top_p(self) -> float:
        return 1.0 if self.top_p is None else float(self.top_p)

    @property
    def keep_s(self) -> float | None:
        """Seconds to keep this request's prefix (see the module docstring); None: no hint."""
        return keep_seconds(self.prompt_cache_key, self.prompt_cache_retention)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[Message], Field(min_length=1)]
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    logprobs: Annotated[bool, Field(strict=True)] | None = None
    top_logprobs: Annotated[int, Field(strict=True, ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    response_format: dict | None = None
    parallel_tool_calls: Annotated[bool, Field(strict=True)] | None = None

    @model_validator(mode="after")
    def _validate_tools(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs: true")
        _validate_response_format(self.response_format)
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools: function names must be unique")
        if not self.tools:  # routers (SMG) add tool_choice "auto" to every body: ignored, not refused
            self.tools, self.tool_choice = None, None
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice names function {self.tool_choice.function.name!r}, "
                             "which is not in tools")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        """``max_completion_tokens`` if given, else ``max_tokens``; None means up to the context."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def parses_tool_calls(self) -> bool:
        """Tool calls are parsed out of the reply only when the request has tools and allows calls."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def logprobs_k(self) -> int | None:
        """Alternatives per token for the engine's logprobs (None: no logprobs)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def output_constraint(self) -> OutputConstraint | None:
        """What the reply must satisfy: tool calls for ``tool_choice`` "required" or a named
        function (one call when ``parallel_tool_calls`` is false), else a JSON ``response_format``;
        None for free text. Both at once is a 400."""
        tools = None
        if self.tools and (self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)):
            forced = self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None
            tools = tool_call_constraint([t.model_dump(exclude_none=True) for t in self.tools], forced,
                                         parallel=self.parallel_tool_calls is not False)
        fmt = self.response_format or {}
        kind = fmt.get("type", "text")
        if kind == "text":
            return tools
        if tools is not None:
            raise bad_request("response_format and a required tool_choice cannot both constrain the reply",
                              param="response_format")
        if kind == "json_object":
            return json_constraint()
        spec = fmt["json_schema"]
        return json_constraint(spec.get("schema") or {"type": "object"}, strict=spec.get("strict") is True)


def _validate_response_format(fmt) -> None:
    """``ValueError`` naming what is wrong in a chat ``response_format`` (OpenAI's three shapes)."""
    if fmt is None:
        return
    kind = fmt.get("type")
    if kind not in ("text", "json_object", "json_schema"):
        raise ValueError(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}")
    if kind != "json_schema":
        return
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise ValueError("response_format.json_schema must be an object with the schema")
    if "schema" in spec and not isinstance(spec["schema"], dict):
        raise ValueError("response_format.json_schema.schema must be a JSON object")
    if "strict" in spec and not isinstance(spec["strict"], (bool, type(None))):
        raise ValueError("response_format.json_schema.strict must be a boolean")


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: one prompt, as text or as token ids."""

    prompt: Any
    logprobs: Annotated[int, Field(strict=True, ge=0, le=MAX_COMPLETION_LOGPROBS)] | None = None
    max_tokens: PositiveInt = 16
    echo: bool = False
    suffix: str | None = None
    best_of: Annotated[int, Field(strict=True, ge=1)] | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, prompt):
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty")
            return prompt
        if not isinstance(prompt, list):
            raise ValueError("prompt must be a string or a list of token ids")
        if not prompt:
            raise ValueError("the prompt is empty")
        if any(isinstance(p, (str, list)) for p in prompt):
            raise ValueError("send one prompt per request (a string or a list of token ids)")
        if not all(type(p) is int and p >= 0 for p in prompt):
            raise ValueError("token ids must be non-negative integers")
        return prompt

    @model_validator(mode="after")
    def _refuse_unimplemented_completion(self):
        if self.echo:
            raise ValueError("echo is not supported by this server")
        if self.suffix:
            raise ValueError("suffix is not supported by this server")
        if self.best_of not in (None, 1):
            raise ValueError("best_of is not supported by this server (use n)")
        return self

    @property
    def max_new_tokens(self) -> int:
        return self.max_tokens

    @property
    def logprobs_k(self) -> int | None:
        """Alternatives per token for the engine's logprobs (None: no logprobs)."""
        return self.logprobs


def parse_chat_request(obj) -> ChatCompletionRequest:
    """The validated chat request of a decoded JSON body; ``APIError`` 400 otherwise."""
    return parse_body(ChatCompletionRequest, obj, ROLES)


def parse_completion_request(obj) -> CompletionRequest:
    """The validated completion request of a decoded JSON body; ``APIError`` 400 otherwise."""
    return parse_body(CompletionRequest, obj, ROLES)
