"""The Anthropic Messages protocol (``POST /v1/messages``, ``POST /v1/messages/count_tokens``), as a
thin adapter over ``job`` and ``generation``, like ``protocols/openai/completions.py``.

Request model (``requests.py``) -> the internal ``Conversation`` (``convert.py``)
-> ``render_conversation`` -> ``new_job`` (the engine's ``Request``; ``max_tokens`` is clamped to
what the context leaves, ``stop_sequences`` / ``temperature`` / ``top_p`` / ``top_k`` as sent,
``tool_choice`` any / tool as an ``OutputConstraint``, the retention hint from ``cache_control``
and the session), and the generation's ``Delta``s -> a Messages body or its SSE stream.

The stream: ``ping`` every ``PING_S`` seconds until the first output (a long prefill), then
``message_start`` (with the usage: the cached tokens are known once the request is admitted), a
``ping``, per content block ``content_block_start`` / ``content_block_delta`` (``text_delta``;
``input_json_delta`` with a call's whole input) / ``content_block_stop``, ``message_delta``
(``stop_reason``, ``stop_sequence``, and a usage whose input and cache fields equal
``message_start``'s) and ``message_stop``. Every event has its ``event:`` line. An error once the
stream has begun is an ``error`` event, which the SDKs raise.

Usage: ``input_tokens`` is the prompt minus the cached tokens, ``cache_read_input_tokens`` the
cached ones, ``cache_creation_input_tokens`` 0; ``count_tokens`` answers the prompt's length, their
sum. Errors are Anthropic's ``{"type": "error", "error": {"type", "message"}}`` (``error_body``);
an over-long prompt says ``prompt is too long: N tokens > M maximum`` (Claude Code compacts on it).
"""

from __future__ import annotations

import asyncio
import json

from radixcache.integrations.serve.protocols.anthropic import convert as C
from radixcache.integrations.serve.errors import APIError, bad_request
from radixcache.integrations.serve.requests.job import Job, new_job, render_conversation
from radixcache.integrations.serve.access import caller_of
from radixcache.integrations.serve.admission import max_prompt_tokens, resolve_model

PING_S = 5.0
PATH = "/v1/messages"
# HTTP status -> (status answered, Anthropic's error type); a 503 (engine overloaded, shutting
# down) is Anthropic's 529 overloaded_error, which its clients retry
ERROR_TYPES = {400: (400, "invalid_request_error"), 401: (401, "authentication_error"),
               403: (403, "permission_error"), 404: (404, "not_found_error"), 405: (405, "invalid_request_error"),
               413: (413, "request_too_large"), 429: (429, "rate_limit_error"), 500: (500, "api_error"),
               503: (529, "overloaded_error")}


def is_messages_path(path: str) -> bool:
    """Whether ``path`` is one of this protocol's (its errors then take Anthropic's shape)."""
    return path == PATH or path.startswith(PATH + "/")


def error_body(exc: APIError) -> tuple[int, dict]:
    """The HTTP status and Anthropic error body of ``exc``."""
    status, kind = ERROR_TYPES.get(exc.status, (exc.status, "api_error"))
    return status, {"type": "error", "error": {"type": kind, "message": exc.message}}


def _sse(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _conversation(state, req, caller):
    inline = await state.render(C.renders_inline_system, state.renderer)
    conversation = C.conversation_of(req, inline, state.renderer.thinking_switch)
    return conversation, await render_conversation(state, conversation, caller)


async def count_tokens(state, req, key: str | None) -> dict:
    """The body of ``count_tokens``: the prompt ``create`` would send to the model, counted."""
    resolve_model(req.model, state.model_names)
    _, prompt = await _conversation(state, req, caller_of(state, key, req.cache_salt))
    return {"input_tokens": len(prompt.token_ids)}


async def messages_job(state, req, key: str | None) -> tuple[Job, "MessagesReply"]:
    """The job of a validated ``MessagesRequest`` and the reply that answers it."""
    model = resolve_model(req.model, state.model_names)
    caller = caller_of(state, key, req.cache_salt)
    conversation, prompt = await _conversation(state, req, caller)
    mode = C.tool_mode(req, conversation)
    reply = MessagesReply()
    session = req.metadata.session_id if req.metadata is not None else None
    try:
        job = new_job(state, "anthropic", model, prompt.token_ids, id_prefix="msg", caller=caller,
                      max_tokens=req.max_tokens, temperature=req.effective_temperature,
                      top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0,
                      stop=req.stop_sequences or (), stream=req.stream, keep_s=C.retain_seconds(req, session),
                      conversation=conversation, parse_tools=mode.parse_tools, clamp_max_tokens=True,
                      constraint=mode.constraint, reply_form=reply.echo, single_tool_call=mode.single_call)
    except APIError as exc:
        if exc.code != "context_length_exceeded":
            raise
        limits = state.limits
        limit = max_prompt_tokens(limits.max_context_tokens, limits.pool_tokens)
        raise bad_request(f"prompt is too long: {len(prompt.token_ids)} tokens > {limit} maximum",
                          param="messages", code="context_length_exceeded") from None
    return job, reply


class MessagesReply:
    """The Messages answer of one job: its JSON ``body`` or SSE ``events``, and ``echo`` (the
    reply as the client sends it back, the job's ``reply_form``). With ``disable_parallel_tool_use``
    the job keeps only the first tool call (``Job.single_tool_call``)."""

    @staticmethod
    def echo(reply: dict) -> dict:
        return C.echoed_reply(reply)

    @staticmethod
    def blocks(sample) -> list[dict]:
        return C.reply_blocks(sample.message())

    @staticmethod
    def usage(generation) -> dict:
        cached = generation.cached_tokens
        return {"input_tokens": len(generation.job.prompt_ids) - cached, "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": cached, "output_tokens": generation.completion_tokens}

    @staticmethod
    def stop(sample) -> tuple[str, str | None]:
        """``(stop_reason, stop_sequence)`` of a finished sample."""
        if sample.finish == "tool_calls":
            return "tool_use", None
        if sample.finish == "length":
            return "max_tokens", None
        if sample.text.stopped:
            return "stop_sequence", sample.text.stop_string
        return "end_turn", None

    def message(self, generation, content: list, stop=(None, None)) -> dict:
        return {"id": generation.request_id, "type": "message", "role": "assistant", "model": generation.job.model,
                "content": content, "stop_reason": stop[0], "stop_sequence": stop[1],
                "usage": self.usage(generation)}

    def body(self, generation) -> dict:
        """The JSON body of a finished message."""
        sample = generation.choices[0]
        return self.message(generation, self.blocks(sample), self.stop(sample))

    async def events(self, generation):
        """The SSE text of a streamed message (see the module docstring)."""
        deltas = generation.deltas().__aiter__()
        pending = None
        try:
            pending = asyncio.ensure_future(deltas.__anext__())
            while not (await asyncio.wait({pending}, timeout=PING_S))[0]:  # a long prefill
                yield _sse("ping", {"type": "ping"})
            try:
                first = [pending.result()]
            except StopAsyncIteration:
                first = []
            yield _sse("message_start", {"type": "message_start", "message": self.message(generation, [])})
            yield _sse("ping", {"type": "ping"})
            index, text_open = 0, False
            async for delta in _chain(first, deltas):
                if delta.content:
                    if not text_open:
                        text_open = True
                        yield _sse("content_block_start", {"type": "content_block_start", "index": index,
                                                           "content_block": {"type": "text", "text": ""}})
                    yield _sse("content_block_delta", {"type": "content_block_delta", "index": index,
                                                       "delta": {"type": "text_delta", "text": delta.content}})
            if text_open:
                yield _sse("content_block_stop", {"type": "content_block_stop", "index": index})
                index += 1
            sample = generation.choices[0]
            for block in self.blocks(sample):
                if block["type"] != "tool_use":
                    continue
                yield _sse("content_block_start", {"type": "content_block_start", "index": index,
                                                   "content_block": {**block, "input": {}}})
                partial = json.dumps(block["input"], ensure_ascii=False)
                yield _sse("content_block_delta", {"type": "content_block_delta", "index": index,
                                                   "delta": {"type": "input_json_delta", "partial_json": partial}})
                yield _sse("content_block_stop", {"type": "content_block_stop", "index": index})
                index += 1
            reason, sequence = self.stop(sample)
            yield _sse("message_delta", {"type": "message_delta",
                                         "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                         "usage": self.usage(generation)})
            yield _sse("message_stop", {"type": "message_stop"})
        except APIError as exc:
            generation.state.metrics.observe_rejected(exc.status)
            yield _sse("error", error_body(exc)[1])
        finally:
            if pending is not None and not pending.done():
                pending.cancel()


async def _chain(first: list, rest):
    for item in first:
        yield item
    async for item in rest:
        yield item
