"""The ``EngineClient`` over a ``CachedLM`` in this process: one scheduler thread steps its engine.

Threading model (the contract is ``engine/client.py``):

- ONE scheduler thread owns the engine and its ``CacheManager``: it is the only thread that changes
  them. It runs ``engine.step()`` while the engine has work and otherwise blocks on a condition
  (never spins); when waiting requests cannot run because blocks are held outside the engine, it
  waits on the same condition for a millisecond at a time.
- The asyncio loop only enqueues: ``engine.validate`` (the request's one validation pass, no lock
  of the engine's),
  ``engine.add`` and ``engine.abort`` (the inbox's lock, held for a queue append), then notifies the
  condition; it never takes the manager's lock and never waits on a step. The scheduler thread
  applies what was queued at its next step: an abort (a stop string, a disconnect) releases its
  blocks there. Requests added between steps join the running batch at the next one.
- ``counts()``, ``store_stats()``, ``events_stats()`` and ``alive`` (``/metrics``, ``/v1/loads``,
  ``/health``) read an ``EngineSnapshot`` the scheduler thread publishes after every step and
  every ``SNAPSHOT_IDLE_S`` while idle: no lock of the engine's or the manager's is taken to answer.
- Events go back by request id: per step, one ``loop.call_soon_threadsafe`` per request puts its
  engine ``Event``s into that request's ``asyncio.Queue`` (unbounded: the thread never waits on a
  reader, and the events of a reader that went away are dropped with its route).
- With a shared store, ``manager.fetch`` (network) runs on a small thread pool before the request
  is handed to the engine with what it read; the scheduler thread loads those blocks into the tree
  when it takes the request (``Engine.add(request, fetched)``), so it never waits on the store and
  the helper threads never change the tree.
- ``compute_threads``: the scheduler thread is the process's one thread with torch's parallel CPU
  kernels (``radixcache.compute_threads``); prefetch threads run theirs serially. The caller keeps
  its own thread serial (``serial_here``) before loading the model, as ``radixcache serve`` does;
  otherwise every kernel of the scheduler thread pays for waking its OpenMP workers.

Requests are the engine's own ``Request`` (built by ``requests/job.py``); ``Route`` is one request's
way back to its reader: the reader's loop and ``asyncio.Queue``, which samples are still open, and
the final events decided outside the engine (an abort before the engine got the request, a failed
step); events are the engine's own ``Event``s, passed through unchanged.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

from radixcache.compute_threads import parallel_here, serial_here
from radixcache.engine import Event, Request
from radixcache.engine.request import ValidRequest
from radixcache.errors import OutOfBlocks
from radixcache.integrations.serve.engine.client import EngineCounts, EngineLimits, EngineOverloaded
from radixcache.models import context_length
from radixcache.store import STORE_COUNTERS


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


logger = logging.getLogger("radixcache.serve")

STALL_WAIT_S = 0.001  # blocks held outside the engine: look again this soon (or when notified)
SNAPSHOT_IDLE_S = 0.25  # an idle scheduler republishes its snapshot this often (store counters move)
PREFETCH_THREADS = 4


LEDGER = ("requests", "queried_tokens", "hit_tokens", "computed_prompt_tokens", "generated_tokens",
          "preemptions")


class EngineSnapshot(NamedTuple):
    """What the scheduler thread last published: the engine's counts, the shared store's and the
    KV event publisher's counters (empty without them), the cache manager's ledger (``LEDGER``)
    and when (``time.monotonic``)."""

    counts: EngineCounts
    store: dict
    events: dict
    ledger: dict
    taken_at: float


class LocalEngine:
    """An ``EngineClient`` over ``lm`` (a ``CachedLM``) and ``engine`` (default: ``lm.engine``).

    ``max_requests`` bounds the requests it holds (normal and precompute alike); one more raises
    ``EngineOverloaded``. ``max_context_tokens`` defaults to the model config's. A model whose
    wrap-time self-tests ruled the engine out (``lm.engine_unsupported``) raises ``ValueError``.
    ``close_lm``: ``close()`` also closes ``lm`` (flushing its store). ``compute_threads`` (None:
    leave torch's choice): the scheduler thread runs torch's CPU kernels on that many threads. See
    the module docstring for the threads. ``prepare`` (None: nothing) runs on the scheduler thread,
    with its threads set, before its first step (``lm.compile_engine``: compiled graphs are guarded
    on the thread count they were traced with); the constructor returns after it and re-raises
    what it raised.
    """

    def __init__(self, lm, engine=None, *, max_requests: int = 1024, max_context_tokens: int | None = None,
                 close_lm: bool = False, compute_threads: int | None = None, prepare=None):
        if not isinstance(max_requests, int) or max_requests < 1:
            raise ValueError(f"max_requests must be an int >= 1, got {max_requests!r}")
        if lm.engine_unsupported:  # never serve tokens the engine cannot get right
            raise ValueError(f"this model cannot run on radixcache's engine: {lm.engine_unsupported}")
        self.lm = lm
        self.engine = engine if engine is not None else lm.engine
        self.manager = self.engine.manager
        self.max_requests = max_requests
        self._limits = EngineLimits(max_context_tokens or context_length(lm.model.config),
                                    self.manager.allocator.num_blocks * self.manager.block_size,
                                    self.manager.block_size)
        self._close_lm = close_lm
        self.compute_threads = compute_threads
        self._routes: dict = {}  # request_id -> Route
        self._lock = threading.Lock()  # guards _routes and every route's open/added/aborted
        self._wake = threading.Condition()
        self._closing = False
        self._close_task = None
        self._snapshot = self._take_snapshot()  # replaced whole by the scheduler thread
        self._prefetch = ThreadPoolExecutor(PREFETCH_THREADS, thread_name_prefix="radixcache-prefetch",
                                            initializer=serial_here)
        self._prepare, self._prepared, self._prepare_error = prepare, threading.Event(), None
        self._thread = threading.Thread(target=self._run, name="radixcache-scheduler", daemon=True)
        self._thread.start()
        self._prepared.wait()
        if self._prepare_error is not None:
            self._thread.join()
            self._prefetch.shutdown(wait=False)
            raise self._prepare_error

    # ------------------------------------------------------------------ EngineClient
    def limits(self) -> EngineLimits:
        """The model's context, the pool's size in tokens and the block size."""
        return self._limits

    def submit(self, request: Request):
        """Validate and enqueue ``request`` (an engine ``Request``) now; return its event stream
        (see ``engine.client``)."""
        if self._closing:
            raise EngineOverloaded("the engine is shutting down")
        try:
            valid = self.engine.validate(request)
        except OutOfBlocks as exc:
            raise ValueError(str(exc)) from None
        route = Route(request, asyncio.get_running_loop())
        with self._lock:
            if request.request_id in self._routes:
                raise ValueError(f"request id {request.request_id!r} is already in use")
            if len(self._routes) >= self.max_requests:
                raise EngineOverloaded(f"{len(self._routes)} requests are in the engine (its limit)")
            self._routes[request.request_id] = route
        if self.manager.store is not None:
            self._prefetch.submit(self._fetch_then_add, route, valid)
        else:
            self._add(route, valid)
        return self._stream(route)

    def abort(self, request_id, sample: int | None = None) -> None:
        """End ``sample`` (or the whole request): queued for the scheduler thread, which releases
        its blocks at its next step; returns at once. Idempotent, a no-op when unknown."""
        with self._lock:
            route = self._routes.get(request_id)
            if route is None:
                return
            if not route.added:  # decided here: the engine has not got it yet
                route.push(route.closing(set(route.open) if sample is None else {sample}, "abort"))
                if not route.open:
                    route.aborted = True
                    del self._routes[request_id]
                return
        self.engine.abort(request_id, sample)
        self._notify()

    @property
    def open_requests(self) -> int:
        """Requests submitted whose stream has not delivered every final event yet."""
        with self._lock:
            return len(self._routes)

    @property
    def alive(self) -> bool:
        """The scheduler thread runs (or ended because ``close`` asked it to)."""
        return self._thread.is_alive() or self._closing

    @property
    def snapshot(self) -> EngineSnapshot:
        """The scheduler thread's last published ``EngineSnapshot`` (no lock taken)."""
        return self._snapshot

    def counts(self) -> EngineCounts:
        """Sequences running and waiting (requests still fetching from the store count as waiting),
        pool blocks that cannot be had now (held by requests) of all, and the whole blocks the tree
        holds: the scheduler's last snapshot, plus the routes not handed to the engine yet."""
        with self._lock:
            fetching = sum(1 for r in self._routes.values() if not r.added)
        counts = self._snapshot.counts
        return counts._replace(waiting=counts.waiting + fetching) if fetching else counts

    def store_stats(self) -> dict:
        """The shared store's counters (``store_hit_tokens``, ``store_written_blocks``, ...; see
        ``radixcache.store.STORE_COUNTERS``) from the last snapshot; empty without a store."""
        return self._snapshot.store

    def ledger_stats(self) -> dict:
        """The cache manager's ledger (``requests``, ``queried_tokens``, ``hit_tokens``, ...) from the
        last snapshot: the prefix cache counters of ``/metrics`` and ``/v1/loads``."""
        return self._snapshot.ledger

    def events_stats(self) -> dict:
        """The KV event publisher's counters (``kv_events_batches``, ``kv_events_dropped``, ...; see
        ``KVEventPublisher.stats``) from the last snapshot; empty without a publisher."""
        return self._snapshot.events

    async def close(self) -> None:
        """Abort everything, stop the scheduler thread (and close ``lm`` when it was asked to, which
        flushes its store). Idempotent: a second call waits for the first."""
        if self._close_task is None:
            self._close_task = asyncio.get_running_loop().create_task(self._close())
        await asyncio.shield(self._close_task)

    async def _close(self) -> None:
        self._closing = True
        with self._lock:
            ids = list(self._routes)
        for request_id in ids:
            self.abort(request_id)
        self._notify()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._thread.join)
        # a prefetch still loading holds a lease until it returns: wait for it (bounded by the store)
        await loop.run_in_executor(None, lambda: self._prefetch.shutdown(wait=True, cancel_futures=True))
        if self._close_lm:
            final = await loop.run_in_executor(None, self.lm.close)
            if "store_written_blocks" in final:
                logger.info("store flushed: %d blocks written, %d dropped, %d errors",
                            final.get("store_written_blocks", 0), final.get("store_dropped_blocks", 0),
                            final.get("store_errors", 0))
            if "kv_events_batches" in final:
                logger.info("KV events closed: %d batches sent, %d records dropped",
                            final["kv_events_batches"], final.get("kv_events_dropped", 0))

    # ------------------------------------------------------------------ handing over
    def _fetch_then_add(self, route: Route, valid: ValidRequest) -> None:
        fetched, request = None, valid.request
        try:
            fetched = self.manager.fetch(request.prompt, self.engine.namespace(request.cache_salt))
        except Exception:  # noqa: BLE001 - a store problem is a miss, never a failed request
            logger.exception("request %s: fetching from the store failed", request.request_id)
        self._add(route, valid, fetched)

    def _add(self, route: Route, valid: ValidRequest, fetched=None) -> None:
        request = valid.request
        with self._lock:
            if route.aborted or self._routes.get(request.request_id) is not route:
                return  # aborted while it was fetching: its final events went out then
            if self._closing:
                del self._routes[request.request_id]
                route.push(route.closing(set(route.open), "abort"))
                return
            try:
                self.engine.add(valid, fetched)
            except ValueError as exc:  # its id taken meanwhile (validated once, in submit)
                del self._routes[request.request_id]
                route.push(route.closing(set(route.open), "error", str(exc)))
                return
            route.added = True
        self._notify()

    def _notify(self) -> None:
        with self._wake:
            self._wake.notify()

    async def _stream(self, route: Route):
        # from the samples, not route.open: the scheduler thread may have closed some already
        waiting = set(route.samples)
        try:
            while waiting:
                event = await route.queue.get()
                if event.finished:
                    waiting.discard(event.sample)
                yield event
        finally:
            if waiting:  # the reader stopped early (disconnect, cancelled): free the blocks now
                self.abort(route.request.request_id)

    # ------------------------------------------------------------------ the scheduler thread
    def _run(self) -> None:
        try:
            if self.compute_threads is not None:
                parallel_here(self.compute_threads)
            if self._prepare is not None:
                self._prepare()
        except BaseException as exc:  # noqa: BLE001 - handed to the constructor, which raises it
            self._prepare_error = exc
            return
        finally:
            self._prepared.set()
        engine = self.engine
        while True:
            if not engine.has_work:
                self._publish()  # outside the condition's lock: the loop's notify never waits on it
                if self._closing:
                    return
                with self._wake:
                    if not engine.has_work and not self._closing:
                        self._wake.wait(SNAPSHOT_IDLE_S)
                continue
            try:
                events = engine.step()
            except BaseException as exc:  # noqa: BLE001 - a KeyboardInterrupt-like: the step's requests ended
                logger.exception("engine step failed")
                self._fail_all(f"{type(exc).__name__}: {exc}")
                if not isinstance(exc, Exception):
                    self._publish()
                    return
                continue
            self._publish()  # before the events go out: a reader that sees its end sees this step
            self._route(events)
            if not events and engine.stalled:
                with self._wake:
                    self._wake.wait(STALL_WAIT_S)

    def _take_snapshot(self) -> EngineSnapshot:
        """The engine's counts and counters now (on the scheduler thread, or before it starts)."""
        manager, sched = self.manager, self.engine.scheduler
        total = manager.allocator.num_blocks
        with manager.mutex:
            stats = manager.stats()
            counts = EngineCounts(len(sched.running), len(sched.waiting), total - manager.freeable_blocks(),
                                  total, manager.tree.whole_blocks)
        return EngineSnapshot(counts, {k: v for k, v in stats.items() if k in STORE_COUNTERS},
                              {k: v for k, v in stats.items() if k.startswith("kv_events_")},
                              {k: stats[k] for k in LEDGER}, time.monotonic())

    def _publish(self) -> None:
        try:
            self._snapshot = self._take_snapshot()
        except Exception:  # noqa: BLE001 - the last snapshot stays; serving goes on
            logger.exception("taking the engine's snapshot failed")

    def _route(self, events) -> None:
        by_route: dict = {}
        with self._lock:
            for event in events:
                route = self._routes.get(event.request_id)
                if route is None:
                    continue
                if route.passed(event):
                    by_route.setdefault(id(route), (route, []))[1].append(event)
                if event.finished and not route.open:
                    self._routes.pop(event.request_id, None)
        for route, out in by_route.values():
            route.push(out)

    def _fail_all(self, why: str) -> None:
        with self._lock:
            routes = [r for r in self._routes.values() if r.added]
            for route in routes:
                del self._routes[route.request.request_id]
                route.push(route.closing(set(route.open), "error", why))
        for route in routes:
            self.engine.abort(route.request.request_id)
        self.engine.flush()  # on the scheduler thread, which owns the engine
