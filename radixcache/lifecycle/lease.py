"""The records a CacheManager keeps: one Lease per running sequence, one Ledger of statistics,
and the counters its store and KV event publisher last reported (``AttachedCounters``)."""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field, fields

from radixcache.tree import Namespace, Node


@dataclass(eq=False)
class Lease:
    """One sequence's hold on the cache. Owned by the manager: callers read it, never write it.

    ``blocks[i]`` holds the K/V of positions ``i*bs .. i*bs+bs-1``; ``computed`` leading tokens
    have K/V there; ``committed`` leading whole blocks are in the tree, on the path to ``node``,
    and ``tokens`` are their tokens (an ``array('I')`` of ``committed * bs`` ids, packed once and
    only ever extended, so a commit adds just its new blocks and its first ids may be read
    outside the manager's lock); ``cached_tokens`` prompt tokens were served from the cache at
    admission (what the server reports as ``usage.prompt_tokens_details.cached_tokens``).
    """

    namespace: Namespace
    blocks: list
    node: Node | None
    computed: int = 0
    committed: int = 0
    cached_tokens: int = 0
    released: bool = False
    tokens: array = field(default_factory=lambda: array("I"), repr=False)


@dataclass
class Ledger:
    """The statistics of every request the manager served (the one ledger; counters in tokens)."""

    requests: int = 0
    queried_tokens: int = 0
    hit_tokens: int = 0
    computed_prompt_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    fallbacks: int = 0
    fallback_reasons: dict = field(default_factory=dict)

    def count_request(self, prompt_tokens: int, cached_tokens: int) -> None:
        """Count one admitted request: ``prompt_tokens`` queried, ``cached_tokens`` of them hit."""
        self.requests += 1
        self.queried_tokens += prompt_tokens
        self.hit_tokens += cached_tokens
        self.computed_prompt_tokens += prompt_tokens - cached_tokens

    def count_fallback(self, reason: str) -> None:
        """Count one request served without the cache, and why."""
        self.fallbacks += 1
        self.fallback_reasons[reason] = self.fallback_reasons.get(reason, 0) + 1

    def as_dict(self) -> dict:
        """Every counter, a copy of ``fallback_reasons``, and ``hit_rate`` (hit / queried tokens)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["fallback_reasons"] = dict(self.fallback_reasons)
        out["hit_rate"] = self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0
        return out


class AttachedCounters:
    """The counters of a manager's shared store (``store_*``) and KV event publisher
    (``kv_events_*``) as each last reported them, so they stay readable after both are closed."""

    def __init__(self):
        self.store: dict = {}
        self.events: dict = {}

    def read(self, store, events) -> dict:
        """Both sets merged, each first read afresh (``stats()``) from ``store`` and ``events``
        where attached (not None); a detached one's last counters stay."""
        if store is not None:
            self.store = store.stats()
        if events is not None:
            self.events = events.stats()
        return {**self.store, **self.events}

    def close(self, store, events, timeout: float) -> dict:
        """Close ``store`` and ``events`` where not None (each waits up to ``timeout`` s: call it
        without the manager's lock), keep the final counters they return and give both merged."""
        if store is not None:
            self.store = store.close(timeout)
        if events is not None:
            self.events = events.close(timeout)
        return {**self.store, **self.events}
