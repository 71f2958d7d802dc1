"""The one interface between the HTTP server and the always-on engine.

The server never touches the engine, the tree or the pool directly: it only calls an
``EngineClient``. Wiring the server to radixcache's engine is one module that implements this
protocol (and the server runs without one: generation endpoints then answer 503).

Threading: every method is called on the server's asyncio event loop and must return at once; the
engine runs its forwards on its own scheduler thread and hands events back to the loop (e.g. with
``loop.call_soon_threadsafe`` into an ``asyncio.Queue``). Nothing here may block on a forward.

Contract of ``submit(request) -> AsyncIterator[TokenEvent]``:

- It validates and enqueues at once; it raises ``ValueError`` for a request the engine cannot serve
  (a prompt that can never fit the pool: the server answers 400) and ``EngineOverloaded`` when its
  own queue is full (503). Nothing is held after a raise.
- The iterator yields, per sample ``index`` in ``0..n-1``, one event per generated token in order,
  the last one with a ``finish_reason``: "stop" (a token of ``stop_token_ids`` ended it; that token
  is the event's ``token_id``), "length" (``max_new_tokens`` reached), "abort" (``abort`` was called;
  ``token_id`` may be None) or "error" (``error`` says what; the cache is left exact). It ends after
  every sample's final event. A ``prefill_only`` request yields exactly one event: ``index`` 0,
  ``token_id`` None, finish_reason "prefilled" (or "abort" / "error").
- ``cached_tokens`` is the same in every event of a request: its prompt tokens that it did not
  compute itself (matched in the tree at admission, including blocks a low-priority prefill it
  waited for or joined computed). It is what ``usage.prompt_tokens_details.cached_tokens`` reports.
- ``priority=LOW`` requests (the server's history precompute, always ``prefill_only``) run only when
  no NORMAL work waits; a NORMAL request whose prompt needs blocks a LOW request is computing or
  will compute promotes that work (it waits for or joins it) instead of computing those blocks
  again, and counts them as cached.
- ``seed``: samples of a request draw from per-sample generators seeded from ``(seed, index)``, so
  the same seed gives the same samples wherever the request sits in the batch.

``abort(request_id, index=None)`` ends one sample (the server's ``stop`` strings) or the whole
request (client disconnect): its blocks are released at once (whole computed blocks stay in the
tree), the stream yields the final "abort" events. It is idempotent and a no-op for unknown or
finished requests. After ``abort`` the server may stop reading the stream (a client that went away):
the engine must never wait on a reader, and drops the events nobody reads. ``counts()`` is a cheap snapshot for ``/metrics``; ``limits()`` is constant.
``close()`` aborts everything and stops the scheduler thread. An engine with a shared store may
also offer ``store_stats() -> dict`` (its ``radixcache.store.STORE_COUNTERS``), exported in
``/metrics``.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import NamedTuple, Protocol, runtime_checkable


class EngineOverloaded(Exception):
    """The engine's own waiting queue is full; the server answers 503."""


class Priority(enum.IntEnum):
    """Scheduling class: NORMAL requests first; LOW (history precompute) fills idle capacity."""

    NORMAL = 0
    LOW = 1


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. ``temperature`` 0 means greedy (OpenAI's meaning); ``top_p`` 1 means no nucleus."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    seed: int | None = None
    stop_token_ids: frozenset = frozenset()


@dataclass(frozen=True)
class EngineRequest:
    """One unit of work: ``prompt`` token ids, sampling, tenant salt (namespace), priority.

    ``prefill_only``: compute the K/V of every whole block of ``prompt`` that is not cached into the
    tree and generate nothing (``params.max_new_tokens`` is ignored). ``retain_s``: a hint that the
    conversation comes back within that many seconds: when the request ends, what it computed is
    evicted only after prefixes without a live hint (it never changes a token).
    """

    request_id: str
    prompt: tuple
    params: SamplingParams
    cache_salt: str | None = None
    priority: Priority = Priority.NORMAL
    prefill_only: bool = False
    retain_s: float | None = None


class TokenEvent(NamedTuple):
    """One step of one sample; see the module docstring for the rules."""

    index: int
    token_id: int | None
    finish_reason: str | None
    cached_tokens: int
    error: str | None = None


class EngineCounts(NamedTuple):
    """A snapshot for metrics: requests running and waiting, pool blocks used of total."""

    running: int
    waiting: int
    used_blocks: int
    total_blocks: int


class EngineLimits(NamedTuple):
    """What a request must fit: the model's context length and the pool, in tokens; the block size."""

    max_context_tokens: int
    pool_tokens: int
    block_size: int


@runtime_checkable
class EngineClient(Protocol):
    """What the server needs from an engine (see the module docstring for the full contract)."""

    def limits(self) -> EngineLimits: ...

    def submit(self, request: EngineRequest) -> AsyncIterator[TokenEvent]: ...

    def abort(self, request_id: str, index: int | None = None) -> None: ...

    def counts(self) -> EngineCounts: ...

    async def close(self) -> None: ...
