"""A sequence's hold on the cache: one ``Lease`` per running sequence, how the manager's verbs move
its holds, the ``Ledger`` of statistics and the counters its store and KV event publisher last
reported (``AttachedCounters``).

A live lease holds one lock on the tree node its committed path ends at and one reference on each
block in ``lease.blocks``. The functions that move them (``hold_match``, ``adopt``, ``share``,
``leave_tail``, ``let_go``; all under the manager's lock) keep the manager's invariants 1 and 2
(``radixcache.lifecycle.manager``): a block's reference count is 1 if the tree holds it plus 1 per
lease holding it, and a lease's first ``committed`` blocks are the tree's path to its locked node,
with ``lease.tokens`` their tokens. They check no argument: the manager has, before calling.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

from radixcache.blocks import BlockAllocator
from radixcache.tree import Match, Namespace, Node, RadixCache


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


def hold_match(tree: RadixCache, allocator: BlockAllocator, match: Match, namespace: Namespace,
               tokens: array) -> Lease:
    """A new lease on ``match`` (of ``tokens``, packed, in ``namespace``): its node locked, its
    whole blocks retained and committed, ``tokens[:match.length]`` computed and recorded."""
    tree.lock(match.node)
    allocator.retain(match.blocks)
    return Lease(namespace, list(match.blocks), match.node, match.length, len(match.blocks),
                 tokens=tokens[:match.length])


def adopt(tree: RadixCache, allocator: BlockAllocator, lease: Lease, new: array, full: int) -> int:
    """Put ``lease``'s blocks ``committed .. full-1`` (``new`` are their tokens, packed) into the
    tree below its node, at once; move its lock to the new end of its path, swap each block another
    request cached first for the tree's, and count them committed. Returns the index of the first
    block the tree adopted from the lease (``full`` when the tree had them all)."""
    done, bs = lease.committed, tree.block_size
    got = tree.adopt_below(lease.node, new, lease.blocks[done:full])
    lease.tokens.extend(new)
    if got.node != lease.node:
        tree.lock(got.node)
        tree.unlock(lease.node)
        lease.node = got.node
    first_new = done + got.cached // bs
    for i in range(done, first_new):
        mine, tree_block = lease.blocks[i], got.blocks[i - done]
        if mine != tree_block:  # another request cached this block first
            allocator.retain([tree_block])
            allocator.release([mine])
            lease.blocks[i] = tree_block
    lease.committed = full
    return first_new


def leave_tail(tree: RadixCache, lease: Lease, tokens: Sequence[int]) -> None:
    """Put ``lease``'s partial last block (its computed tokens after the committed whole blocks,
    read from ``tokens``) into the tree as the partial tail of its node; nothing when it has none.
    The lease keeps its reference (the tree retains the block if it adopts it)."""
    full = lease.committed * tree.block_size
    if lease.computed > full:
        tree.adopt_below(lease.node, tokens[full:lease.computed], (),
                         tail_block=lease.blocks[lease.committed])


def share(tree: RadixCache, allocator: BlockAllocator, lease: Lease, copy: list) -> Lease:
    """A new lease sharing ``lease``'s committed blocks (retained, its node locked once more), then
    ``copy`` (blocks the caller hands over, e.g. the copy of a partial last block), with the same
    computed and cached counts and a copy of its token record."""
    shared = lease.blocks[:lease.committed]
    allocator.retain(shared)
    tree.lock(lease.node)
    return Lease(lease.namespace, shared + copy, lease.node, lease.computed, lease.committed,
                 lease.cached_tokens, tokens=lease.tokens[:])


def let_go(tree: RadixCache, allocator: BlockAllocator, lease: Lease) -> None:
    """Drop ``lease``'s lock and every reference it holds, and mark it released."""
    tree.unlock(lease.node)
    allocator.release(lease.blocks)
    lease.node, lease.blocks, lease.released = None, [], True
