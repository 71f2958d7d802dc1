"""What the request models of every protocol share: their base model, vLLM's ``cache_salt`` field,
the bound on stop strings, and the parse of a decoded JSON body into a model, whose first bad field
is a 400 naming it (``param``: its dotted path).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from radixcache.integrations.serve.errors import APIError, bad_request

MAX_STOP_SEQUENCES = 4  # OpenAI's bound; Anthropic's stop_sequences take the same


class APIModel(BaseModel):
    """Base of every request model: fields OpenAI has and this server does not use are ignored."""

    model_config = ConfigDict(extra="ignore")


CacheSalt = Annotated[str, Field(strict=True, min_length=1, max_length=256)]
"""vLLM's ``cache_salt`` request field (every protocol takes it): the request shares cached blocks
only with requests of the same tenant that send the same salt."""


def _field_path(loc, tags=()) -> str:
    """``messages.2.content`` from pydantic's loc, without the union tags it inserts (the role)."""
    parts = []
    for i, part in enumerate(loc):
        if i and isinstance(loc[i - 1], int) and part in tags:
            continue
        parts.append(str(part))
    return ".".join(parts)


def _as_api_error(exc: ValidationError, tags=()) -> APIError:
    first = exc.errors(include_url=False)[0]
    loc = _field_path(first["loc"], tags)
    message = first["msg"].removeprefix("Value error, ")
    return bad_request(f"{loc}: {message}" if loc else message, param=loc or None)


def parse_body(model: type[BaseModel], obj, tags=(), as_error=None):
    """``model`` validated from a decoded JSON body; ``APIError`` 400 naming the first bad field
    (its dotted path, leaving out the discriminator ``tags`` pydantic puts after a list index), or
    the error ``as_error(exc, obj)`` makes of the ``ValidationError`` when given."""
    if not isinstance(obj, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(obj).__name__}")
    try:
        return model.model_validate(obj)
    except ValidationError as exc:
        raise (as_error(exc, obj) if as_error else _as_api_error(exc, tags)) from None
