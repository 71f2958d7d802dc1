"""The FastAPI application: routes, authentication, request validation, JSON and SSE responses.

``create_app(state)`` returns the ASGI app for a ``ServerState``. Routes:

- ``GET /health``: 200 ``{"status": "ok"}`` when an engine is attached and its scheduler runs, else
  503 (error shape);
- ``GET /metrics``: Prometheus text (open, like vLLM's, for scrapers; behind the API key with
  ``--metrics-require-key``);
- ``GET /openapi.json``: the OpenAPI document, every request body described by its model (open);
- ``GET /v1/models`` (with each model's ``root`` and ``max_model_len``), ``GET /v1/loads`` (the
  load SGLang's model gateway polls, ``telemetry/loads.py``), ``POST /v1/chat/completions``,
  ``POST /v1/completions``, ``POST /v1/responses`` with ``GET`` / ``DELETE /v1/responses/{id}``
  (stored responses), and Anthropic's ``POST /v1/messages`` (any query string) and
  ``POST /v1/messages/count_tokens``: behind the API key when the server has keys (a bearer or
  ``x-api-key``, the same key either way; SMG started with ``--api-key K`` sends
  ``Authorization: Bearer K`` on its polls too).

``/version`` and ``/server_info`` stay 404 on purpose: a router that finds either takes the
server for vLLM or SGLang.

Every error is OpenAI's ``{"error": {...}}`` (on the Messages paths Anthropic's ``{"type": "error",
"error": {...}}``, ``protocols.anthropic.messages.error_body``) with the right status: 400 for malformed JSON and
invalid fields (never FastAPI's 422), for prompts longer than the context or the pool; 413 for a
body over ``--max-request-bytes`` (refused before it is read whole, never parsed) or more messages,
tools or stop strings than the server takes; 401 without the key; 404 for an unknown model or route; 429 when every slot is taken; 503 without an engine.
A rejected request changes nothing: it is refused before it reaches the engine. Each protocol is an
adapter module (``protocols/openai/completions.py``): a route parses the body, the adapter builds the ``Job``
and ``respond.respond`` runs it, with the adapter's JSON body and SSE chunks.

``GET /openapi.json`` documents every request body by the pydantic model its route validates
against: routes read their body as raw JSON and validate it themselves (so that a bad body is a 400
in the protocol's own error shape, never FastAPI's 422), so FastAPI cannot see their models;
``BodySchemas.body(Model)`` gives a route the ``openapi_extra`` that documents ``Model`` as its JSON
body, and ``install(app)`` makes the app's document carry every model (and the models they refer
to) under ``components.schemas``. The document is generated once, on first request.
"""

from __future__ import annotations

import json
import logging
from contextlib import asynccontextmanager
from functools import partial

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException

from radixcache import __version__
from radixcache.integrations.serve.protocols.anthropic import messages as anthropic_messages
from radixcache.integrations.serve.protocols.openai import (bodies as R, completions as openai_completions,
                                                            responses as openai_responses)
from radixcache.integrations.serve.protocols.anthropic.requests import (CountTokensRequest, MessagesRequest,
                                                              parse_count_tokens_request,
                                                              parse_messages_request)
from radixcache.integrations.serve.errors import (APIError, bad_request, internal, method_not_allowed,
                                                  route_not_found, too_large, unavailable)
from radixcache.integrations.serve.admission import validate_counts
from radixcache.integrations.serve.access import tenant_of, authenticate
from radixcache.integrations.serve.telemetry.loads import worker_loads
from radixcache.integrations.serve.protocols.openai.responses_request import ResponsesRequest, parse_responses_request
from radixcache.integrations.serve.protocols.openai.requests import (ChatCompletionRequest, CompletionRequest,
                                                    parse_chat_request, parse_completion_request)
from radixcache.integrations.serve.requests.respond import respond


_REF = "#/components/schemas/{model}"


class BodySchemas:
    """The request-body models of one app's routes (see the module docstring). Models of different
    protocols may share a class name (chat's and Anthropic's ``Tool``): the schemas are generated
    together, and pydantic gives colliding names their module's prefix."""

    def __init__(self):
        self.models: list = []  # (model, the route's schema dict, filled in by install)

    def body(self, model, description: str | None = None) -> dict:
        """``openapi_extra`` for a route whose JSON body is validated by ``model`` (a pydantic model)."""
        schema: dict = {}
        self.models.append((model, schema))
        body = {"required": True, "content": {"application/json": {"schema": schema}}}
        if description:
            body["description"] = description
        return {"requestBody": body}

    def install(self, app) -> None:
        """Serve ``app``'s document with these schemas in it."""
        refs, document_defs = models_json_schema([(m, "validation") for m, _ in self.models], ref_template=_REF)
        for model, schema in self.models:
            schema.update(refs[(model, "validation")])
        schemas = document_defs.get("$defs", {})

        def document() -> dict:
            if app.openapi_schema is None:
                doc = get_openapi(title=app.title, version=app.version, routes=app.routes,
                                  description=app.description or None)
                doc.setdefault("components", {}).setdefault("schemas", {}).update(schemas)
                app.openapi_schema = doc
            return app.openapi_schema

        app.openapi = document


logger = logging.getLogger("radixcache.serve")


def _error_response(state, exc: APIError, path: str = "") -> JSONResponse:
    state.metrics.observe_rejected(exc.status)
    if anthropic_messages.is_messages_path(path):
        status, body = anthropic_messages.error_body(exc)
        return JSONResponse(body, status_code=status, headers=exc.headers)
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _json_body(request: Request, state):
    """The decoded JSON body, read only up to the server's bound (413 past it, before anything is
    parsed: a declared ``Content-Length`` over it is refused unread, a chunked body as soon as it
    passes it), with its counts checked (``limits.validate_counts``)."""
    limit = state.max_request_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large(f"the request body is {int(declared):,} bytes; this server takes at most {limit:,} "
                        "(--max-request-bytes)")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(f"the request body is over {limit:,} bytes, this server's bound (--max-request-bytes)")
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks))
    except (UnicodeDecodeError, ValueError) as exc:
        raise bad_request(f"the request body is not valid JSON ({exc})") from None
    validate_counts(body, state.options)
    return body


def create_app(state) -> FastAPI:
    """The ASGI app serving ``state`` (see the module docstring)."""

    @asynccontextmanager
    async def lifespan(app):
        yield
        await state.shutdown()

    app = FastAPI(title="radixcache", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json")
    bodies = BodySchemas()

    @app.exception_handler(APIError)
    async def api_error(request, exc: APIError):
        return _error_response(state, exc, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, exc):
        return _error_response(state, bad_request(f"invalid request: {exc.errors()[0].get('msg', exc)}"),
                               request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc):
        if exc.status_code == 404:
            return _error_response(state, route_not_found(request.url.path), request.url.path)
        if exc.status_code == 405:
            return _error_response(state, method_not_allowed(request.method, request.url.path), request.url.path)
        return _error_response(state, APIError(exc.status_code, str(exc.detail)), request.url.path)

    @app.exception_handler(Exception)
    async def unexpected(request, exc):
        logger.exception("unexpected error on %s", request.url.path)
        return _error_response(state, internal(f"internal error: {type(exc).__name__}"), request.url.path)

    def authorize(request: Request) -> str | None:
        headers = request.headers
        return authenticate(headers.get("authorization"), headers.get("x-api-key"), state.options.api_keys)

    @app.get("/health")
    async def health():
        if state.engine is None:
            raise unavailable("no generation engine is attached to this server")
        if not getattr(state.engine, "alive", True):
            raise unavailable("the engine's scheduler thread has stopped")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics(request: Request):
        if state.options.metrics_require_key:
            authorize(request)
        body, content_type = state.metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        return R.model_list(state.model_names, R.now(), state.info.name, state.limits.max_context_tokens)

    @app.get("/v1/loads")
    async def loads(request: Request):
        authorize(request)
        return worker_loads(state)

    @app.post("/v1/chat/completions", openapi_extra=bodies.body(ChatCompletionRequest))
    async def chat_completions(request: Request):
        key = authorize(request)
        job = await openai_completions.chat_job(state, parse_chat_request(await _json_body(request, state)), key)
        return await respond(state, job, request, openai_completions.body, openai_completions.chunks)

    @app.post("/v1/completions", openapi_extra=bodies.body(CompletionRequest))
    async def completions(request: Request):
        key = authorize(request)
        job = await openai_completions.completion_job(state, parse_completion_request(await _json_body(request, state)), key)
        return await respond(state, job, request, openai_completions.body, openai_completions.chunks)

    @app.post(anthropic_messages.PATH, openapi_extra=bodies.body(MessagesRequest))
    async def messages(request: Request):
        key = authorize(request)
        req = parse_messages_request(await _json_body(request, state))
        job, reply = await anthropic_messages.messages_job(state, req, key)
        return await respond(state, job, request, reply.body, reply.events)

    @app.post(anthropic_messages.PATH + "/count_tokens", openapi_extra=bodies.body(CountTokensRequest))
    async def count_tokens(request: Request):
        key = authorize(request)
        return await anthropic_messages.count_tokens(state, parse_count_tokens_request(await _json_body(request, state)), key)

    @app.post("/v1/responses", openapi_extra=bodies.body(ResponsesRequest))
    async def responses(request: Request):
        key = authorize(request)
        job, turn = await openai_responses.responses_job(state, parse_responses_request(await _json_body(request, state)), key)
        return await respond(state, job, request, partial(openai_responses.body, state, turn),
                             partial(openai_responses.events, state, turn))

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, request: Request):
        stored = state.responses.get(response_id, tenant_of(authorize(request), state.options.share_cache_across_keys))
        if stored is None:
            raise openai_responses.not_found(response_id)
        return stored.response

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request):
        if not state.responses.delete(response_id, tenant_of(authorize(request), state.options.share_cache_across_keys)):
            raise openai_responses.not_found(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    bodies.install(app)
    return app
