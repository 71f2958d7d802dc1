"""The radix tree's state and every structural change to it; ``RadixCache`` validates and calls these.

State: the nodes (``radixcache.tree.nodes.NodeTable``), the eviction order (``radixcache.tree.recency``),
the namespace roots, the in-tree marks (one byte per pool block: 1 where the tree holds a
reference), the cached, pinned and partial-tail block counts, and ``events``: None, or the
``radixcache.kv_events.BlockEventLog`` told of every whole block that enters (``add_child`` and
``extend``, the only ways one does) or leaves (``radixcache.tree.eviction.evict_lru``, the only way one
does) the tree. A node's partial tail is kept by ``radixcache.tree.tails`` and dropped by
``drop_tail``.

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
from radixcache.tree.nodes import NodeTable
from radixcache.tree.recency import Recency
from radixcache.tokens import common_blocks, common_tokens

TAIL_SCAN = 32  # children scanned for a partially matching first block (more: only the tail is tried)
EXTEND_LIMIT = 256  # blocks a node may reach by extension in place (each extension copies the node's bytes)
_NO_BLOCKS = b""


class TreeBody:
    """Nodes, eviction order, roots, marks and counts of one tree (see the module docstring)."""

    def __init__(self, allocator: BlockAllocator, block_size: int, clock):
        self.allocator = allocator
        self.bs4 = 4 * block_size
        self.nodes = NodeTable()
        self.recency = Recency(self.nodes, clock)
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
            root = self.nodes.new(-1, b"", _NO_BLOCKS, 0)
            self.roots[namespace] = root
            self.root_ns[root] = namespace
        return root

    def drop_root(self, root: int) -> None:
        del self.roots[self.root_ns.pop(root)]
        self.nodes.free(root)

    def drop_idle_root(self, root: int) -> None:
        """Forget a namespace root that holds nothing and is not locked."""
        nodes = self.nodes
        if nodes.kids[root] is None and nodes.tail[root] < 0 and nodes.lock_ref[root] == 0:
            self.drop_root(root)

    def is_evictable_leaf(self, i: int) -> bool:
        nodes = self.nodes
        return (nodes.parent[i] >= 0 and nodes.kids[i] is None and nodes.tail[i] < 0
                and nodes.lock_ref[i] == 0)

    def is_tail(self, i: int) -> bool:
        return self.nodes.parent[i] >= 0 and len(self.nodes.keys[i]) < self.bs4

    def below(self, i: int) -> list:
        """Ids of ``i``'s children and its tail."""
        nodes = self.nodes
        below = list((nodes.kids[i] or {}).values())
        if nodes.tail[i] >= 0:
            below.append(nodes.tail[i])
        return below

    # ----------------------------------------------------------------- recency and marks
    def touch(self, i: int) -> None:
        """Refresh the recency of node ``i`` and its ancestors (one tick for the whole path)."""
        tick = next(self.ticks)
        self.recency.discard(i)
        access, parent = self.nodes.access, self.nodes.parent
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
        nodes, bs4 = self.nodes, self.bs4
        cut = k * bs4
        key, blocks, parent = nodes.keys[child], nodes.blocks[child], nodes.parent[child]
        upper = nodes.new(parent, key[:cut], blocks[:4 * k], nodes.access[child])
        nodes.lock_ref[upper] = nodes.lock_ref[child]
        nodes.kids[parent][key[:bs4]] = upper
        nodes.keys[child] = key[cut:]
        nodes.blocks[child] = blocks[4 * k:]
        nodes.parent[child] = upper
        nodes.kids[upper] = {key[cut:cut + bs4]: child}
        return upper

    def walk(self, q: bytes, root: int, split: bool) -> tuple[int, int, bytearray]:
        """Follow the whole blocks of ``q`` from ``root``. With ``split``, a node where the match ends
        inside it is split there. Returns (deepest matched node, matched bytes, matched block ids
        packed as uint32)."""
        nodes, bs4 = self.nodes, self.bs4
        kids, keys, blocks_of = nodes.kids, nodes.keys, nodes.blocks
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
        nodes = self.nodes
        keys, tail = nodes.keys, nodes.tail[node]
        best, found = 0, -1
        if tail >= 0:
            best = common_tokens(keys[tail], rest)
            found = tail if best else -1
        children = nodes.kids[node]
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
        nodes = self.nodes
        old = nodes.tail[node]
        if old >= 0 and key.startswith(nodes.keys[old]):
            self.drop_tail(node)
        self.recency.discard(node)
        child = nodes.new(node, key, blocks.tobytes(), 0)
        if nodes.kids[node] is None:
            nodes.kids[node] = {}
        nodes.kids[node][key[:self.bs4]] = child
        self.allocator.retain_checked(blocks, distinct=True)
        self.mark(blocks, 1)
        self.cached += len(blocks)
        if self.events is not None:
            self.events.stored(self, node, child)
        return child

    def drop_tail(self, node: int) -> None:
        """Release ``node``'s tail (the caller re-files ``node`` for eviction if needed)."""
        nodes = self.nodes
        tail = nodes.tail[node]
        self.recency.discard(tail)
        nodes.tail[node] = -1
        block = array("I", nodes.blocks[tail])
        self.allocator.release(block)
        self.in_tree[block[0]] = 0
        self.cached -= 1
        self.tails -= 1
        nodes.free(tail)

    def depth(self, i: int) -> int:
        """Bytes of tokens from the namespace root to the end of node ``i``."""
        nodes, n = self.nodes, 0
        while i >= 0:
            n += len(nodes.keys[i])
            i = nodes.parent[i]
        return n

    def can_extend(self, i: int, key: bytes) -> bool:
        """Whether ``key``'s blocks may extend node ``i`` in place: a non-root leaf locked exactly
        once (by the caller) and never retained, under ``EXTEND_LIMIT`` blocks, whose tail (if any)
        ``key`` covers."""
        nodes = self.nodes
        if (nodes.parent[i] < 0 or nodes.kids[i] is not None or nodes.own_locks[i] != 1
                or nodes.lock_ref[i] != 1 or nodes.until[i] != 0.0
                or len(nodes.blocks[i]) >= 4 * EXTEND_LIMIT):
            return False
        tail = nodes.tail[i]
        return tail < 0 or key.startswith(nodes.keys[tail])

    def extend(self, i: int, key: bytes, blocks: array) -> None:
        """Append ``key`` and ``blocks`` (held by the caller, not by the tree) to node ``i``, which
        ``can_extend``; a tail the new tokens cover is dropped. The node is pinned: so are they."""
        nodes = self.nodes
        if nodes.tail[i] >= 0:
            self.drop_tail(i)
        before, added = nodes.blocks[i], blocks.tobytes()
        nodes.keys[i] += key
        nodes.blocks[i] = before + added
        if self.events is not None:
            self.events.extended(self, before, key, added)
        self.allocator.retain_checked(blocks, distinct=True)
        self.mark(blocks, 1)
        self.cached += len(blocks)
        self.pinned += len(blocks)

    # ----------------------------------------------------------------- pins
    def pin(self, i: int) -> None:
        """One more lock on ``i``: +1 on the path count of ``i`` and every ancestor."""
        nodes = self.nodes
        self.recency.discard(i)
        nodes.own_locks[i] += 1
        lock_ref, parent, blocks = nodes.lock_ref, nodes.parent, nodes.blocks
        while i >= 0:
            if lock_ref[i] == 0 and parent[i] >= 0:
                self.pinned += len(blocks[i]) >> 2
            lock_ref[i] += 1
            i = parent[i]

    def unpin(self, i: int) -> None:
        """Undo one ``pin(i)`` (the caller checked ``own_locks[i] > 0``)."""
        nodes = self.nodes
        nodes.own_locks[i] -= 1
        lock_ref, parent, blocks = nodes.lock_ref, nodes.parent, nodes.blocks
        leaf = i
        while i >= 0:
            lock_ref[i] -= 1
            if lock_ref[i] == 0 and parent[i] >= 0:
                self.pinned -= len(blocks[i]) >> 2
            i = parent[i]
        if self.is_evictable_leaf(leaf):
            self.recency.add(leaf)
