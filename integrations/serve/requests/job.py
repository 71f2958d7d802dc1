"""The one place where a protocol's request becomes the engine's ``Request``, and the ``Job`` around it.

Every protocol adapter (chat completions and completions in ``protocols/openai/completions.py``; more
protocols the same way) turns its request schema into the same three things and hands them to
``new_job``:

- the prompt's token ids: for a chat, ``render_conversation`` makes them from the one internal
  ``Conversation`` (OpenAI-shaped message and tool dicts) through the chat template, on the render
  thread;
- the sampling settings, in OpenAI's meaning: ``temperature`` 0 is greedy (``top_p`` / ``top_k``
  then do nothing), ``max_tokens`` None means up to the context, ``seed`` any int, ``n`` choices
  (greedy choices are all the same, so the engine computes one sample and the ``Job`` copies it:
  ``fanout``), ``stop`` strings (the server cuts the text; the engine knows only stop ids);
- who asks: the ``Caller`` (its tenant, one per API key unless ``--share-cache-across-keys``, and
  its cache salt, the tenant's narrowed by the request's own ``cache_salt`` field), and the
  retention hint in seconds (``prompt_cache_key`` / ``prompt_cache_retention`` in chat).

``new_job`` checks what no field check can (the prompt and ``max_tokens`` against the context and
the KV pool: 400s that name the problem; the engine's ``validate``, when the job is submitted, is
the one check of the prompt's ids against the vocabulary) and builds the engine's ``radixcache.engine.Request``, the
one request type from here to the scheduler; ``SamplingParams`` and ``Request`` check themselves.
``history_request`` builds the only other request the server sends: a history form's prefill.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

from radixcache.engine import Request, SamplingParams
from radixcache.integrations.serve.requests.chat_template import RenderedPrompt, RenderError
from radixcache.integrations.serve.requests.structured import OutputConstraint, ConstraintError
from radixcache.integrations.serve.errors import bad_request
from radixcache.integrations.serve.admission import max_new_tokens
from radixcache.integrations.serve.access import Caller

SEED_RANGE = 2**63  # a request's seed (any int) is reduced to the engine's non-negative range


def new_id(prefix: str) -> str:
    """A fresh id such as ``chatcmpl-3f2a...``."""
    return f"{prefix}-{uuid.uuid4().hex}"


def assistant_message(content: str | None, tool_calls: list[dict] | None) -> dict:
    """The reply message as a response returns it (and the client echoes it next turn)."""
    message = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return message


class Conversation(NamedTuple):
    """A chat in the one internal form every protocol renders: OpenAI-shaped message dicts (roles
    system, user, assistant with ``tool_calls``, tool), OpenAI tool dicts (or None), and extra
    template variables as sorted pairs (e.g. ``(("enable_thinking", False),)``; the prompt and the
    reply's history form are rendered with them)."""

    messages: list
    tools: list | None = None
    template_args: tuple = ()


@dataclass
class Job:
    """A validated request, ready for the engine: its ``Request`` and what the server does around it.

    ``protocol`` names the adapter ("chat", "completion", ...); ``choices`` how many choices the
    answer has (``fanout``: one greedy engine sample stands for all of them); ``conversation`` is
    set for a chat (its reply's history form is precomputed); ``parse_tools``: tool calls are
    parsed out of the reply. ``reply_form`` maps the reply (the OpenAI assistant message) to the
    message the protocol's client sends back next turn, in the same internal form (None: the
    reply as it is), so that the history form is what the next request renders; ``history_form``:
    the reply's history form is precomputed and the next turn's hit checked against it (False when
    the next turn continues the job's own tokens, as a stored Responses turn does). ``arrival``
    starts the TTFT clock. ``constraint``: what the output must satisfy (compiled into the
    request's grammar by ``constrain`` before it is submitted). ``single_tool_call``: the client
    asked for one call at most (``parallel_tool_calls: false``, ``disable_parallel_tool_use``):
    a reply's first call is kept, any after it dropped (a grammar also stops them when the call
    is forced). ``tenant``: who owns what the job stores (``Caller.tenant``); the request's cache
    salt is ``salt``.
    """

    protocol: str
    model: str
    request: Request
    choices: int = 1
    stop_strings: tuple = ()
    stream: bool = False
    include_usage: bool = False
    conversation: Conversation | None = None
    parse_tools: bool = False
    reply_form: Callable[[dict], dict] | None = None
    history_form: bool = True
    constraint: OutputConstraint | None = None
    single_tool_call: bool = False
    tenant: str | None = None
    arrival: float = field(default_factory=time.perf_counter)

    @property
    def request_id(self) -> str:
        """The engine request's id, which is also the response's id."""
        return self.request.request_id

    @property
    def prompt_ids(self) -> tuple:
        return self.request.prompt

    @property
    def salt(self) -> str | None:
        return self.request.cache_salt

    @property
    def fanout(self) -> bool:
        """One engine sample is copied into every choice (greedy ``n`` > 1)."""
        return self.choices > self.request.num_samples


async def render_conversation(state, conversation: Conversation, caller: Caller = Caller()) -> RenderedPrompt:
    """The prompt the chat template makes of ``conversation`` (on the render thread, ahead of any
    history work; a template that refuses it is a 400 on ``messages``), once the history work of the
    conversation it continues (the client came back before it was done) is done."""
    try:
        renderer = state.renderer.with_args(conversation.template_args)
        prompt = await state.render(renderer.render, conversation.messages, conversation.tools)
    except RenderError as exc:
        raise bad_request(str(exc), param="messages") from None
    await state.pending_histories.wait_for(conversation, caller.salt)
    return prompt


def new_job(state, protocol: str, model: str, prompt_ids, *, id_prefix: str, caller: Caller = Caller(),
            max_tokens: int | None = None, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
            n: int = 1, seed: int | None = None, stop=(), stream: bool = False, include_usage: bool = False,
            keep_s: float | None = None, conversation: Conversation | None = None,
            parse_tools: bool = False, clamp_max_tokens: bool = False,
            constraint: OutputConstraint | None = None, logprobs: int | None = None,
            reply_form: Callable[[dict], dict] | None = None, single_tool_call: bool = False) -> Job:
    """The ``Job`` for a prompt and its settings (see the module docstring); raises ``APIError`` 400
    naming what cannot be served (the response id is ``id_prefix-<hex>``). ``max_tokens`` is capped
    by ``--max-output-tokens``; over what the context leaves it is a 400, or, with
    ``clamp_max_tokens`` (protocols whose cap is only a ceiling), lowered to it. ``constraint`` is
    what the output must satisfy (``structured.py``; ``respond`` compiles it before the engine
    sees the request); a "tool_calls" constraint parses tool calls. ``logprobs``: every token's
    logprob and that many alternatives (None: none); ``reply_form`` and ``single_tool_call`` see
    ``Job``."""
    limits = state.limits
    prompt_ids = tuple(prompt_ids)
    budget = max_new_tokens(len(prompt_ids), max_tokens, limits.max_context_tokens, limits.pool_tokens,
                            getattr(state.options, "max_output_tokens", None), clamp_max_tokens)
    greedy = temperature == 0
    try:
        params = SamplingParams(max_new_tokens=budget, do_sample=not greedy,
                                temperature=1.0 if greedy else temperature, top_p=1.0 if greedy else top_p,
                                top_k=0 if greedy else top_k, n=1 if greedy else n,
                                seed=None if seed is None else seed % SEED_RANGE,
                                stop_token_ids=state.info.stop_token_ids, logprobs=logprobs)
        request = Request(new_id(id_prefix), prompt_ids, params,
                          cache_salt=caller.salt, keep_s=keep_s)
    except (TypeError, ValueError) as exc:
        raise bad_request(str(exc)) from None
    parse_tools = parse_tools or (constraint is not None and constraint.kind == "tool_calls")
    return Job(protocol, model, request, n, tuple(stop), stream, include_usage, conversation, parse_tools,
               reply_form=reply_form, constraint=constraint, single_tool_call=single_tool_call,
               tenant=caller.tenant)


async def constrain(state, job: Job) -> Job:
    """``job`` with its constraint compiled into the engine request's grammar (on the grammar
    worker thread, cached); an invalid schema is a 400 naming it (``param``: the field it came
    from). A job without one is returned as it is."""
    if job.constraint is None:
        return job
    try:
        grammar = await state.grammars.compile(job.constraint)
    except ConstraintError as exc:
        raise bad_request(str(exc), param=job.constraint.param) from None
    return dataclasses.replace(job, request=dataclasses.replace(job.request, constraint=grammar))


def history_request(token_ids, salt: str | None, keep_s: float | None) -> Request:
    """The engine request that computes a history form's uncached blocks into the cache: prefill
    only (behind every normal request unless one waits on its blocks), the reply's tenant salt and
    retention hint."""
    return Request(new_id("history"), tuple(token_ids), SamplingParams(max_new_tokens=1), cache_salt=salt,
                   prefill_only=True, keep_s=keep_s)
