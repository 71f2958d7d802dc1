"""The engine's inbox: adds and aborts queued from any thread, and the request ids in use.

``Inbox`` is the thread-safe half of the engine's front door. ``put_add`` and ``put_abort`` may be
called from any thread; the stepping thread takes the queued items in order with ``take`` (under
its own manager lock) and calls ``release`` once a request has delivered its final events. One
lock guards both the queue and the set of ids in use, so an id is never queued twice.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Iterator


class Inbox:
    """Queued ``("add", live, tokens, fetched)`` and ``("abort", request_id, sample)`` items, in arrival
    order, and the ids of requests added and not yet released."""

    def __init__(self):
        self._queue: deque = deque()
        self._lock = threading.Lock()  # guards _queue and _in_use
        self._in_use: set = set()

    def __bool__(self) -> bool:
        """True while any request id is in use (added and not yet released)."""
        return bool(self._in_use)

    def in_use(self, request_id) -> bool:
        """True when ``request_id`` was added and not yet released."""
        return request_id in self._in_use

    def put_add(self, request_id, live, tokens, fetched=None) -> None:
        """Mark ``request_id`` in use and queue its add (with the store's blocks ``fetched`` for
        it, if any); ``ValueError`` (nothing queued) when it is already in use."""
        with self._lock:
            if request_id in self._in_use:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._in_use.add(request_id)
            self._queue.append(("add", live, tokens, fetched))

    def put_abort(self, request_id, sample) -> bool:
        """Queue an abort of ``request_id`` (``sample`` None for all its samples); False (nothing
        queued) when the id is not in use."""
        with self._lock:
            if request_id not in self._in_use:
                return False
            self._queue.append(("abort", request_id, sample))
        return True

    def take(self) -> Iterator[tuple]:
        """Yield the queued items one at a time, oldest first, until the queue is empty; items
        queued while the caller works on one are yielded too."""
        while True:
            with self._lock:
                if not self._queue:
                    return
                item = self._queue.popleft()
            yield item

    def release(self, request_id) -> None:
        """Forget ``request_id`` (a no-op when it is not in use): it may be added again."""
        with self._lock:
            self._in_use.discard(request_id)
