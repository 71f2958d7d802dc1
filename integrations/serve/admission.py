"""Admission: which model a request addresses, what it may generate, the bounds of its input and
the in-flight limit.

Each check raises an ``APIError`` with the status OpenAI clients expect (404, 400, 413, 429) and
changes nothing, so a refused request never reaches the engine and never holds a block.
"""

from __future__ import annotations

from radixcache.integrations.serve.errors import bad_request, model_not_found, queue_full, too_large

def validate_counts(body, options) -> None:
    """``APIError`` 413 when a decoded request body has more messages (or Responses input items),
    tools or stop strings than ``options`` (``ServeOptions``: ``--max-messages``, ``--max-tools``,
    ``--max-stop``) allow; checked on the JSON before any field is validated, for every protocol."""
    if not isinstance(body, dict):
        return
    counted = [("messages", options.max_messages, "--max-messages"), ("input", options.max_messages, "--max-messages"),
               ("tools", options.max_tools, "--max-tools"), ("stop", options.max_stop, "--max-stop"),
               ("stop_sequences", options.max_stop, "--max-stop")]
    for field, bound, option in counted:
        value = body.get(field)
        if isinstance(value, list) and len(value) > bound:
            raise too_large(f"{field} has {len(value)} entries; this server takes at most {bound} ({option})",
                            param=field)


def resolve_model(requested: str | None, served_names) -> str:
    """The served name a request addresses: ``requested``, or the first served name when it is None.

    Raises ``APIError`` 404 for a name this server does not serve.
    """
    names = list(served_names)
    if requested is None:
        return names[0]
    if requested not in names:
        raise model_not_found(requested)
    return requested


def max_prompt_tokens(max_context: int, pool_tokens: int | None) -> int:
    """The longest prompt ``max_new_tokens`` accepts: one token must still fit the context and the pool."""
    return min(max_context, pool_tokens if pool_tokens is not None else max_context) - 1


def max_new_tokens(prompt_tokens: int, requested: int | None, max_context: int,
                   pool_tokens: int | None, cap: int | None = None, clamp: bool = False) -> int:
    """How many tokens a request may generate; raises ``APIError`` 400 when it cannot be served.

    A prompt must leave room for one generated token in the model's context (``max_context``) and
    fit the KV pool (``pool_tokens``, None when unknown) with that token. ``requested`` (the
    request's ``max_tokens``) is first lowered to the server's ``cap`` (``--max-output-tokens``,
    None for none); it must then fit the context with the prompt, unless ``clamp`` (protocols whose
    ``max_tokens`` is only a ceiling, like Anthropic's), where it is lowered to what the context
    leaves. None means up to the context (and the cap).
    """
    if prompt_tokens >= max_context:
        raise bad_request(f"This model's maximum context length is {max_context} tokens, but the prompt "
                          f"has {prompt_tokens} tokens.", param="messages", code="context_length_exceeded")
    if pool_tokens is not None and prompt_tokens + 1 > pool_tokens:
        raise bad_request(f"The prompt has {prompt_tokens} tokens, but the KV cache pool holds only "
                          f"{pool_tokens} tokens (start the server with a larger --max-cache-tokens).",
                          param="messages", code="context_length_exceeded")
    room = max_context - prompt_tokens
    if requested is None:
        return room if cap is None else min(room, cap)
    if cap is not None:
        requested = min(requested, cap)
    if requested > room:
        if clamp:
            return room
        raise bad_request(f"This model's maximum context length is {max_context} tokens; the prompt "
                          f"({prompt_tokens} tokens) plus max_tokens ({requested}) exceeds it.",
                          param="max_tokens", code="context_length_exceeded")
    return requested


class AdmissionGate:
    """Bounds the requests in flight (running plus queued) at ``limit``.

    ``acquire()`` takes a slot, or raises ``APIError`` 429 when all ``limit`` are taken; the
    returned ``Slot`` gives it back on ``release()`` (idempotent), which the server calls when the
    response is over, streamed or not. Used from one event loop (no lock needed).
    """

    def __init__(self, limit: int):
        if limit < 1:
            raise ValueError(f"the in-flight limit must be >= 1, got {limit}")
        self.limit = limit
        self.in_flight = 0

    def acquire(self) -> "Slot":
        if self.in_flight >= self.limit:
            raise queue_full(self.limit)
        self.in_flight += 1
        return Slot(self)


class Slot:
    """One taken place of an ``AdmissionGate``."""

    def __init__(self, gate: AdmissionGate):
        self._gate = gate
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._gate.in_flight -= 1
