"""The server's one thread for chat templates and tokenizing, prompts first.

Rendering and tokenizing are CPU work the event loop must not do; one thread does all of it (a
tokenizer is not shared between threads). Two queues feed it: ``run`` is for work a client waits on
(an incoming prompt), ``run_later`` for work nobody waits on yet (a reply's history form). The
thread always takes the oldest ``run`` job first, so history work delays a prompt by at most the
one job already running. A ``run_later`` job belongs to the task that queued it: once a client
waits on that task, ``promote(task)`` moves it ahead of every queued job, and a job of a promoted key queued
later goes there too, so the client waits for at most the one job already running, never for
other clients' prompts. ``close()`` cancels what is queued and lets the thread end.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections import deque
from concurrent.futures import Future


class RenderThread:
    """See the module docstring."""

    def __init__(self, name: str = "radixcache-render"):
        self._urgent: deque = deque()  # (future, fn, args, key)
        self._later: deque = deque()
        self._promoted = weakref.WeakSet()  # keys a client waits on
        self._wake = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    async def run(self, fn, *args):
        """``fn(*args)`` on the thread, ahead of every ``run_later`` job; its result or exception."""
        return await self._submit(fn, args, None, urgent=True)

    async def run_later(self, fn, *args):
        """``fn(*args)`` on the thread once no ``run`` job waits, unless the calling task is promoted
        (``promote``): then ahead of every queued job. Its result or exception."""
        return await self._submit(fn, args, asyncio.current_task(), urgent=False)

    def promote(self, key) -> None:
        """A client waits on the work of ``key`` (an asyncio task): its queued ``run_later`` jobs,
        and those it queues from now on, go ahead of every other queued job."""
        with self._wake:
            self._promoted.add(key)
            mine = [job for job in self._later if job[3] is key]
            for job in mine:
                self._later.remove(job)
            self._urgent.extendleft(reversed(mine))

    @property
    def queued(self) -> tuple[int, int]:
        """Jobs waiting: ``(run, run_later)``."""
        with self._wake:
            return len(self._urgent), len(self._later)

    def close(self) -> None:
        """Cancel every queued job; the thread ends after the one it runs (if any)."""
        with self._wake:
            self._closed = True
            pending = list(self._urgent) + list(self._later)
            self._urgent.clear()
            self._later.clear()
            self._wake.notify()
        for future, _, _, _ in pending:
            future.cancel()

    async def _submit(self, fn, args, key, urgent: bool):
        future: Future = Future()
        job = (future, fn, args, key)
        with self._wake:
            if self._closed:
                raise RuntimeError("the render thread is closed")
            if urgent:
                self._urgent.append(job)
            elif key is not None and key in self._promoted:
                self._urgent.appendleft(job)
            else:
                self._later.append(job)
            self._wake.notify()
        return await asyncio.wrap_future(future)

    def _work(self) -> None:
        while True:
            with self._wake:
                while not (self._urgent or self._later or self._closed):
                    self._wake.wait()
                if self._closed:
                    return
                future, fn, args, _ = (self._urgent or self._later).popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
                future.set_exception(exc)
