"""The FastAPI application: routes, authentication, request validation, JSON and SSE responses.

``create_app(state)`` returns the ASGI app for a ``ServerState``. Routes:

- ``GET /health``: 200 ``{"status": "ok"}`` when an engine is attached, else 503 (error shape);
- ``GET /metrics``: Prometheus text (open, like vLLM's, for scrapers);
- ``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions``: behind the bearer
  key when the server has keys.

Every error is OpenAI's ``{"error": {...}}`` with the right status: 400 for malformed JSON and
invalid fields (never FastAPI's 422), for prompts longer than the context or the pool; 401 without
the key; 404 for an unknown model or route; 429 when every slot is taken; 503 without an engine.
A rejected request changes nothing: it is refused before it reaches the engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from radixcache.integrations.serve import responses as R
from radixcache.integrations.serve.chat_template import RenderError
from radixcache.integrations.serve.engine_client import SamplingParams
from radixcache.integrations.serve.errors import (APIError, bad_request, internal, method_not_allowed,
                                                  route_not_found, unavailable)
from radixcache.integrations.serve.generation import Generation, Job
from radixcache.integrations.serve.limits import (check_bearer, check_token_ids, max_new_tokens,
                                                  resolve_model, tenant_salt)
from radixcache.integrations.serve.protocol import parse_chat_request, parse_completion_request

logger = logging.getLogger("radixcache.serve")


def _error_response(state, exc: APIError) -> JSONResponse:
    state.metrics.observe_rejected(exc.status)
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _json_body(request: Request):
    raw = await request.body()
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise bad_request(f"the request body is not valid JSON ({exc})") from None


def create_app(state) -> FastAPI:
    """The ASGI app serving ``state`` (see the module docstring)."""

    @asynccontextmanager
    async def lifespan(app):
        yield
        await state.shutdown()

    app = FastAPI(title="radixcache", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(APIError)
    async def api_error(request, exc: APIError):
        return _error_response(state, exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, exc):
        return _error_response(state, bad_request(f"invalid request: {exc.errors()[0].get('msg', exc)}"))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc):
        if exc.status_code == 404:
            return _error_response(state, route_not_found(request.url.path))
        if exc.status_code == 405:
            return _error_response(state, method_not_allowed(request.method, request.url.path))
        return _error_response(state, APIError(exc.status_code, str(exc.detail)))

    @app.exception_handler(Exception)
    async def unexpected(request, exc):
        logger.exception("unexpected error on %s", request.url.path)
        return _error_response(state, internal(f"internal error: {type(exc).__name__}"))

    def authorize(request: Request) -> str | None:
        return check_bearer(request.headers.get("authorization"), state.options.api_keys)

    @app.get("/health")
    async def health():
        if state.engine is None:
            raise unavailable("no generation engine is attached to this server")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        body, content_type = state.metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        return R.model_list(state.model_names, R.now())

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        key = authorize(request)
        req = parse_chat_request(await _json_body(request))
        model = resolve_model(req.model, state.model_names)
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        try:
            prompt = await state.run_cpu(state.renderer.render, messages, tools)
        except RenderError as exc:
            raise bad_request(str(exc), param="messages") from None
        job = _job(state, "chat", req, model, prompt.token_ids, key, messages=messages, tools=tools,
                   parse_tools=req.parses_tool_calls)
        return await _respond(state, job, request)

    @app.post("/v1/completions")
    async def completions(request: Request):
        key = authorize(request)
        req = parse_completion_request(await _json_body(request))
        model = resolve_model(req.model, state.model_names)
        if isinstance(req.prompt, str):
            ids = await state.run_cpu(lambda: tuple(state.tokenizer(req.prompt)["input_ids"]))
        else:
            check_token_ids(req.prompt, state.info.vocab_size)
            ids = tuple(req.prompt)
        return await _respond(state, _job(state, "completion", req, model, ids, key), request)

    return app


def _job(state, kind: str, req, model: str, prompt_ids, key, **chat) -> Job:
    limits = state.limits
    budget = max_new_tokens(len(prompt_ids), req.max_new_tokens, limits.max_context_tokens, limits.pool_tokens)
    params = SamplingParams(max_new_tokens=budget, temperature=req.effective_temperature,
                            top_p=req.effective_top_p, n=req.n, seed=req.seed,
                            stop_token_ids=state.info.stop_token_ids)
    return Job(kind, model, tuple(prompt_ids), params, req.stop_strings, req.stream, req.include_usage,
               tenant_salt(key, state.options.isolate_cache_by_key), retain_s=req.retain_s, **chat)


async def _respond(state, job: Job, request: Request):
    if state.engine is None:
        raise unavailable("no generation engine is attached to this server")
    slot = state.gate.acquire()
    try:
        generation = Generation(state, job, slot)
        generation.start()
    except BaseException:
        slot.release()
        raise
    if job.stream:
        return StreamingResponse(_stream(generation), media_type="text/event-stream")
    return await _collect(generation, request)


def _usage(generation: Generation) -> dict:
    return R.usage(len(generation.job.prompt_ids), generation.completion_tokens, generation.cached_tokens)


async def _collect(generation: Generation, request: Request):
    """Run to the end (aborting if the client disconnects) and answer one JSON body."""
    async def watch():
        while (await request.receive())["type"] != "http.disconnect":
            pass
        generation.close()

    watcher = asyncio.get_running_loop().create_task(watch())
    try:
        async for _ in generation.deltas():
            pass
    finally:
        watcher.cancel()
        generation.close()
    job, created = generation.job, R.now()
    if job.kind == "chat":
        choices = [R.chat_choice(i, R.assistant_message(c.content if c.content or not c.tool_calls else None,
                                                        c.tool_calls), c.finish)
                   for i, c in enumerate(generation.choices)]
        body = R.chat_completion(generation.request_id, created, job.model, choices, _usage(generation))
    else:
        choices = [R.text_choice(i, c.content, c.finish) for i, c in enumerate(generation.choices)]
        body = R.completion(generation.request_id, created, job.model, choices, _usage(generation))
    return JSONResponse(body)


async def _stream(generation: Generation):
    """SSE chunks as the deltas come; on disconnect Starlette closes this generator: abort."""
    job, created, rid = generation.job, R.now(), generation.request_id
    chat = job.kind == "chat"

    def chunk(choices, usage_=None):
        if chat:
            return R.sse(R.chat_chunk(rid, created, job.model, choices, usage_, usage_null=job.include_usage))
        return R.sse(R.completion(rid, created, job.model, choices, usage_, usage_null=job.include_usage))

    try:
        if chat:
            yield chunk([R.delta_choice(i, {"role": "assistant", "content": ""})
                         for i in range(job.params.n)])
        async for d in generation.deltas():
            last = d.finish_reason is not None and generation.finished
            usage_ = _usage(generation) if last and not job.include_usage else None
            if chat:
                delta = {"content": d.content} if d.content else {}
                if d.tool_calls:
                    delta["tool_calls"] = R.tool_call_deltas(d.tool_calls)
                yield chunk([R.delta_choice(d.index, delta, d.finish_reason)], usage_)
            else:
                yield chunk([R.text_choice(d.index, d.content, d.finish_reason)], usage_)
        if job.include_usage:
            yield (R.sse(R.chat_chunk(rid, created, job.model, [], _usage(generation))) if chat
                   else R.sse(R.completion(rid, created, job.model, [], _usage(generation))))
        yield R.SSE_DONE
    except APIError as exc:
        generation.state.metrics.observe_rejected(exc.status)
        yield R.sse(exc.body())
        yield R.SSE_DONE
    finally:
        generation.close()
