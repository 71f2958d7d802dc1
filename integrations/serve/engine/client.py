"""The one interface between the HTTP server and the always-on engine, in the engine's own types.

The server never touches the engine, the tree or the pool directly: it only calls an
``EngineClient``. Requests and events are the engine's: ``radixcache.engine.Request`` (prompt ids,
``SamplingParams``, cache salt, priority, ``prefill_only``, ``keep_s``) in, and
``radixcache.engine.Event`` (``request_id``, ``sample``, ``token``, ``finished``, ``finish_reason``,
``cached_tokens``, ``error``) out; ``requests/job.py`` is the one place the server builds a ``Request``.
Wiring the server to radixcache's engine is one module that implements this protocol
(``engine/local.py``; the server runs without one: generation endpoints then answer 503).

Threading: every method is called on the server's asyncio event loop and must return at once; the
engine runs its forwards on its own scheduler thread and hands events back to the loop (e.g. with
``loop.call_soon_threadsafe`` into an ``asyncio.Queue``). Nothing here may block on a forward, on
the cache's lock or on a store.

Contract of ``submit(request) -> AsyncIterator[Event]``:

- It validates and enqueues at once; it raises ``ValueError`` for a request the engine cannot serve
  (a token id outside the vocabulary, a prompt that can never fit the pool: the server answers 400)
  and ``EngineOverloaded`` when its own queue is full or it is shutting down (503). Nothing is held
  after a raise.
- The iterator yields, per sample in ``0..request.num_samples - 1``, one event per generated token
  in order, the last one ``finished`` with a ``finish_reason`` (see ``radixcache.engine.request``):
  "stop", "length", "abort" (``abort`` or ``close`` was called; no token) or "error" (``error``
  says what; the cache is left exact). It ends after every sample's final event. A
  ``prefill_only`` request yields exactly one event: sample 0, no token, "prefilled" (or "abort" /
  "error").
- ``cached_tokens`` is the same in every event of a request: its prompt tokens that it did not
  compute itself (matched in the tree at admission, including blocks a prefill-only request it
  waited for or joined computed). It is what ``usage.prompt_tokens_details.cached_tokens`` reports.
- A ``prefill_only`` request (the server's history precompute) runs only when no normal work
  waits; a normal request whose prompt needs blocks it is computing promotes that work (it waits
  for or joins it) instead of computing those blocks again, and counts them as cached.
- ``SamplingParams.seed``: each sample draws from its own generator, so the same seed gives the
  same samples wherever the request sits in the batch.

``abort(request_id, sample=None)`` ends one sample (the server's ``stop`` strings) or the whole
request (client disconnect): its blocks are released at once (whole computed blocks stay in the
tree), the stream yields the final "abort" events. It is idempotent and a no-op for unknown or
finished requests. It only enqueues: it returns at once, whatever the engine is doing. After
``abort`` the server may stop reading the stream (a client that went away): the engine must never
wait on a reader, and drops the events nobody reads. ``counts()`` is a snapshot for ``/metrics`` and
``/v1/loads`` that takes no lock of the engine's (it may be a step old); ``limits()`` is constant;
an engine may offer ``alive`` (False once it can serve nothing more: ``/health`` answers 503). ``close()`` aborts everything (every stream
gets its final "abort" events), stops the scheduler thread and flushes what the engine owns; it is
idempotent. An engine with a shared store may also offer ``store_stats() -> dict`` (its
``radixcache.store.STORE_COUNTERS``), exported in ``/metrics``, and one publishing KV events
``events_stats() -> dict`` (``KVEventPublisher.stats``' ``kv_events_*`` counters; empty when off).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, NamedTuple, Protocol, runtime_checkable

if TYPE_CHECKING:  # the engine's types; importing them at run time would load torch here
    from radixcache.engine import Event, Request


class EngineOverloaded(Exception):
    """The engine's own waiting queue is full (or it is shutting down); the server answers 503."""


class EngineCounts(NamedTuple):
    """A snapshot for metrics and ``/v1/loads``: requests running and waiting, pool blocks used of
    total, and the whole blocks the tree holds (``RadixCache.whole_blocks``; 0 when unknown)."""

    running: int
    waiting: int
    used_blocks: int
    total_blocks: int
    cached_blocks: int = 0


class EngineLimits(NamedTuple):
    """What a request must fit: the model's context length and the pool, in tokens; the block size."""

    max_context_tokens: int
    pool_tokens: int
    block_size: int


@runtime_checkable
class EngineClient(Protocol):
    """What the server needs from an engine (see the module docstring for the full contract)."""

    def limits(self) -> EngineLimits: ...

    def submit(self, request: "Request") -> AsyncIterator["Event"]: ...

    def abort(self, request_id, sample: int | None = None) -> None: ...

    def counts(self) -> EngineCounts: ...

    async def close(self) -> None: ...
