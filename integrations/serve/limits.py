"""Access and admission rules: API keys, tenants and cache salts, the in-flight limit, prompt and
model checks.

Each check raises an ``APIError`` with the status OpenAI clients expect (401, 404, 429, 400) and
changes nothing, so a refused request never reaches the engine and never holds a block.
"""

from __future__ import annotations

import hashlib
import hmac

from radixcache.integrations.serve.errors import bad_request, model_not_found, queue_full, too_large, unauthorized

_SALT_PERSON = b"radixcache-salt"


def check_api_key(authorization: str | None, x_api_key: str | None, keys) -> str | None:
    """The API key a request authenticates with, or None when the server has no keys.

    The key may come as ``Authorization: Bearer <key>`` (OpenAI's clients, ``ANTHROPIC_AUTH_TOKEN``)
    or as ``x-api-key: <key>`` (Anthropic's clients): the same key either way, so it gives the same
    tenant salt. It must be one of ``keys`` (compared in constant time); raises ``APIError`` 401
    otherwise.
    """
    if not keys:
        return None
    scheme, _, token = (authorization or "").partition(" ")
    token = token.strip() if scheme.lower() == "bearer" else ""
    for offered in (token, (x_api_key or "").strip()):
        for key in keys if offered else ():
            if hmac.compare_digest(offered.encode(), key.encode()):
                return key
    raise unauthorized()


def check_bearer(authorization: str | None, keys) -> str | None:
    """``check_api_key`` with only the ``Authorization`` header."""
    return check_api_key(authorization, None, keys)


def tenant_of(api_key: str | None, shared: bool) -> str | None:
    """The tenant of a request made with ``api_key``: a keyed digest of the key (never the key
    itself, since a tenant may be stored outside the process), or None for one shared tenant
    (a server without keys, or ``--share-cache-across-keys``). Requests of different tenants share
    no cached block, no stored response and no history."""
    if api_key is None or shared:
        return None
    return hashlib.blake2b(api_key.encode(), digest_size=16, person=_SALT_PERSON).hexdigest()


def cache_salt(tenant: str | None, request_salt: str | None) -> str | None:
    """The cache namespace salt of a request: its tenant's, narrowed by the request's own
    ``cache_salt`` field (vLLM's): two requests share cached blocks only when both agree. None
    when neither is set (the one shared cache)."""
    if request_salt is None:
        return tenant
    text = f"{tenant or ''}\0{request_salt}".encode()
    return hashlib.blake2b(text, digest_size=16, person=_SALT_PERSON).hexdigest()


def check_counts(body, options) -> None:
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
