"""Eviction order of the tree's evictable leaves: LRU, with soft retention as a second tier.

Every evictable leaf (unpinned, no children, not a root) has one entry, its key
``access << 32 | id`` (the recency tick, made unique by the node id), in one of two sorted tiers:

- ``lru``: leaves without live retention, least recently used first;
- ``kept``: leaves retained until a deadline still ahead on the tree's clock, least recently used
  first, each also in ``expiry`` as ``(until, key)``.

``pop`` takes from ``lru`` while it has entries and only then from ``kept``: a retained leaf goes
only after every unretained one, and before anything is refused for lack of blocks. ``expire(now)``
moves every leaf whose deadline has passed back into ``lru`` at its place by recency, which is
exactly where a leaf never retained would be. Keys are plain ints and the dicts map ints to ints or
floats, so none of this is walked by the cyclic garbage collector beyond a few list objects.
"""

from __future__ import annotations

from sortedcontainers import SortedList

from radixcache.nodes import NodeStore

ID_BITS = 32
ID_MASK = (1 << ID_BITS) - 1


class Recency:
    """The tiers of evictable leaves (see the module docstring) over a ``NodeStore``."""

    __slots__ = ("store", "clock", "lru", "kept", "expiry", "where", "retained")

    def __init__(self, store: NodeStore, clock):
        self.store = store
        self.clock = clock
        self.lru = SortedList()
        self.kept = SortedList()
        self.expiry = SortedList()
        self.where: dict[int, int] = {}     # leaf id -> its key in lru or kept
        self.retained: dict[int, float] = {}  # leaf id -> deadline, for leaves in kept

    def __len__(self) -> int:
        return len(self.where)

    def __contains__(self, i: int) -> bool:
        return i in self.where

    def add(self, i: int) -> None:
        """Enter leaf ``i`` at its recency, in ``kept`` if its retention is still ahead."""
        key = (self.store.access[i] << ID_BITS) | i
        self.where[i] = key
        until = self.store.until[i]
        if until and until > self.clock():
            self.retained[i] = until
            self.kept.add(key)
            self.expiry.add((until, key))
        else:
            self.lru.add(key)

    def discard(self, i: int) -> None:
        """Remove leaf ``i`` if it has an entry (it was touched, locked, grew a child or left)."""
        key = self.where.pop(i, None)
        if key is None:
            return
        until = self.retained.pop(i, None)
        if until is None:
            self.lru.remove(key)
        else:
            self.kept.remove(key)
            self.expiry.remove((until, key))

    def expire(self, now: float) -> None:
        """Move every retained leaf whose deadline is at or before ``now`` back into ``lru``."""
        expiry = self.expiry
        while expiry and expiry[0][0] <= now:
            _, key = expiry.pop(0)
            self.kept.remove(key)
            del self.retained[key & ID_MASK]
            self.lru.add(key)

    def pop(self) -> int | None:
        """Take the next leaf to evict: the least recently used unretained one, else the least
        recently used retained one; None when there is no evictable leaf. Call ``expire`` first."""
        if self.lru:
            key = self.lru.pop(0)
        elif self.kept:
            key = self.kept.pop(0)
            self.expiry.remove((self.retained.pop(key & ID_MASK), key))
        else:
            return None
        i = key & ID_MASK
        del self.where[i]
        return i

    def check(self, leaves: set) -> None:
        """Assert that the entries are exactly ``leaves`` (the evictable leaves), each at its current
        recency, and that no entry of ``lru`` has a deadline still ahead."""
        store, now = self.store, self.clock()
        assert set(self.where) == leaves, \
            f"recency entries {sorted(self.where)} differ from the evictable leaves {sorted(leaves)}"
        assert len(self.lru) + len(self.kept) == len(self.where), "a leaf is in both tiers or neither"
        for i, key in self.where.items():
            assert key == (store.access[i] << ID_BITS) | i, f"stale recency entry for node {i}"
            if i in self.retained:
                assert key in self.kept and (self.retained[i], key) in self.expiry, f"node {i}: bad tier"
                assert self.retained[i] == store.until[i], f"node {i}: retention changed in its tier"
            else:
                assert key in self.lru, f"node {i} is in no tier"
                assert not store.until[i] > now, f"node {i}: retained until {store.until[i]} but in lru"
        assert len(self.expiry) == len(self.kept) == len(self.retained), "expiry list out of step"
