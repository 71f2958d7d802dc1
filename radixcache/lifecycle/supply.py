"""Where a CacheManager's leases get their blocks: free ones first, then LRU eviction of the tree's
unpinned leaves, and copies of partial blocks (copy on write: a block the tree or another lease
holds is never written, so its K/V is copied into a block of the lease's own).

``BlockSupply`` keeps no state of its own: it works on the manager's allocator and tree, and every
method expects the manager's lock held. Before it counts or evicts freeable blocks it calls
``finish_offers`` (blocks offered to a shared store are on locked paths until their copies are
taken, see ``radixcache.lifecycle.offers``), so what it says an allocation can get is exact. A call
that fails gives back every block it took and every reference it added (what it evicted to make
room stays evicted: the tree alone held those blocks).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from radixcache.blocks import BlockAllocator
from radixcache.errors import OutOfBlocks
from radixcache.tree import RadixCache

__all__ = ["BlockSupply"]


class BlockSupply:
    """The source of one manager's blocks (see the module docstring). ``leases`` arguments are the
    manager's live leases, read only to say in an ``OutOfBlocks`` message what running requests
    hold; ``pool`` arguments are its KV pool (anything with ``copy_block(src, dst)``)."""

    def __init__(self, allocator: BlockAllocator, tree: RadixCache, block_size: int,
                 finish_offers: Callable[[], None]):
        self.allocator = allocator
        self.tree = tree
        self.block_size = block_size
        self.finish_offers = finish_offers

    def freeable(self) -> int:
        """Blocks an allocation can get now: the free ones plus those eviction would free."""
        self.finish_offers()
        return self.allocator.num_free + self.tree.evictable_blocks

    def ensure(self, n: int, what: str, leases: Iterable) -> None:
        """Raise OutOfBlocks unless ``n`` blocks can be had now, free or by eviction (which it does
        not do); the message says what ``what`` needs and what is free, freeable and held by
        running requests."""
        free = self.allocator.num_free
        if n > free:
            self.finish_offers()
            evictable = self.tree.evictable_blocks
            if n > free + evictable:
                leases = list(leases)
                running = sum(len(x.blocks) for x in leases)
                raise OutOfBlocks(
                    f"{what} need {n} more blocks of {self.block_size} tokens: {free} are free and "
                    f"{evictable} more could be evicted; {len(leases)} running requests hold "
                    f"{running} (pool: {self.allocator.num_blocks} blocks): raise max_cache_tokens "
                    f"or run fewer or shorter requests at once")

    def allocate(self, n: int, what: str, leases: Iterable) -> list:
        """``n`` fresh blocks (reference count 1 each), evicting LRU leaves when fewer are free.
        Raises OutOfBlocks as ``ensure`` does, with nothing changed, when even eviction cannot
        supply them."""
        self.ensure(n, what, leases)
        free = self.allocator.num_free
        if n > free:
            self.tree.evict(n - free)
        return self.allocator.allocate(n)

    def copy_of(self, pool, src: int, what: str, leases: Iterable) -> list:
        """One fresh block (in a list) holding a copy of block ``src``'s K/V. Raises as ``allocate``
        does, or what ``pool.copy_block`` raises, with the fresh block given back first."""
        copy = self.allocate(1, what, leases)
        self._copy(pool, src, copy)
        return copy

    def copy_tail(self, pool, tail: int, leases: Iterable) -> list:
        """A block of the caller's own (in a list, its one reference the caller's) with the K/V of
        ``tail``, a partial block the tree holds: a fresh copy, or ``tail`` itself when the eviction
        that made room for the copy took it out of the tree. Empty, with nothing changed, when the
        only block eviction could take is the tail itself (the caller recomputes its tokens)."""
        if self.allocator.num_free < 1 and self.freeable() < 2:
            return []
        self.allocator.retain([tail])  # the eviction for the copy must not free the source
        try:
            if self.allocator.num_free < 1:
                self.tree.evict(1)  # the least recently used block: maybe the tail itself
            if not self.tree.holds(tail) and self.allocator.refcount(tail) == 1:
                copy = [tail]  # evicted: the tail is the caller's alone now, no copy needed
            else:
                copy = self.allocate(1, "the copy of a partial tail", leases)
                self._copy(pool, tail, copy)
        except BaseException:
            self.allocator.release([tail])
            raise
        if copy[0] != tail:
            self.allocator.release([tail])
        return copy

    def sizes(self) -> dict:
        """The sizes in tokens, offers finished first: ``cached_tokens`` (held by the tree),
        ``pinned_tokens``, ``evictable_tokens``, ``free_tokens``, ``capacity_tokens`` and
        ``evicted_tokens`` (the tree's counter since its stats were last reset)."""
        self.finish_offers()
        tree, allocator, bs = self.tree, self.allocator, self.block_size
        return dict(cached_tokens=tree.cached_blocks * bs, pinned_tokens=tree.pinned_blocks * bs,
                    evictable_tokens=tree.evictable_blocks * bs,
                    free_tokens=allocator.num_free * bs, capacity_tokens=allocator.num_blocks * bs,
                    evicted_tokens=tree.stats.evicted_blocks * bs)

    def _copy(self, pool, src: int, copy: list) -> None:
        try:
            pool.copy_block(src, copy[0])
        except BaseException:
            self.allocator.release(copy)
            raise
