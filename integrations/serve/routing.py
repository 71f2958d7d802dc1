"""How a server request becomes an engine request, and how its events find their way back.

Request mapping: temperature 0 is greedy, anything else samples (OpenAI's default 1 samples); ``n``
greedy samples are identical, so the engine computes one and its events are fanned out to every
index; ``seed`` (any int) is reduced to the engine's non-negative range; the stop ids, the tenant
salt, the priority and the retention hint pass through; a LOW ``prefill_only`` request is the
engine's prefill-only request (behind every normal one unless a normal one waits on its blocks).

``Route`` is one request's way back to its reader (see ``LocalEngine``): the reader's loop and
``asyncio.Queue``, which indices are still open, and the translation of engine ``Event``s into the
server's ``TokenEvent``s (one engine sample fanned out to every index of a greedy ``n``).
"""

from __future__ import annotations

import asyncio

from radixcache.engine import Request
from radixcache.engine import SamplingParams as EngineSampling
from radixcache.integrations.serve.engine_client import EngineRequest, TokenEvent

SEED_RANGE = 2**63


def engine_request(request: EngineRequest) -> Request:
    """The ``radixcache.engine.Request`` for a server request (see the module docstring)."""
    p = request.params
    greedy = p.temperature == 0
    params = EngineSampling(max_new_tokens=p.max_new_tokens, do_sample=not greedy,
                            temperature=1.0 if greedy else p.temperature,
                            top_p=1.0 if greedy else p.top_p, n=1 if greedy else p.n,
                            seed=None if p.seed is None else p.seed % SEED_RANGE,
                            stop_token_ids=p.stop_token_ids)
    return Request(request.request_id, tuple(request.prompt), params, cache_salt=request.cache_salt,
                   priority=int(request.priority), prefill_only=request.prefill_only,
                   retain_s=request.retain_s)


class Route:
    """One request's way back to its reader: its loop and queue, and which indices are still open.

    ``fanout``: the engine computes one greedy sample that stands for every index."""

    def __init__(self, request: EngineRequest, loop, fanout: bool):
        self.request = request
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.fanout = fanout
        n = 1 if request.prefill_only else request.params.n
        self.indices = frozenset(range(n))  # every index the reader gets a final event for
        self.open = set(self.indices)  # indices without a final event yet (written by whoever routes)
        self.added = False  # handed to the engine (after a prefetch, if any)
        self.aborted = False
        self.cached_tokens = 0

    def translate(self, event) -> list[TokenEvent]:
        """The reader's events for one engine event (several when fanned out); closes indices."""
        self.cached_tokens = event.cached_tokens
        indices = sorted(self.open) if self.fanout else [event.sample]
        out = []
        for i in indices:
            if i not in self.open:
                continue
            out.append(TokenEvent(i, event.token, event.finish_reason, event.cached_tokens, event.error))
            if event.finished:
                self.open.discard(i)
        return out

    def closing(self, indices, reason: str, error: str | None = None) -> list[TokenEvent]:
        """Final events for ``indices`` that are still open (an abort or failure decided here)."""
        out = [TokenEvent(i, None, reason, self.cached_tokens, error) for i in sorted(indices)
               if i in self.open]
        self.open.difference_update(indices)
        return out

    def push(self, events: list[TokenEvent]) -> None:
        """Hand ``events`` to the reader's loop (from any thread); dropped once the loop is gone."""
        if not events:
            return
        try:
            self.loop.call_soon_threadsafe(put_all, self.queue, events)
        except RuntimeError:  # the loop is closed: nobody reads any more
            pass


def put_all(queue: asyncio.Queue, events) -> None:
    """Put ``events`` into ``queue`` (on the queue's loop)."""
    for event in events:
        queue.put_nowait(event)
