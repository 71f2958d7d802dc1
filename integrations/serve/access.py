"""Who a request is: its API key checked, its tenant and its cache salt.

``authenticate`` checks the key a request carries (401 without a good one); ``tenant_of`` turns it
into the request's tenant (a keyed digest of the key, one per key unless the server shares its
cache across keys), and ``cache_salt`` narrows the tenant's salt by the request's own ``cache_salt``
field. ``caller_of`` makes the ``Caller`` a request is served as: the tenant owns what it stores
(stored responses), the salt names the KV namespace and the history forms it shares. See
``docs/security.md`` for what each party can see.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import NamedTuple

from radixcache.integrations.serve.errors import unauthorized

_SALT_PERSON = b"radixcache-salt"


def authenticate(authorization: str | None, x_api_key: str | None, keys) -> str | None:
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


def authenticate_bearer(authorization: str | None, keys) -> str | None:
    """``authenticate`` with only the ``Authorization`` header."""
    return authenticate(authorization, None, keys)


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


class Caller(NamedTuple):
    """Who sends a request: ``tenant`` owns what it stores (stored responses; None: the one shared
    tenant), ``salt`` is its cache salt (the KV namespace and the history forms it shares)."""

    tenant: str | None = None
    salt: str | None = None


def caller_of(state, api_key: str | None, request_salt: str | None = None) -> Caller:
    """The ``Caller`` of a request made with ``api_key`` and the request's ``cache_salt`` field
    (validated by the protocol's request model)."""
    tenant = tenant_of(api_key, state.options.share_cache_across_keys)
    return Caller(tenant, cache_salt(tenant, request_salt))
