"""Eviction: the order of the tree's evictable leaves (LRU, with soft retention as a second tier)
and the dropping of the least recently used blocks, a leaf's deepest blocks first.

A leaf's blocks share its tick (their last use), and no tick is older than a tick below it
(``radixcache.tree.body``), so taking leaves in this order, each leaf's deepest blocks first, evicts
blocks in exact block-level LRU order.

``Recency``: every evictable leaf (unpinned, no children, no partial tail, not a root) has one
entry, its key ``access << 32 | id`` (the recency tick, made unique by the node id), in ``where``,
and belongs to one of two tiers:

- ``lru``: leaves without live retention, least recently used first;
- ``kept``: leaves retained until a deadline still ahead on the tree's clock (``deadlines`` maps
  them to it), least recently used first, each deadline also in ``expiry``.

``pop`` takes from ``lru`` while it has entries and only then from ``kept``: a retained leaf goes
only after every unretained one, and before anything is refused for lack of blocks. ``expire(now)``
moves every leaf whose deadline has passed back into ``lru`` at its place by recency, which is
exactly where a leaf never retained would be.

The tiers are binary heaps of plain ints with lazy deletion: ``discard`` only forgets the leaf in
``where``; a heap entry counts only while ``where`` still gives its key and its tier matches, and
stale entries are skipped when they surface or dropped when a heap grows past twice its live size.
So a touch costs two C-level heap operations and no list is ever walked by the collector beyond
the few heap objects themselves.

``evict_lru`` is the only way a whole block leaves the tree (the KV event log hears of it here); it
takes leaves in that order, truncates a leaf when fewer of its blocks are needed, and unlinks a
leaf it empties (``remove_leaf``), which may make its parent an evictable leaf in turn. Both keep
the invariants ``radixcache.tree.body`` lists.
"""

from __future__ import annotations

from array import array
from heapq import heapify, heappop, heappush

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the body imports this module
    from radixcache.tree.body import NodeTable, TreeBody


# ------------------------------------------------------------ the order
ID_BITS = 32
ID_MASK = (1 << ID_BITS) - 1
_SLACK = 1024  # stale entries a heap may carry beyond its live ones before it is rebuilt


class Recency:
    """The tiers of evictable leaves (see the module docstring) over a ``NodeTable``."""

    __slots__ = ("nodes", "clock", "lru", "kept", "expiry", "where", "deadlines")

    def __init__(self, nodes: NodeTable, clock):
        self.nodes = nodes
        self.clock = clock
        self.lru: list[int] = []
        self.kept: list[int] = []
        self.expiry: list[tuple[float, int]] = []
        self.where: dict[int, int] = {}       # leaf id -> its key
        self.deadlines: dict[int, float] = {}  # leaf id -> deadline, for the leaves of ``kept``

    def __len__(self) -> int:
        return len(self.where)

    def __contains__(self, i: int) -> bool:
        return i in self.where

    def add(self, i: int) -> None:
        """Enter leaf ``i`` at its recency, in ``kept`` if its retention is still ahead."""
        key = (self.nodes.access[i] << ID_BITS) | i
        self.where[i] = key
        until = self.nodes.until[i]
        if until and until > self.clock():
            self.deadlines[i] = until
            heappush(self.kept, key)
            heappush(self.expiry, (until, key))
            if len(self.kept) > 2 * len(self.deadlines) + _SLACK:
                self._rebuild_kept()
        else:
            heappush(self.lru, key)
            if len(self.lru) > 2 * len(self.where) + _SLACK:
                self.lru = [k for j, k in self.where.items() if j not in self.deadlines]
                heapify(self.lru)

    def _rebuild_kept(self) -> None:
        where = self.where
        self.kept = [where[j] for j in self.deadlines]
        self.expiry = [(u, where[j]) for j, u in self.deadlines.items()]
        heapify(self.kept)
        heapify(self.expiry)

    def extend_deadline(self, i: int, until: float) -> None:
        """Raise node ``i``'s retention deadline (``nodes.until``) to ``until``, never lowering it;
        a leaf with an entry is entered again, in the tier the new deadline puts it in."""
        if until > self.nodes.until[i]:
            self.nodes.until[i] = until
            if i in self.where:
                self.discard(i)
                self.add(i)

    def discard(self, i: int) -> None:
        """Forget leaf ``i`` if it has an entry (it was touched, locked, grew a child or left)."""
        if self.where.pop(i, None) is not None:
            self.deadlines.pop(i, None)

    def expire(self, now: float) -> None:
        """Move every deadlines leaf whose deadline is at or before ``now`` back into ``lru``."""
        expiry, where, deadlines = self.expiry, self.where, self.deadlines
        while expiry and expiry[0][0] <= now:
            until, key = heappop(expiry)
            i = key & ID_MASK
            if where.get(i) == key and deadlines.get(i) == until:
                del deadlines[i]
                heappush(self.lru, key)

    def pop(self) -> int | None:
        """Take the next leaf to evict: the least recently used unretained one, else the least
        recently used deadlines one; None when there is no evictable leaf. Call ``expire`` first."""
        where, deadlines = self.where, self.deadlines
        lru = self.lru
        while lru:
            key = heappop(lru)
            i = key & ID_MASK
            if where.get(i) == key and i not in deadlines:
                del where[i]
                return i
        kept = self.kept
        while kept:
            key = heappop(kept)
            i = key & ID_MASK
            if where.get(i) == key and i in deadlines:
                del where[i]
                del deadlines[i]
                return i
        return None

    def check(self, leaves: set) -> None:
        """Assert that the entries are exactly ``leaves`` (the evictable leaves), each at its current
        recency and present in its tier's heap, and that no unretained entry has a deadline ahead."""
        nodes, now = self.nodes, self.clock()
        assert set(self.where) == leaves, \
            f"recency entries {sorted(self.where)} differ from the evictable leaves {sorted(leaves)}"
        assert set(self.deadlines) <= set(self.where), "a deadlines entry is not a leaf"
        lru, kept, expiry = set(self.lru), set(self.kept), set(self.expiry)
        for i, key in self.where.items():
            assert key == (nodes.access[i] << ID_BITS) | i, f"stale recency entry for node {i}"
            if i in self.deadlines:
                assert key in kept and (self.deadlines[i], key) in expiry, f"node {i}: not in its tier"
                assert self.deadlines[i] == nodes.until[i], f"node {i}: retention changed in its tier"
            else:
                assert key in lru, f"node {i} is in no tier"
                assert not nodes.until[i] > now, f"node {i}: deadlines until {nodes.until[i]} but in lru"


# ------------------------------------------------------------ eviction
def remove_leaf(body: TreeBody, i: int) -> None:
    """Unlink leaf ``i`` (its blocks already released); a parent left on a retained path inherits
    the retention, and becomes evictable if it is a leaf now."""
    nodes = body.nodes
    parent = nodes.parent[i]
    if nodes.tail[parent] == i:
        nodes.tail[parent] = -1
    else:
        siblings = nodes.kids[parent]
        del siblings[nodes.keys[i][:body.bs4]]
        if not siblings:
            nodes.kids[parent] = None
    until = nodes.until[i]
    nodes.free(i)
    if nodes.parent[parent] < 0:
        body.drop_idle_root(parent)
        return
    if until > nodes.until[parent]:
        nodes.until[parent] = until
    if body.is_evictable_leaf(parent):
        body.recency.add(parent)


def evict_lru(body: TreeBody, num_blocks: int, now) -> int:
    """Drop the tree's reference on up to ``num_blocks`` blocks in eviction order (see
    ``radixcache.tree.eviction``), a leaf's deepest blocks first; returns how many were dropped.
    ``now`` is called for the time only when some leaf is retained."""
    nodes, recency, bs4 = body.nodes, body.recency, body.bs4
    if recency.deadlines:
        recency.expire(now())
    dropped = 0
    gone = bytearray()
    while dropped < num_blocks:
        i = recency.pop()
        if i is None:
            break
        blocks = nodes.blocks[i]
        left = max(0, (len(blocks) >> 2) - (num_blocks - dropped))
        gone += blocks[4 * left:]
        dropped += (len(blocks) >> 2) - left
        if left:
            nodes.blocks[i] = blocks[:4 * left]
            nodes.keys[i] = nodes.keys[i][:left * bs4]
            recency.add(i)
        else:
            if len(nodes.keys[i]) < bs4:
                body.tails -= 1
            remove_leaf(body, i)
    if gone:
        ids = array("I", gone)
        body.allocator.release(ids)
        body.mark(ids, 0)
        body.cached -= dropped
        if body.events is not None:
            body.events.removed(body, bytes(gone))  # tails among them were never announced
    return dropped
