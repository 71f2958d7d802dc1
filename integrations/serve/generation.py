"""One generation request through the ``EngineClient``: text, tool calls, usage, metrics, history.

``Generation(state, job)`` submits ``job`` (a validated, rendered request) to the engine in
``start()`` (so refusals become HTTP errors before any response starts), then ``deltas()`` turns
the engine's token events into per-choice ``Delta``s: text through ``TextAssembler`` (stop strings
end a sample: the server aborts just that sample), tool calls through ``ToolCallStream`` when the
request parses them. Along the way it records TTFT and inter-token latency, the admission's cached
tokens (and whether the hit stopped short of the previous turn's history form), and, once every
choice is done and before the last delta goes out, the history form of a chat reply, whose
uncached blocks it submits as a LOW-priority prefill-only request. ``close()`` ends the request
(aborting it in the engine if it is not finished: the client went away) and gives the admission
slot back. ``app.py`` turns the deltas
into a JSON body or an SSE stream.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import NamedTuple

from radixcache.integrations.serve.detokenize import TextAssembler
from radixcache.integrations.serve.engine_client import EngineOverloaded, EngineRequest, SamplingParams
from radixcache.integrations.serve.errors import bad_request, internal, unavailable
from radixcache.integrations.serve.history import classify_hit, history_after_reply
from radixcache.integrations.serve.responses import assistant_message, new_id, tool_call_objects
from radixcache.integrations.serve.tool_calls import ToolCallStream

logger = logging.getLogger("radixcache.serve")


@dataclass
class Job:
    """A validated request, ready for the engine (built by ``app.py``)."""

    kind: str  # "chat" or "completion"
    model: str
    prompt_ids: tuple
    params: SamplingParams
    stop_strings: list
    stream: bool
    include_usage: bool
    salt: str | None
    messages: list | None = None  # chat: the request's messages as OpenAI dicts
    tools: list | None = None  # chat: the request's tools as OpenAI dicts
    parse_tools: bool = False
    retain_s: float | None = None  # prompt_cache_key / prompt_cache_retention as seconds
    arrival: float = field(default_factory=time.perf_counter)


class Delta(NamedTuple):
    """New output of one choice: content text, whole tool calls at the end, the finish reason."""

    index: int
    content: str
    tool_calls: list | None
    finish_reason: str | None


class _Choice:
    def __init__(self, state, job: Job):
        self.text = TextAssembler(state.tokenizer, job.stop_strings, job.params.stop_token_ids)
        names = [t["function"]["name"] for t in job.tools or []]
        self.tools = ToolCallStream(names) if job.parse_tools else None
        self.tokens: list[int] = []
        self.content = ""
        self.tool_calls: list | None = None
        self.finish: str | None = None
        self.last_token_at: float | None = None

    def feed(self, text: str) -> str:
        out = self.tools.push(text) if self.tools is not None else text
        self.content += out
        return out

    def end(self, reason: str) -> tuple[str, list | None, str]:
        out = self.feed(self.text.finish())
        if self.tools is not None:
            parsed = self.tools.finish()
            out += parsed.content or ""
            self.content += parsed.content or ""
            if parsed.tool_calls:
                self.tool_calls = tool_call_objects(parsed.tool_calls)
                reason = "tool_calls"
        self.finish = reason
        return out, self.tool_calls, reason


class Generation:
    """See the module docstring. One instance per HTTP request; not reusable."""

    def __init__(self, state, job: Job, slot):
        self.state = state
        self.job = job
        self.slot = slot
        self.request_id = new_id("chatcmpl" if job.kind == "chat" else "cmpl")
        self.choices = [_Choice(state, job) for _ in range(job.params.n)]
        self.cached_tokens = 0
        self.first_token_at: float | None = None
        self.previous = state.histories.previous(job.prompt_ids, job.salt) if job.kind == "chat" else None
        self._stream = None

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.tokens) for c in self.choices)

    def start(self) -> None:
        """Submit to the engine; raises ``APIError`` (400 / 503) when the engine refuses."""
        job = self.job
        request = EngineRequest(self.request_id, job.prompt_ids, job.params, job.salt, retain_s=job.retain_s)
        try:
            self._stream = self.state.engine.submit(request)
        except EngineOverloaded as exc:
            raise unavailable(f"the engine is overloaded: {exc}") from None
        except ValueError as exc:
            raise bad_request(str(exc)) from None

    async def deltas(self):
        """Async iterator of ``Delta``; raises ``APIError`` on an engine error or an engine abort."""
        admitted = False
        async for event in self._stream:
            if not admitted:
                admitted = True
                self._admitted(event.cached_tokens)
            choice = self.choices[event.index]
            if choice.finish is not None:
                continue
            text = ""
            if event.token_id is not None:
                self._timed(choice)
                choice.tokens.append(event.token_id)
                text = choice.feed(choice.text.push(event.token_id))
            reason = event.finish_reason
            if choice.text.stopped:  # a stop string: this sample is done, whatever the engine says
                if reason is None:
                    self.state.engine.abort(self.request_id, event.index)
                reason = "stop"
            if reason == "error":
                raise internal(f"generation failed: {event.error or 'engine error'}")
            if reason == "abort":
                raise unavailable("the request was aborted by the engine (the server may be stopping)")
            if reason is None:
                if text:
                    yield Delta(event.index, text, None, None)
                continue
            more, calls, reason = choice.end(reason)
            if self.finished:
                await self._finished()
            yield Delta(event.index, text + more, calls, reason)
        if not self.finished:
            raise internal("the engine ended the stream before every choice finished")

    @property
    def finished(self) -> bool:
        """Every choice has its finish reason."""
        return all(c.finish is not None for c in self.choices)

    def close(self) -> None:
        """End the request: abort it in the engine unless every choice finished (the client went
        away, or an error), and give the admission slot back. Idempotent."""
        if self._stream is not None and not self.finished:
            self.state.engine.abort(self.request_id)
        self.slot.release()

    # ------------------------------------------------------------------ bookkeeping
    def _timed(self, choice: _Choice) -> None:
        t = time.perf_counter()
        if self.first_token_at is None:
            self.first_token_at = t
            self.state.metrics.observe_first_token(t - self.job.arrival)
        if choice.last_token_at is not None:
            self.state.metrics.observe_inter_token(t - choice.last_token_at)
        choice.last_token_at = t

    def _admitted(self, cached_tokens: int) -> None:
        self.cached_tokens = cached_tokens
        self.state.metrics.observe_admitted(len(self.job.prompt_ids), cached_tokens)
        if self.previous is None:
            return
        computed = self.state.histories.computed(self.previous, self.job.salt)
        short = classify_hit(self.previous, self.job.prompt_ids, cached_tokens, self.state.limits.block_size,
                             computed)
        if short is not None:
            self.state.metrics.observe_short_hit(short.reason, short.expected_tokens - short.cached_tokens)
            logger.info("request %s: cache hit of %d tokens stopped short of the previous turn's %d (%s)",
                        self.request_id, short.cached_tokens, short.expected_tokens, short.reason)

    async def _finished(self) -> None:
        job, first = self.job, self.choices[0]
        self.state.metrics.observe_finished(first.finish, self.completion_tokens,
                                            time.perf_counter() - job.arrival)
        if job.kind != "chat" or job.params.n != 1:
            return  # with n > 1 the client echoes one of several replies: nothing to precompute
        reply = assistant_message(first.content if first.content or not first.tool_calls else None,
                                  first.tool_calls)
        try:
            history = await self.state.run_cpu(history_after_reply, self.state.renderer, job.messages,
                                               job.tools, job.prompt_ids, first.tokens, reply)
        except ValueError as exc:  # the template cannot render its own reply: nothing to precompute
            logger.warning("request %s: no history form (%s)", self.request_id, exc)
            return
        if history.divergence is not None:
            self.state.metrics.observe_divergence(history.divergence.reason)
            logger.info("request %s: history form departs from the computed tokens at token %d (%s): %s",
                        self.request_id, history.divergence.token_index, history.divergence.reason,
                        history.divergence.detail)
        precomputed = history.blocks_to_compute(self.state.limits.block_size) == 0 or \
            self.state.precompute(history.token_ids, job.salt, job.retain_s)
        self.state.histories.remember(history.token_ids, job.salt, None if precomputed else history.computed)
