"""One ``Job`` through the ``EngineClient``: the one place engine events become a protocol's output.

``Generation(state, job, slot)`` submits the job's engine ``Request`` in ``start()`` (so refusals
become HTTP errors before any response starts), then ``deltas()`` turns the engine's ``Event``s into
per-choice ``Delta``s, which every protocol adapter formats its own way (a JSON body, an SSE
stream): text through ``TextAssembler`` (stop strings end a sample: the server aborts just that
sample), tool calls through ``ToolCallStream`` when the job parses them, and one greedy engine
sample copied into every choice when the job fans out. Along the way it records TTFT and
inter-token latency and the admission's cached tokens, and, once the first delta has gone out,
whether the hit stopped short of the previous turn's history form (bookkeeping never delays a token). ``close()`` ends the request (aborting it in the engine if it is not
finished: the client went away) and gives the admission slot back.

After the last delta has gone out, a chat's reply gets its history form: ``history/work.py`` renders
it in the background (behind every prompt waiting for the render thread) and submits its uncached
blocks as a prefill-only request, so neither the final chunk nor the next prompt waits for it.
"""

from __future__ import annotations

import logging
import time
from typing import NamedTuple

from radixcache.integrations.serve.requests.detokenize import TextAssembler
from radixcache.integrations.serve.engine.client import EngineOverloaded
from radixcache.integrations.serve.errors import bad_request, internal, unavailable
from radixcache.integrations.serve.history.forms import classify_hit
from radixcache.integrations.serve.history.work import continues, precompute_history
from radixcache.integrations.serve.requests.job import Job, assistant_message
from radixcache.integrations.serve.requests.tool_calls import ToolCallStream, tool_call_objects

logger = logging.getLogger("radixcache.serve")


class Delta(NamedTuple):
    """New output of one choice: content text, whole tool calls at the end, the finish reason, and
    (when the job asked for logprobs) the ``(token id, TokenLogprobs)`` of every token generated
    since the choice's previous delta, so a choice's deltas carry one entry per completion token."""

    index: int
    content: str
    tool_calls: list | None
    finish_reason: str | None
    logprobs: list | None = None


class Sample:
    """One engine sample's output so far: its tokens, text, tool calls and finish reason."""

    def __init__(self, state, job: Job):
        self.text = TextAssembler(state.tokenizer, job.stop_strings, job.request.params.stop_token_ids)
        tools = job.conversation.tools if job.conversation is not None else None
        forced = job.constraint is not None and job.constraint.kind == "tool_calls"
        if forced and not tools:
            tools = list(job.constraint.tools)
        self.tools = (ToolCallStream([t["function"]["name"] for t in tools or []], complete_only=forced)
                      if job.parse_tools else None)
        self.single_tool_call = job.single_tool_call
        self.tokens: list[int] = []
        self.logprobs: list | None = [] if job.request.params.logprobs is not None else None
        self.logprobs_sent = 0
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
                calls = parsed.tool_calls[:1] if self.single_tool_call else parsed.tool_calls
                self.tool_calls = tool_call_objects(calls)
                reason = "tool_calls"
        self.finish = reason
        return out, self.tool_calls, reason

    def unsent_logprobs(self) -> list | None:
        """The logprob entries not yet handed out in a delta (None when the job asked for none)."""
        if self.logprobs is None:
            return None
        out, self.logprobs_sent = self.logprobs[self.logprobs_sent:], len(self.logprobs)
        return out

    def message(self) -> dict:
        """The reply as an assistant message (content None when it is only tool calls)."""
        return assistant_message(self.content if self.content or not self.tool_calls else None, self.tool_calls)


class Generation:
    """See the module docstring. One instance per HTTP request; not reusable.

    ``choices[i]`` is the ``Sample`` behind choice ``i`` (the same one for every choice when the
    job fans out)."""

    def __init__(self, state, job: Job, slot):
        self.state = state
        self.job = job
        self.slot = slot
        self.request_id = job.request_id
        self.samples = [Sample(state, job) for _ in range(job.request.num_samples)]
        self.choices = self.samples * job.choices if job.fanout else self.samples
        self.cached_tokens = 0
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.ended_early: str | None = None  # why the request ended before every choice finished
        self.notes: list = []  # what the engine said about a finish (a "length" cut by the pool)
        self._stream = None

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.tokens) for c in self.choices)

    def start(self) -> None:
        """Submit to the engine; raises ``APIError`` (400 / 503) when the engine refuses."""
        try:
            self._stream = self.state.engine.submit(self.job.request)
        except EngineOverloaded as exc:
            raise unavailable(f"the engine is overloaded: {exc}") from None
        except ValueError as exc:  # the engine's validation (InvalidRequest names the field)
            raise bad_request(str(exc), param=getattr(exc, "field", None)) from None

    async def deltas(self):
        """Async iterator of ``Delta``; raises ``APIError`` on an engine error or an engine abort
        (503; when the server is shutting down its message says so)."""
        admitted = False
        async for event in self._stream:
            first = not admitted
            if first:  # the usage needs it now; the hit's metrics wait until the first delta went out
                admitted = True
                self.cached_tokens = event.cached_tokens
            try:
                sample = self.samples[event.sample]
                if sample.finish is not None:
                    continue
                text = ""
                if event.token is not None:
                    self._timed(sample)
                    sample.tokens.append(event.token)
                    if sample.logprobs is not None and event.logprobs is not None:
                        sample.logprobs.append((event.token, event.logprobs))
                    text = sample.feed(sample.text.push(event.token))
                reason = event.finish_reason
                if sample.text.stopped:  # a stop string: this sample is done, whatever the engine says
                    if reason is None:
                        self.state.engine.abort(self.request_id, event.sample)
                    reason = "stop"
                if reason == "error":
                    self.ended_early = f"error: {event.error or 'engine error'}"
                    raise internal(f"generation failed: {event.error or 'engine error'}")
                if reason == "abort":
                    self.ended_early = "shutting down" if self.state.stopping else "aborted by the engine"
                    raise self._aborted()
                if event.error is not None and reason is not None:
                    self.notes.append(event.error)
                indices = range(self.job.choices) if self.job.fanout else (event.sample,)
                if reason is None:
                    if text:
                        entries = sample.unsent_logprobs()
                        for i in indices:
                            yield Delta(i, text, None, None, entries)
                    continue
                more, calls, reason = sample.end(reason)
                entries = sample.unsent_logprobs()
                for i in indices:
                    yield Delta(i, text + more, calls, reason, entries)
                if self.finished:  # after the last delta went out: the next turn's work, in the background
                    self._finished()
            finally:
                if first:
                    self._admitted(event.cached_tokens)
        if not self.finished:
            raise internal("the engine ended the stream before every choice finished")

    @property
    def finished(self) -> bool:
        """Every choice has its finish reason."""
        return all(s.finish is not None for s in self.samples)

    def close(self) -> None:
        """End the request: abort it in the engine unless every choice finished (the client went
        away, or an error), and give the admission slot back; the request's log line (info) goes
        out once. Idempotent."""
        if self._stream is not None and not self.finished:
            self.state.engine.abort(self.request_id)
            self.ended_early = self.ended_early or "the client went away"
        if not self.slot.released:
            self._log_tokens()
            self._log_request()
        self.slot.release()

    def _log_request(self) -> None:
        """One line per request: protocol and id, prompt / cached / new tokens, TTFT, decode rate,
        finish reasons, and why it ended early or was cut."""
        if self._stream is None:
            return
        job, tokens = self.job, self.completion_tokens
        parts = [f"{job.protocol} {self.request_id}: prompt {len(job.prompt_ids)} ({self.cached_tokens} cached), "
                 f"{tokens} new"]
        if self.first_token_at is not None:
            parts.append(f"TTFT {(self.first_token_at - job.arrival) * 1e3:.0f} ms")
            span = (self.last_token_at or self.first_token_at) - self.first_token_at
            if tokens > 1 and span > 0:
                parts.append(f"{(tokens - 1) / span:.1f} tok/s")
        finishes = sorted({s.finish for s in self.samples if s.finish is not None})
        if finishes:
            parts.append("finish " + "/".join(finishes))
        if self.ended_early:
            parts.append(f"ended early: {self.ended_early}")
        parts.extend(dict.fromkeys(self.notes))
        logger.info("%s", ", ".join(parts))

    # ------------------------------------------------------------------ bookkeeping
    def _log_tokens(self) -> None:
        log, job = self.state.token_log, self.job
        if log is None or self._stream is None:
            return
        log.write(request_id=self.request_id, protocol=job.protocol, model=job.model, prompt_ids=job.prompt_ids,
                  cached_tokens=self.cached_tokens, output_ids=[s.tokens for s in self.samples],
                  finish_reasons=[s.finish for s in self.samples])

    def _aborted(self):
        done = self.completion_tokens
        if self.state.stopping:
            return unavailable(f"the server is shutting down: this request was aborted after {done} "
                               "generated tokens", code="server_shutting_down")
        return unavailable("the request was aborted by the engine")

    def _timed(self, sample: Sample) -> None:
        t = time.perf_counter()
        self.last_token_at = t
        if self.first_token_at is None:
            self.first_token_at = t
            self.state.metrics.observe_first_token(t - self.job.arrival)
        if sample.last_token_at is not None:
            self.state.metrics.observe_inter_token(t - sample.last_token_at)
        sample.last_token_at = t

    def _admitted(self, cached_tokens: int) -> None:
        """Whether the admission's hit stopped short of the previous turn's history form (looked up
        now, off the first token's way out; the hit itself is in the cache manager's ledger)."""
        job = self.job
        if not job.conversation or not job.history_form:
            return
        previous = self.state.histories.previous(job.prompt_ids, job.salt)
        if previous is None:
            return
        earlier = self.state.histories.source(previous, job.salt)
        if earlier is not None and not continues(job.conversation, earlier):
            return  # another conversation that only shares a preamble: nothing to expect of it
        computed = self.state.histories.computed(previous, job.salt)
        short = classify_hit(previous, job.prompt_ids, cached_tokens, self.state.limits.block_size, computed)
        if short is not None:
            self.state.metrics.observe_short_hit(short.reason, short.expected_tokens - short.cached_tokens)
            self.notes.append(f"the hit stopped short of the previous turn's {short.expected_tokens} tokens "
                              f"({short.reason})")

    def _finished(self) -> None:
        job, first = self.job, self.samples[0]
        self.state.metrics.observe_finished(first.finish, self.completion_tokens,
                                            time.perf_counter() - job.arrival)
        if job.conversation is None or job.choices != 1 or not job.history_form:
            return  # with n > 1 the client echoes one of several replies: nothing to precompute
        reply = first.message() if job.reply_form is None else job.reply_form(first.message())
        task = self.state.spawn(precompute_history(self.state, job, first.tokens, reply))
        self.state.pending_histories.add(task, job.conversation, job.salt)
