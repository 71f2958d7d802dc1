"""How one request's engine events find their way back to its reader.

``Route`` is one request's way back (see ``LocalEngine``): the reader's loop and ``asyncio.Queue``,
which samples are still open, and the final events decided outside the engine (an abort before the
engine got the request, a failed step). Events are the engine's own ``radixcache.engine.Event``s,
passed through unchanged.
"""

from __future__ import annotations

import asyncio

from radixcache.engine import Event, Request


class Route:
    """One request's way back to its reader: its loop and queue, and which samples are still open."""

    def __init__(self, request: Request, loop):
        self.request = request
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.samples = frozenset(range(request.num_samples))  # every sample the reader gets a final event for
        self.open = set(self.samples)  # samples without a final event yet (written by whoever routes)
        self.added = False  # handed to the engine (after a prefetch, if any)
        self.aborted = False
        self.cached_tokens = 0

    def passed(self, event: Event) -> bool:
        """Record an engine event; False when its sample was already closed here (drop it)."""
        if event.sample not in self.open:
            return False
        self.cached_tokens = event.cached_tokens
        if event.finished:
            self.open.discard(event.sample)
        return True

    def closing(self, samples, reason: str, error: str | None = None) -> list[Event]:
        """Final events for ``samples`` that are still open (an abort or failure decided here)."""
        out = [Event(self.request.request_id, s, None, True, reason, self.cached_tokens, error)
               for s in sorted(samples) if s in self.open]
        self.open.difference_update(samples)
        return out

    def push(self, events: list[Event]) -> None:
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
