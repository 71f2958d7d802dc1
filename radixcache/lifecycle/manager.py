"""CacheManager: the one request lifecycle over a radix tree of reference-counted KV blocks.

Every way radixcache runs a request (``generate``, ``generate_batch``, the server) goes through the
same verbs, under one lock and into one ledger::

    lease = manager.admit(tokens, namespace)  # match tokens[:-1], pin the match, hold its blocks
    manager.grow(lease, n)                    # blocks for n tokens, allocated as tokens arrive
    ...                                       # the caller computes K/V of tokens[lease.computed:n]
    manager.commit(lease, tokens, n)          # whole blocks into the tree at once: others share them
    manager.finish(lease, tokens, keep_s)   # commit, keep the path (a hint), release
    manager.release(lease, tokens)            # keep the partial tail, unpin, drop every hold

``fork`` starts a parallel sample that shares a lease's whole blocks. Tokens may be given as
lists, tuples or ``array('I')``; the lifecycle carries them as ``array('I')`` (packed once: the
tree takes an array with one copy). A lease keeps the tokens it committed and the node its path
ends at, so a commit walks and packs only its new blocks: it costs O(block), whatever the
context. Pure Python: the KV pool is handed in as an opaque object whose only method used here
is ``copy_block(src, dst)`` (plus ``export_blocks``/``import_block`` with a store).

With a shared store (a ``radixcache.store.BlockStore``, e.g. Redis), every whole block the tree
adopts from a lease is offered to it (copied and queued once the manager's lock is free, see
``radixcache.lifecycle.offers``; the network is never waited on), and ``prefetch(tokens)``, called before
``admit`` by whoever may wait on the network, loads the blocks of a prompt that follow the local
match from the store into the tree.
With a KV event publisher (``use_events``), every whole block that enters or leaves the tree
is published as vLLM's KV events (``radixcache.kv_events``).

Invariants (``check()`` verifies them; the property tests run it after every step):

1. every block's reference count = (1 if the tree holds it) + the live leases holding it;
2. a lease's first ``committed`` blocks are exactly the tree's blocks on the path to the node it
   has locked, their tokens are ``lease.tokens``, and none of its other blocks belongs to the
   tree. So a block a running request holds is never evictable, and every evictable block is held
   by the tree alone: evicting k of them frees exactly k;
3. ``lease.computed`` tokens have K/V in ``lease.blocks``; nothing is ever written into a block
   that the tree or another lease holds (partial blocks are copied, copy on write);
4. a block offered to the store stays on a locked path until its copy is taken; every call that
   counts or takes freeable blocks first finishes the offers, so ``freeable_blocks`` is exact.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Sequence

from radixcache.blocks import BlockAllocator
from radixcache.errors import CacheError
from radixcache.lifecycle.lease import (AttachedCounters, Lease, Ledger, adopt, hold_match, leave_tail, let_go,
                                         share)
from radixcache.lifecycle.offers import OfferQueue, ReleasingLock
from radixcache.lifecycle.prefetch import Fetched, fetch_from_store, load_fetched
from radixcache.lifecycle.supply import BlockSupply
from radixcache.tokens import token_array
from radixcache.tree import CacheStats, Namespace, RadixCache

__all__ = ["CacheManager"]


class CacheManager:
    """The single owner of an allocator, a radix tree, their lock and the statistics ledger.

    Thread-safe: every method takes ``mutex`` (a reentrant lock, see ``radixcache.lifecycle.offers``), which
    callers may also hold across several calls. Failed calls change nothing and leave no lock or
    reference behind.
    """

    def __init__(self, num_blocks: int, block_size: int = 16, *, pool=None,
                 clock=time.monotonic, store=None):
        self.allocator = BlockAllocator(num_blocks)
        self.tree = RadixCache(self.allocator, block_size, clock=clock)
        self.block_size = block_size
        self.pool = pool
        self.clock = clock
        self.mutex = ReleasingLock(lambda: self._offers.after_release(self))
        self._offers = OfferQueue(self.mutex)
        self._supply = BlockSupply(self.allocator, self.tree, block_size, self._finish_offers)
        self.ledger = Ledger()
        self._live: dict[int, Lease] = {}
        self._counters = AttachedCounters()  # the store's and the publisher's, kept after close()
        self.store = self.events = None
        self.use_store(store)

    # ------------------------------------------------------------------ the lifecycle
    def admit(self, tokens: Sequence[int], namespace: Namespace = (), *, count: bool = True) -> Lease:
        """Start a sequence of ``tokens`` (at least one): match ``tokens[:-1]``, pin the match and
        hold its blocks; copy a matching partial tail into a block of the lease's own when one is
        free or freeable (else the tail is recomputed). ``count=False`` (a preempted sequence coming
        back, or a scheduler's tentative admission, counted by ``record_admission`` once it sticks)
        keeps it out of the ledger. Raises TypeError/ValueError for bad tokens, before any change;
        never OutOfBlocks."""
        tokens = token_array(tokens)
        if not tokens:
            raise ValueError("empty prompt: a request needs at least one token")
        with self.mutex:
            m = self.tree.match(tokens[:-1], namespace)
            lease = hold_match(self.tree, self.allocator, m, namespace, tokens)
            if m.tail_length and self.pool is not None:
                copy = self._supply.copy_tail(self.pool, m.tail_block, self._live.values())
                if copy:
                    lease.blocks.extend(copy)
                    lease.computed += m.tail_length
            lease.cached_tokens = lease.computed
            self._live[id(lease)] = lease
            if count:
                self.record_admission(lease, len(tokens))
            return lease

    def record_admission(self, lease: Lease, prompt_tokens: int) -> None:
        """Count in the ledger the request of ``lease`` (admitted with ``count=False``): its
        ``prompt_tokens`` queried, ``lease.cached_tokens`` of them hit. A scheduler that admits
        tentatively (and backs out when the first chunk's blocks cannot be had) counts only the
        admission it keeps, so a prompt is never counted twice."""
        with self.mutex:
            self._held(lease, "record_admission")
            self.ledger.count_request(prompt_tokens, lease.cached_tokens)

    def grow(self, lease: Lease, length: int) -> None:
        """Give ``lease`` blocks for ``length`` tokens, allocating only what is missing and evicting
        LRU leaves when short. Raises OutOfBlocks, with nothing changed, when even eviction cannot
        supply them; the message says what is needed, free, freeable and held by running requests."""
        with self.mutex:
            self._held(lease, "grow")
            need = -(-length // self.block_size) - len(lease.blocks)
            if need > 0:
                lease.blocks.extend(self._supply.allocate(need, f"{length} tokens",
                                                         self._live.values()))

    def can_grow(self, lease: Lease, length: int) -> bool:
        """Whether ``grow(lease, length)`` would succeed now (for schedulers deciding to preempt)."""
        with self.mutex:
            need = -(-length // self.block_size) - len(lease.blocks)
            return need <= self.allocator.num_free or need <= self.freeable_blocks()

    def commit(self, lease: Lease, tokens: Sequence[int], computed: int, *,
               offer: bool = True) -> None:
        """Record that ``tokens[:computed]`` have K/V in ``lease.blocks`` and put the whole blocks
        not yet in the tree into it at once, below the lease's node; the lease's lock moves down
        to the new end of its path, and blocks another request cached first are swapped for the
        tree's. Only the tokens after the committed blocks are read and packed; of the committed
        ones, the first and the last block are compared with ``lease.tokens`` (``CacheError`` when
        they differ: another sequence was passed), so a commit costs O(block). The blocks the tree
        adopted are offered to the store unless ``offer`` is False (they came from it)."""
        with self.mutex:
            self._held(lease, "commit")
            bs = self.block_size
            most = min(len(tokens), len(lease.blocks) * bs)
            if not lease.computed <= computed <= most:
                raise CacheError(f"commit: computed={computed} must lie in {lease.computed}.."
                                 f"{most} (tokens and blocks)")
            full, done = computed // bs, lease.committed
            if full <= done:
                lease.computed = computed
                return
            # the first and the last committed block, whatever the context: a commit of another
            # sequence differs in one of them
            for lo in {0, (done - 1) * bs} if done else ():
                if token_array(tokens[lo:lo + bs]) != lease.tokens[lo:lo + bs]:
                    raise CacheError("commit: the tokens differ from the ones committed before")
            first_new = adopt(self.tree, self.allocator, lease,
                              token_array(tokens[done * bs:full * bs]), full)
            lease.computed = computed
            if offer and self.store is not None and first_new < full:
                self._offers.offer(self.tree, self.store, lease, first_new, full)

    def fork(self, lease: Lease, tokens: Sequence[int]) -> Lease:
        """A parallel sample of ``lease`` (whose ``tokens[:lease.computed]`` are computed): commits
        ``lease``'s whole blocks, then shares them (retained, path locked) and gives the new lease
        a copy of the partial last block. OutOfBlocks, with nothing changed, when no block is free
        or freeable for that copy."""
        with self.mutex:
            self._held(lease, "fork")
            full, partial = divmod(lease.computed, self.block_size)
            what, live = "the copy of a partial block", self._live.values()
            if partial and self.pool is None:
                raise CacheError("fork: copying a partial block needs the manager's pool")
            if partial:
                self._supply.ensure(1, what, live)  # first: a failed fork commits nothing
            self.commit(lease, tokens, lease.computed)
            copy = self._supply.copy_of(self.pool, lease.blocks[full], what, live) if partial else []
            child = share(self.tree, self.allocator, lease, copy)
            self._live[id(child)] = child
            return child

    def release(self, lease: Lease, tokens: Sequence[int] | None = None) -> None:
        """End ``lease`` (finished, preempted, aborted or failed alike). With ``tokens`` (at least
        ``lease.computed`` of them) what was computed is committed first, its partial last block
        kept in the tree as a tail. Then the lock and every reference the lease holds are dropped.
        A second release is a no-op."""
        with self.mutex:
            if lease.released:
                return
            try:
                if tokens is not None:
                    if len(tokens) < lease.computed:
                        raise CacheError(f"release: {len(tokens)} tokens, but {lease.computed} were computed")
                    self.commit(lease, tokens, lease.computed)  # all its whole blocks
                    leave_tail(self.tree, lease, tokens)
            finally:  # whatever happened above, the lease lets go of everything
                let_go(self.tree, self.allocator, lease)
                del self._live[id(lease)]

    def finish(self, lease: Lease, tokens: Sequence[int], keep_s: float | None = None) -> None:
        """End ``lease`` as a request that is done (the one verb for every front end): commit what
        was computed (``tokens[:lease.computed]``), with ``keep_s`` (seconds) keep its
        committed path that long (see ``keep``), then ``release`` it with ``tokens`` (the partial
        last block kept as a tail). A bad ``keep_s`` raises before anything changes; whatever
        fails after that, the lease is released."""
        with self.mutex:
            self._held(lease, "finish")
            if keep_s is not None:
                self._seconds(keep_s, "finish")
            try:
                if keep_s is not None:
                    self.commit(lease, tokens, lease.computed)
                    self.keep(lease, keep_s)
            finally:
                self.release(lease, tokens)

    def prefetch(self, tokens: Sequence[int], namespace: Namespace = ()) -> int:
        """Load the store's blocks that follow the local match of ``tokens[:-1]`` into the tree;
        returns the tokens loaded: ``load(fetch(tokens, namespace))`` on this thread. Call it before
        ``admit``, without holding ``mutex``: it waits on the network. Without a store it returns
        0 at once."""
        return self.load(self.fetch(tokens, namespace))

    def fetch(self, tokens: Sequence[int], namespace: Namespace = ()) -> Fetched | None:
        """The store's blocks that follow the local match of ``tokens[:-1]``, read over the network
        (any thread, without holding ``mutex``); nothing changes until ``load``. None when there is
        nothing to load (or no store). See ``radixcache.lifecycle.prefetch``."""
        return fetch_from_store(self, tokens, namespace)

    def load(self, fetched: Fetched | None) -> int:
        """Put what ``fetch`` read into the tree, as evictable blocks the next ``admit`` matches;
        returns the tokens loaded (0 when the local prefix was evicted meanwhile or the pool is
        full). The thread that owns the manager's changes calls it (the server's scheduler)."""
        return load_fetched(self, fetched)

    def use_store(self, store) -> None:
        """Attach a shared store (or None); it needs the manager's pool and its block size."""
        if store is not None and (self.pool is None or store.block_size != self.block_size):
            raise ValueError("a store needs the manager's pool and the same block size")
        with self.mutex:
            self.store = store

    def use_events(self, publisher) -> None:
        """Publish the tree's whole blocks through ``publisher`` (a
        ``radixcache.kv_events.KVEventPublisher``; None stops): it starts with ``AllBlocksCleared``
        and ``BlockStored`` for what the tree holds. A publisher replaced here is not closed."""
        if publisher is not None and not hasattr(publisher, "log"):
            raise TypeError(f"use_events takes a KVEventPublisher or None, got {type(publisher).__name__}")
        with self.mutex:
            self.tree.set_event_log(None if publisher is None else publisher.log)
            self.events = publisher

    def resync_events(self) -> None:
        """Republish the whole state (``AllBlocksCleared``, then ``BlockStored`` for every whole
        block), e.g. for a subscriber that joined late. Nothing without a publisher."""
        with self.mutex:
            self.tree.resync_events()

    def close(self, timeout: float = 10.0) -> dict:
        """Flush and close the store (waiting up to ``timeout`` s for queued writes) and the KV
        event publisher (sending what is queued, unbinding); returns their final counters (empty
        without either). The cache itself stays usable, without them."""
        with self.mutex:
            self._finish_offers()
            store, self.store = self.store, None
            events = self.events
            self.use_events(None)
        return self._counters.close(store, events, timeout)

    def keep(self, lease: Lease, seconds: float) -> None:
        """Hint that ``lease``'s sequence comes back within ``seconds`` (an agent session waiting on
        a tool): its committed path (every whole block ``commit`` put in the tree) stays cached until
        then, evicted only after every prefix without a live hint, and still before anything is
        refused. Soft: it never pins, needs no release, and once expired changes nothing; it never
        changes a computed token. Call it after the last ``commit``, before ``release``."""
        with self.mutex:
            self._held(lease, "keep")
            self._seconds(seconds, "keep")
            self.tree.keep(lease.node, self.clock() + seconds)

    @staticmethod
    def _seconds(seconds, what: str) -> None:
        """TypeError unless ``seconds`` (of ``keep`` / ``finish``) is an int or float (not a bool);
        ValueError unless it is >= 0 (NaN is not)."""
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
            raise TypeError(f"{what}: seconds must be a number, got {seconds!r}")
        if not seconds >= 0:
            raise ValueError(f"{what}: seconds must be >= 0, got {seconds!r}")

    # ------------------------------------------------------------------ ledger and sizes
    def record_generated(self, n: int) -> None:
        """Count ``n`` generated tokens."""
        with self.mutex:
            self.ledger.generated_tokens += n

    def record_preemption(self) -> None:
        """Count one preempted sequence."""
        with self.mutex:
            self.ledger.preemptions += 1

    def record_fallback(self, reason: str) -> None:
        """Count one request served without the cache, and why."""
        with self.mutex:
            self.ledger.count_fallback(reason)

    def freeable_blocks(self) -> int:
        """Blocks an allocation can get now: the free ones plus those eviction would free (offers
        to the store are finished first, so none of their blocks is missing)."""
        with self.mutex:
            return self._supply.freeable()

    def stats(self) -> dict:
        """The ledger (``hit_rate`` = hit / queried tokens) and the sizes in tokens: ``cached_tokens``
        (held by the tree), ``pinned_tokens``, ``evictable_tokens``, ``free_tokens``,
        ``capacity_tokens``, ``evicted_tokens``, and ``running`` (live leases); with a store or a
        KV event publisher, their counters too (``store_*``, ``kv_events_*``)."""
        with self.mutex:
            sizes = self._supply.sizes()  # finishes the offers first
            out = self.ledger.as_dict()
            out.update(sizes, running=len(self._live))
            out.update(self._counters.read(self.store, self.events))
            return out

    def reset_stats(self) -> None:
        """Zero every counter ``stats`` reports: the ledger and the tree's token counters (evicted
        tokens included); the cache's contents and sizes stay."""
        with self.mutex:
            self.ledger = Ledger()
            self.tree.stats = CacheStats()

    def clear(self) -> None:
        """Drop every cached prefix that no live lease holds."""
        with self.mutex:
            self.tree.reset()

    def check(self) -> None:
        """Verify the tree's invariants and the manager's (module docstring); AssertionError says
        what is wrong."""
        with self.mutex:
            self._finish_offers()
            tree, held = self.tree, 0
            tree.check()
            for lease in self._live.values():
                path = tree.path_blocks(lease.node)
                assert list(path) == lease.blocks[:lease.committed], \
                    f"{lease}: committed blocks are not the tree's path to its locked node"
                assert lease.tokens == _path_tokens(lease.node), \
                    f"{lease}: its token record is not the tokens of its path"
                assert not any(tree.holds(b) for b in lease.blocks[lease.committed:]), \
                    f"{lease}: holds a tree block off its locked path"
                assert lease.computed <= len(lease.blocks) * self.block_size
                held += len(lease.blocks)
            allocator = self.allocator
            total = sum(allocator.refcount(b) for b in range(allocator.num_blocks))
            assert total == tree.cached_blocks + held, \
                f"reference counts sum to {total}, tree {tree.cached_blocks} + leases {held}"

    def leases(self) -> tuple:
        """The live leases (admitted or forked, not yet released)."""
        with self.mutex:
            return tuple(self._live.values())

    # ------------------------------------------------------------------ helpers
    def _held(self, lease, what: str) -> None:
        """TypeError unless ``lease`` is a Lease; CacheError unless this manager holds it live (not
        released, not another manager's). ``what`` names the calling verb."""
        if not isinstance(lease, Lease):
            raise TypeError(f"{what}: expected a Lease from admit(), got {type(lease).__name__}")
        if lease.released or self._live.get(id(lease)) is not lease:
            raise CacheError(f"{what}: the lease was released (or belongs to another manager)")

    def _finish_offers(self) -> None:
        self._offers.finish(self.tree, self.pool)

    def __repr__(self) -> str:
        return (f"CacheManager(block_size={self.block_size}, blocks={self.allocator.num_blocks}, "
                f"free={self.allocator.num_free}, running={len(self._live)})")


def _path_tokens(node) -> array:
    """The tokens on the path from the namespace root down to ``node`` (a tree handle)."""
    keys = []
    while node is not None:
        keys.append(node.key)
        node = node.parent
    out = array("I")
    for key in reversed(keys):
        out.extend(key)
    return out
