"""The radix tree's state and every structural change to it; ``RadixCache`` validates and calls these.

State: the nodes (``radixcache.nodes.NodeStore``), the eviction order (``radixcache.recency``),
the namespace roots, the in-tree marks (one byte per pool block: 1 where the tree holds a
reference), the cached, pinned and partial-tail block counts, and ``events``: None, or the
``radixcache.kv_events.BlockEventLog`` told of every whole block that enters (``add_child`` and
``extend``, the only ways one does) or leaves (``evict``, the only way one does) the tree.

Invariants every method keeps (``RadixCache.check`` asserts them):

1. the tree holds one allocator reference on every block of every node, partial tails included,
   and ``in_tree`` is 1 exactly for those blocks; ``cached`` counts them;
2. a node's tokens are the concatenation of its blocks' tokens; a child is filed under its first
   block, so two children of a node never start with the same block; a partial tail (fewer than
   ``block_size`` tokens, one block) is filed in ``tail[parent]``, is never covered by a child
   (no child's tokens start with the tail's), has no children and is never locked;
3. ``lock_ref`` of a node is its own locks plus its children's ``lock_ref``; ``pinned`` counts the
   blocks of nodes with ``lock_ref > 0`` (a tail is never pinned);
4. ``access`` never decreases from a node to its parent (every ``touch`` refreshes a whole path
   from the root, and splits, truncations and new tails copy their node's tick); the recency tiers
   hold exactly the evictable leaves: non-root, no children, no tail, ``lock_ref == 0``.

``access`` is the last use of every block of a node (``RadixCache.evict`` says what uses a block).
A touch ends at a node boundary (a match splits the node it ends inside first), so the blocks of
one node always share their last use, and ordering leaves by it, deepest blocks first, is exact
block-level LRU.
"""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Hashable

import numpy as np

from radixcache.blocks import VECTOR_MIN, BlockAllocator
from radixcache.nodes import NodeStore
from radixcache.recency import Recency
from radixcache.tokens import common_blocks, common_tokens

TAIL_SCAN = 32  # children scanned for a partially matching first block (more: only the tail is tried)
EXTEND_LIMIT = 256  # blocks a node may reach by extension in place (each extension copies the node's bytes)
_NO_BLOCKS = b""


class TreeBody:
    """Nodes, eviction order, roots, marks and counts of one tree (see the module docstring)."""

    def __init__(self, allocator: BlockAllocator, block_size: int, clock):
        self.allocator = allocator
        self.bs4 = 4 * block_size
        self.store = NodeStore()
        self.recency = Recency(self.store, clock)
        self.roots: dict[Hashable, int] = {}
        self.root_ns: dict[int, Hashable] = {}
        self.ticks = itertools.count(1)
        self.in_tree = bytearray(allocator.num_blocks)
        self.cached = 0
        self.pinned = 0
        self.tails = 0     # partial tails: cached - tails are the tree's whole blocks
        self.events = None  # a BlockEventLog, when KV events are published

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["events"] = None  # a copy of the tree has no subscribers
        return state

    # ----------------------------------------------------------------- roots and predicates
    def root(self, namespace: Hashable) -> int:
        """The root of ``namespace``, created when missing."""
        root = self.roots.get(namespace)
        if root is None:
            root = self.store.new(-1, b"", _NO_BLOCKS, 0)
            self.roots[namespace] = root
            self.root_ns[root] = namespace
        return root

    def drop_root(self, root: int) -> None:
        del self.roots[self.root_ns.pop(root)]
        self.store.free(root)

    def drop_idle_root(self, root: int) -> None:
        """Forget a namespace root that holds nothing and is not locked."""
        store = self.store
        if store.kids[root] is None and store.tail[root] < 0 and store.lock_ref[root] == 0:
            self.drop_root(root)

    def is_evictable_leaf(self, i: int) -> bool:
        store = self.store
        return (store.parent[i] >= 0 and store.kids[i] is None and store.tail[i] < 0
                and store.lock_ref[i] == 0)

    def is_tail(self, i: int) -> bool:
        return self.store.parent[i] >= 0 and len(self.store.keys[i]) < self.bs4

    def below(self, i: int) -> list:
        """Ids of ``i``'s children and its tail."""
        store = self.store
        below = list((store.kids[i] or {}).values())
        if store.tail[i] >= 0:
            below.append(store.tail[i])
        return below

    # ----------------------------------------------------------------- recency and marks
    def touch(self, i: int) -> None:
        """Refresh the recency of node ``i`` and its ancestors (one tick for the whole path)."""
        tick = next(self.ticks)
        self.recency.discard(i)
        access, parent = self.store.access, self.store.parent
        j = i
        while j >= 0:
            access[j] = tick
            j = parent[j]
        if self.is_evictable_leaf(i):
            self.recency.add(i)

    def mark(self, ids: array, value: int) -> None:
        marks = self.in_tree
        if len(ids) < VECTOR_MIN:
            for b in ids:
                marks[b] = value
        else:
            np.frombuffer(marks, np.uint8)[np.frombuffer(ids, np.uint32)] = value

    def marked(self, ids: array) -> list:
        """The ids among ``ids`` that the tree holds."""
        marks = self.in_tree
        if len(ids) < VECTOR_MIN:
            return [b for b in ids if marks[b]] if any(map(marks.__getitem__, ids)) else []
        v = np.frombuffer(ids, np.uint32)
        return v[np.frombuffer(marks, np.uint8)[v] != 0].tolist()

    # ----------------------------------------------------------------- walking
    def split(self, child: int, k: int) -> int:
        """Split node ``child`` after its first ``k`` blocks; return the new upper node.

        The original id keeps the lower part (and the tail), so handles keep their depth."""
        store, bs4 = self.store, self.bs4
        cut = k * bs4
        key, blocks, parent = store.keys[child], store.blocks[child], store.parent[child]
        upper = store.new(parent, key[:cut], blocks[:4 * k], store.access[child])
        store.lock_ref[upper] = store.lock_ref[child]
        store.kids[parent][key[:bs4]] = upper
        store.keys[child] = key[cut:]
        store.blocks[child] = blocks[4 * k:]
        store.parent[child] = upper
        store.kids[upper] = {key[cut:cut + bs4]: child}
        return upper

    def walk(self, q: bytes, root: int, split: bool) -> tuple[int, int, bytearray]:
        """Follow the whole blocks of ``q`` from ``root``. With ``split``, a node where the match ends
        inside it is split there. Returns (deepest matched node, matched bytes, matched block ids
        packed as uint32)."""
        store, bs4 = self.store, self.bs4
        kids, keys, blocks_of = store.kids, store.keys, store.blocks
        end = len(q) - len(q) % bs4
        node, pos = root, 0
        out = bytearray()
        while pos < end:
            children = kids[node]
            if children is None:
                break
            child = children.get(q[pos:pos + bs4])
            if child is None:
                break
            key = keys[child]
            n = len(key)
            if n <= end - pos and q[pos:pos + n] == key:
                out += blocks_of[child]
                pos += n
                node = child
                continue
            k = common_blocks(key, q, pos, end, bs4)
            if split:
                if 4 * k < len(blocks_of[child]):
                    child = self.split(child, k)
                out += blocks_of[child]
                node = child
            else:
                out += blocks_of[child][:4 * k]
            pos += k * bs4
            break
        return node, pos, out

    def best_tail(self, node: int, rest: bytes) -> tuple[int, int]:
        """The longest run (>= 1 token) of ``rest`` (fewer than block_size tokens) that the first
        block of ``node``'s tail or of one of its children holds: (tokens, that node or -1)."""
        if not rest:
            return 0, -1
        store = self.store
        keys, tail = store.keys, store.tail[node]
        best, found = 0, -1
        if tail >= 0:
            best = common_tokens(keys[tail], rest)
            found = tail if best else -1
        children = store.kids[node]
        if children is not None and len(children) <= TAIL_SCAN:
            first = rest[:4]
            for c in children.values():
                if keys[c][:4] == first:
                    n = common_tokens(keys[c], rest)
                    if n > best:
                        best, found = n, c
        return best, found

    # ----------------------------------------------------------------- growing
    def add_child(self, node: int, key: bytes, blocks: array) -> int:
        """Adopt ``blocks`` (held by the caller, not by the tree) as a new child of ``node`` covering
        ``key``; a tail of ``node`` that the child covers is dropped."""
        store = self.store
        old = store.tail[node]
        if old >= 0 and key.startswith(store.keys[old]):
            self.drop_tail(node)
        self.recency.discard(node)
        child = store.new(node, key, blocks.tobytes(), 0)
        if store.kids[node] is None:
            store.kids[node] = {}
        store.kids[node][key[:self.bs4]] = child
        self.allocator.retain_checked(blocks, distinct=True)
        self.mark(blocks, 1)
        self.cached += len(blocks)
        if self.events is not None:
            self.events.stored(self, node, child)
        return child

    def depth(self, i: int) -> int:
        """Bytes of tokens from the namespace root to the end of node ``i``."""
        store, n = self.store, 0
        while i >= 0:
            n += len(store.keys[i])
            i = store.parent[i]
        return n

    def can_extend(self, i: int, key: bytes) -> bool:
        """Whether ``key``'s blocks may extend node ``i`` in place: a non-root leaf locked exactly
        once (by the caller) and never retained, under ``EXTEND_LIMIT`` blocks, whose tail (if any)
        ``key`` covers."""
        store = self.store
        if (store.parent[i] < 0 or store.kids[i] is not None or store.own_locks[i] != 1
                or store.lock_ref[i] != 1 or store.until[i] != 0.0
                or len(store.blocks[i]) >= 4 * EXTEND_LIMIT):
            return False
        tail = store.tail[i]
        return tail < 0 or key.startswith(store.keys[tail])

    def extend(self, i: int, key: bytes, blocks: array) -> None:
        """Append ``key`` and ``blocks`` (held by the caller, not by the tree) to node ``i``, which
        ``can_extend``; a tail the new tokens cover is dropped. The node is pinned: so are they."""
        store = self.store
        if store.tail[i] >= 0:
            self.drop_tail(i)
        before, added = store.blocks[i], blocks.tobytes()
        store.keys[i] += key
        store.blocks[i] = before + added
        if self.events is not None:
            self.events.extended(self, before, key, added)
        self.allocator.retain_checked(blocks, distinct=True)
        self.mark(blocks, 1)
        self.cached += len(blocks)
        self.pinned += len(blocks)

    def keep_tail(self, node: int, rest: bytes, block: array) -> int:
        """Make ``block`` (holding the tokens ``rest``) the tail of ``node`` unless the tail there or
        a whole-block child already covers them; a different or shorter tail is replaced.

        Returns the tail that now holds ``rest`` (the new one, or the one there that covers it),
        for the caller to ``touch``; -1 where a child covers it (only the child's first block holds
        those tokens, so refreshing the child would refresh blocks the insert never used)."""
        store = self.store
        old = store.tail[node]
        if old >= 0 and store.keys[old].startswith(rest):
            return old
        kids = store.kids[node]
        if kids is not None and any(store.keys[c].startswith(rest) for c in kids.values()):
            return -1
        if old >= 0:
            self.drop_tail(node)
        self.recency.discard(node)
        tail = store.tail[node] = store.new(node, rest, block.tobytes(), store.access[node])
        self.allocator.retain_checked(block)
        self.in_tree[block[0]] = 1
        self.cached += 1
        self.tails += 1
        return tail

    # ----------------------------------------------------------------- shrinking
    def drop_tail(self, node: int) -> None:
        """Release ``node``'s tail (the caller re-files ``node`` for eviction if needed)."""
        store = self.store
        tail = store.tail[node]
        self.recency.discard(tail)
        store.tail[node] = -1
        block = array("I", store.blocks[tail])
        self.allocator.release(block)
        self.in_tree[block[0]] = 0
        self.cached -= 1
        self.tails -= 1
        store.free(tail)

    def remove_leaf(self, i: int) -> None:
        """Unlink leaf ``i`` (its blocks already released); a parent left on a retained path inherits
        the retention, and becomes evictable if it is a leaf now."""
        store = self.store
        parent = store.parent[i]
        if store.tail[parent] == i:
            store.tail[parent] = -1
        else:
            siblings = store.kids[parent]
            del siblings[store.keys[i][:self.bs4]]
            if not siblings:
                store.kids[parent] = None
        until = store.until[i]
        store.free(i)
        if store.parent[parent] < 0:
            self.drop_idle_root(parent)
            return
        if until > store.until[parent]:
            store.until[parent] = until
        if self.is_evictable_leaf(parent):
            self.recency.add(parent)

    def evict(self, num_blocks: int, now) -> int:
        """Drop the tree's reference on up to ``num_blocks`` blocks in eviction order (see
        ``radixcache.recency``), a leaf's deepest blocks first; returns how many were dropped.
        ``now`` is called for the time only when some leaf is retained."""
        store, recency, bs4 = self.store, self.recency, self.bs4
        if recency.retained:
            recency.expire(now())
        dropped = 0
        gone = bytearray()
        while dropped < num_blocks:
            i = recency.pop()
            if i is None:
                break
            blocks = store.blocks[i]
            keep = max(0, (len(blocks) >> 2) - (num_blocks - dropped))
            gone += blocks[4 * keep:]
            dropped += (len(blocks) >> 2) - keep
            if keep:
                store.blocks[i] = blocks[:4 * keep]
                store.keys[i] = store.keys[i][:keep * bs4]
                recency.add(i)
            else:
                if len(store.keys[i]) < bs4:
                    self.tails -= 1
                self.remove_leaf(i)
        if gone:
            ids = array("I", gone)
            self.allocator.release(ids)
            self.mark(ids, 0)
            self.cached -= dropped
            if self.events is not None:
                self.events.removed(self, bytes(gone))  # tails among them were never announced
        return dropped

    # ----------------------------------------------------------------- pins
    def pin(self, i: int) -> None:
        """One more lock on ``i``: +1 on the path count of ``i`` and every ancestor."""
        store = self.store
        self.recency.discard(i)
        store.own_locks[i] += 1
        lock_ref, parent, blocks = store.lock_ref, store.parent, store.blocks
        while i >= 0:
            if lock_ref[i] == 0 and parent[i] >= 0:
                self.pinned += len(blocks[i]) >> 2
            lock_ref[i] += 1
            i = parent[i]

    def unpin(self, i: int) -> None:
        """Undo one ``pin(i)`` (the caller checked ``own_locks[i] > 0``)."""
        store = self.store
        store.own_locks[i] -= 1
        lock_ref, parent, blocks = store.lock_ref, store.parent, store.blocks
        leaf = i
        while i >= 0:
            lock_ref[i] -= 1
            if lock_ref[i] == 0 and parent[i] >= 0:
                self.pinned -= len(blocks[i]) >> 2
            i = parent[i]
        if self.is_evictable_leaf(leaf):
            self.recency.add(leaf)
