"""The OpenAI chat-completions and completions protocols, as adapters over ``job`` and ``generation``.

Each is a thin adapter: its request model (``requests.py``) -> the internal ``Conversation`` or a
prompt -> ``job.new_job`` (the engine's ``Request``), and ``generation.deltas()`` -> OpenAI's JSON
body or SSE chunks (``bodies.py``). ``respond.respond`` runs the job either way.

Streams follow OpenAI: a first chunk with the assistant role, one chunk per delta, the usage on the
chunk that finishes the last choice (or, with ``stream_options.include_usage``, on a last chunk
with no choices), then ``data: [DONE]``. An error once the stream has started (a failed step, the
server shutting down) is sent as one ``{"error": ...}`` event before ``[DONE]``, which the
``openai`` client raises as an ``APIError`` with that message.
"""

from __future__ import annotations

from radixcache.integrations.serve.protocols.openai import bodies as R
from radixcache.integrations.serve.errors import APIError
from radixcache.integrations.serve.requests.job import Conversation, Job, new_job, render_conversation
from radixcache.integrations.serve.access import caller_of
from radixcache.integrations.serve.admission import resolve_model


def _settings(req, caller) -> dict:
    """The sampling settings and session hints shared by both protocols, for ``new_job``."""
    return dict(caller=caller, max_tokens=req.max_new_tokens, temperature=req.effective_temperature,
                top_p=req.effective_top_p, n=req.n, seed=req.seed, stop=req.stop_strings, stream=req.stream,
                include_usage=req.include_usage, keep_s=req.keep_s, logprobs=req.logprobs_k)


async def chat_job(state, req, key: str | None) -> Job:
    """The job of a validated ``ChatCompletionRequest`` (its messages through the chat template)."""
    model = resolve_model(req.model, state.model_names)
    caller = caller_of(state, key, req.cache_salt)
    conversation = Conversation([m.model_dump(exclude_none=True) for m in req.messages],
                                [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None)
    prompt = await render_conversation(state, conversation, caller)
    return new_job(state, "chat", model, prompt.token_ids, id_prefix="chatcmpl", conversation=conversation,
                   parse_tools=req.parses_tool_calls, constraint=req.output_constraint(),
                   single_tool_call=req.parallel_tool_calls is False, **_settings(req, caller))


async def completion_job(state, req, key: str | None) -> Job:
    """The job of a validated ``CompletionRequest`` (a text prompt is tokenized as it is)."""
    model = resolve_model(req.model, state.model_names)
    caller = caller_of(state, key, req.cache_salt)
    if isinstance(req.prompt, str):
        ids = await state.render(lambda: state.tokenizer(req.prompt)["input_ids"])
    else:
        ids = req.prompt
    return new_job(state, "completion", model, ids, id_prefix="cmpl", **_settings(req, caller))


def _usage(generation) -> dict:
    return R.usage(len(generation.job.prompt_ids), generation.completion_tokens, generation.cached_tokens)


def _decoder(generation):
    tokenizer = generation.state.tokenizer
    return lambda token_id: tokenizer.decode([token_id])


def _logprobs(generation, entries, offset: int = 0) -> dict | None:
    """A choice's ``logprobs`` for ``entries`` in the job's protocol (None when it asked for none)."""
    if entries is None:
        return None
    if generation.job.protocol == "chat":
        return R.chat_logprobs(entries, _decoder(generation))
    return R.completion_logprobs(entries, _decoder(generation), offset)


def body(generation) -> dict:
    """The JSON body of a finished chat completion or completion."""
    job, created = generation.job, R.now()
    if job.protocol == "chat":
        choices = [R.chat_choice(i, c.message(), c.finish, _logprobs(generation, c.logprobs))
                   for i, c in enumerate(generation.choices)]
        return R.chat_completion(generation.request_id, created, job.model, choices, _usage(generation))
    choices = [R.text_choice(i, c.content, c.finish, _logprobs(generation, c.logprobs))
               for i, c in enumerate(generation.choices)]
    return R.completion(generation.request_id, created, job.model, choices, _usage(generation))


async def chunks(generation):
    """The SSE text of a streamed chat completion or completion (see the module docstring)."""
    job, created, rid = generation.job, R.now(), generation.request_id
    chat = job.protocol == "chat"

    def chunk(choices, usage_=None):
        if chat:
            return R.sse(R.chat_chunk(rid, created, job.model, choices, usage_, usage_null=job.include_usage))
        return R.sse(R.completion(rid, created, job.model, choices, usage_, usage_null=job.include_usage))

    try:
        if chat:
            yield chunk([R.delta_choice(i, {"role": "assistant", "content": ""}) for i in range(job.choices)])
        offsets = [0] * job.choices  # a completion's text_offset, per choice
        async for d in generation.deltas():
            last = d.finish_reason is not None and generation.finished
            usage_ = _usage(generation) if last and not job.include_usage else None
            logprobs = _logprobs(generation, d.logprobs, offsets[d.index])
            if chat:
                delta = {"content": d.content} if d.content else {}
                if d.tool_calls:
                    delta["tool_calls"] = R.tool_call_deltas(d.tool_calls)
                yield chunk([R.delta_choice(d.index, delta, d.finish_reason, logprobs)], usage_)
            else:
                if logprobs is not None:
                    offsets[d.index] += sum(len(t) for t in logprobs["tokens"])
                yield chunk([R.text_choice(d.index, d.content, d.finish_reason, logprobs)], usage_)
        if job.include_usage:
            yield (R.sse(R.chat_chunk(rid, created, job.model, [], _usage(generation))) if chat
                   else R.sse(R.completion(rid, created, job.model, [], _usage(generation))))
        yield R.SSE_DONE
    except APIError as exc:
        generation.state.metrics.observe_rejected(exc.status)
        yield R.sse(exc.body())
        yield R.SSE_DONE
