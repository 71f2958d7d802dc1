"""RadixCache: a block-aligned radix tree over token ids that owns reference-counted KV blocks.

Every non-root node holds a run of whole blocks: its tokens (a multiple of ``block_size``) and their
block ids, one per ``block_size`` tokens. Nodes live in a struct of arrays (``radixcache.nodes``):
tokens are packed uint32 bytes compared with one ``memcmp`` per node, children are found by the
packed bytes of their first block, and nothing the cyclic garbage collector walks grows with nodes,
blocks or tokens. The tree holds one reference on each block it holds; callers hold their own.
Evictable leaves are kept in eviction order by ``radixcache.recency`` (LRU, with soft retention as
a second tier), so eviction never scans the tree. Calls over many block ids check them with numpy.
"""

from __future__ import annotations

import itertools
import math
import time
import weakref
from array import array
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from radixcache.blocks import VECTOR_MIN, BlockAllocator, as_block_ids, has_duplicates
from radixcache.errors import CacheError
from radixcache.nodes import Node, NodeStore
from radixcache.recency import Recency
from radixcache.tokens import token_bytes

Namespace = tuple

# Every RadixCache alive in the process; the test suite's leak check walks it.
LIVE_CACHES: weakref.WeakSet = weakref.WeakSet()

_NO_BLOCKS = array("I")


class Match(NamedTuple):
    """Result of ``RadixCache.match``.

    ``length`` tokens (a multiple of block_size) are cached in ``blocks`` (in order); ``node`` is the
    deepest matched node (the namespace root when nothing matched), ready to ``lock``.
    """

    length: int
    blocks: tuple
    node: Node


class Adopted(NamedTuple):
    """Result of ``RadixCache.adopt``: ``cached`` leading tokens were in the tree already; ``node``
    ends at the last whole block of the tokens (ready to ``lock``); ``blocks`` are the tree's block
    ids for every whole block of the tokens."""

    cached: int
    node: Node
    blocks: tuple


@dataclass
class CacheStats:
    """Token-level counters: hit rate = hit_tokens / queried_tokens (comparable to vLLM/SGLang)."""

    queried_tokens: int = 0
    hit_tokens: int = 0
    inserted_tokens: int = 0
    evicted_blocks: int = 0

    @property
    def hit_rate(self) -> float:
        """Fraction of queried tokens that were served from the cache (0.0 before any query)."""
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


def _check_namespace(namespace: Namespace) -> Namespace:
    if not isinstance(namespace, tuple):
        raise TypeError(f"namespace must be a tuple, got {type(namespace).__name__}")
    try:
        hash(namespace)
    except TypeError:
        raise TypeError("namespace must be hashable") from None
    return namespace


def _common_blocks(key: bytes, q: bytes, pos: int, end: int, bs4: int) -> int:
    """How many whole blocks of ``key`` equal ``q[pos:end]`` (the first block is known equal)."""
    m = min(len(key), end - pos) // bs4
    if q[pos:pos + m * bs4] == key[:m * bs4]:
        return m
    lo, hi = 1, m  # blocks [0, lo) are equal; some block in [lo, hi) differs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if q[pos + lo * bs4:pos + mid * bs4] == key[lo * bs4:mid * bs4]:
            lo = mid
        else:
            hi = mid
    return lo


class RadixCache:
    """Token-keyed, block-aligned radix tree with reference-counted blocks and LRU leaf eviction.

    Only whole blocks are cached: L tokens cover ``L // block_size`` blocks, the tail is ignored.
    ``namespace`` tuples partition the tree completely: no node or block is shared between them.
    ``clock`` (seconds, non-decreasing) is what ``retain`` deadlines are read against. See DESIGN.md
    for the contracts of each method; ``check()`` verifies the invariants.
    """

    def __init__(self, allocator: BlockAllocator, block_size: int = 16, *, clock=time.monotonic):
        if not isinstance(allocator, BlockAllocator):
            raise TypeError("allocator must be a BlockAllocator")
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        if not callable(clock):
            raise TypeError("clock must be a callable returning seconds")
        self.allocator = allocator
        self.block_size = block_size
        self.clock = clock
        self.stats = CacheStats()
        self.store = NodeStore()
        self.recency = Recency(self.store, clock)
        self._bs4 = 4 * block_size
        self._roots: dict[Hashable, int] = {}
        self._root_ns: dict[int, Hashable] = {}
        self._ticks = itertools.count(1)
        self._in_tree = bytearray(allocator.num_blocks)
        self._cached_blocks = 0
        self._pinned_blocks = 0
        LIVE_CACHES.add(self)

    # ----------------------------------------------------------------- sizes
    @property
    def cached_blocks(self) -> int:
        """Blocks the tree holds a reference on."""
        return self._cached_blocks

    @property
    def pinned_blocks(self) -> int:
        """Blocks on a locked path (never evicted)."""
        return self._pinned_blocks

    @property
    def evictable_blocks(self) -> int:
        """Exactly how many blocks ``evict`` could drop right now (retained ones included)."""
        return self._cached_blocks - self._pinned_blocks

    @property
    def cached_tokens(self) -> int:
        """Tokens covered by the blocks the tree holds."""
        return self._cached_blocks * self.block_size

    # ----------------------------------------------------------------- helpers
    def _root(self, namespace: Namespace) -> int:
        root = self._roots.get(namespace)
        if root is None:
            root = self.store.new(-1, b"", _NO_BLOCKS, 0)
            self._roots[namespace] = root
            self._root_ns[root] = namespace
        return root

    def namespace_of_root(self, root: int) -> Namespace:
        """The namespace whose root has id ``root`` (for ``Node.namespace``)."""
        return self._root_ns[root]

    def _handle(self, i: int) -> Node:
        return Node(self, i, self.store.gen[i])

    def _node_id(self, node: Node, what: str) -> int:
        if not isinstance(node, Node):
            raise TypeError(f"{what}: expected a node from match(), got {type(node).__name__}")
        if node.owner is not self:
            raise CacheError(f"{what}: node belongs to another RadixCache")
        if not self.store.is_live(node.id, node.gen):
            raise CacheError(f"{what}: node was evicted; lock the node a match returns right away")
        return node.id

    def _is_evictable_leaf(self, i: int) -> bool:
        store = self.store
        return store.parent[i] >= 0 and store.kids[i] is None and store.lock_ref[i] == 0

    def _touch(self, i: int) -> None:
        """Refresh the recency of node ``i`` and its ancestors (one tick for the whole path)."""
        tick = next(self._ticks)
        recency = self.recency
        leaf = i in recency.where
        if leaf:
            recency.discard(i)
        access, parent = self.store.access, self.store.parent
        j = i
        while j >= 0:
            access[j] = tick
            j = parent[j]
        if leaf:
            recency.add(i)

    def _mark(self, ids: array, value: int) -> None:
        marks = self._in_tree
        if len(ids) < VECTOR_MIN:
            for b in ids:
                marks[b] = value
        else:
            np.frombuffer(marks, np.uint8)[np.frombuffer(ids, np.uint32)] = value

    def _marked(self, ids: array) -> list:
        marks = self._in_tree
        if len(ids) < VECTOR_MIN:
            return [b for b in ids if marks[b]]
        v = np.frombuffer(ids, np.uint32)
        return v[np.frombuffer(marks, np.uint8)[v] != 0].tolist()

    def _split(self, child: int, k: int) -> int:
        """Split node ``child`` after its first ``k`` blocks; return the new upper node.

        The original id keeps the lower part, so handles keep pointing at the same depth."""
        store, bs4 = self.store, self._bs4
        cut = k * bs4
        key, blocks, parent = store.keys[child], store.blocks[child], store.parent[child]
        upper = store.new(parent, key[:cut], blocks[:k], store.access[child])
        store.lock_ref[upper] = store.lock_ref[child]
        store.kids[parent][key[:bs4]] = upper
        store.keys[child] = key[cut:]
        store.blocks[child] = blocks[k:]
        store.parent[child] = upper
        store.kids[upper] = {key[cut:cut + bs4]: child}
        return upper

    def _walk(self, q: bytes, root: int, split: bool) -> tuple[int, int, array]:
        """Follow the whole blocks of ``q`` from ``root``. With ``split``, a node where the match ends
        inside it is split there. Returns (deepest matched node, matched bytes, matched blocks)."""
        store, bs4 = self.store, self._bs4
        kids, keys, blocks_of = store.kids, store.keys, store.blocks
        end = len(q) - len(q) % bs4
        node, pos = root, 0
        out = array("I")
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
            k = _common_blocks(key, q, pos, end, bs4)
            if split:
                if k < len(blocks_of[child]):
                    child = self._split(child, k)
                out += blocks_of[child]
                node = child
            else:
                out += blocks_of[child][:k]
            pos += k * bs4
            break
        return node, pos, out

    # ----------------------------------------------------------------- public API
    def match(self, tokens: Sequence[int], namespace: Namespace = ()) -> Match:
        """Longest cached block-aligned prefix of ``tokens`` in ``namespace``.

        Never changes reference counts; refreshes the recency of the matched path and counts the
        query in ``stats``. Callers that must compute at least one token pass ``tokens[:-1]``.
        """
        q = token_bytes(tokens)
        root = self._root(_check_namespace(namespace))
        node, pos, blocks = self._walk(q, root, True)
        if node != root:
            self._touch(node)
        self.stats.queried_tokens += len(q) >> 2
        self.stats.hit_tokens += pos >> 2
        return Match(pos >> 2, tuple(blocks), self._handle(node))

    def peek(self, tokens: Sequence[int], namespace: Namespace = ()) -> int:
        """Length of the longest cached block-aligned prefix of ``tokens``, with no side effect at all
        (no split, no recency refresh, no stats): for schedulers that rank waiting requests."""
        q = token_bytes(tokens)
        root = self._roots.get(_check_namespace(namespace))
        return 0 if root is None else self._walk(q, root, False)[1] >> 2

    def insert(self, tokens: Sequence[int], blocks: Sequence[int], namespace: Namespace = ()) -> int:
        """Put the whole blocks of ``tokens`` into the tree; return how many leading tokens were cached.

        ``blocks`` are the caller's blocks for ``tokens`` (``len(tokens) // block_size`` of them).
        The tree retains each block it adopts for a new node and keeps its own block where the content
        was already cached. The caller's own references are untouched: it always releases what it holds.
        All arguments are checked before anything changes.
        """
        return self.adopt(tokens, blocks, namespace).cached

    def adopt(self, tokens: Sequence[int], blocks: Sequence[int], namespace: Namespace = ()) -> Adopted:
        """The insertion of ``insert``, returning also the node that ends at the last whole block of
        ``tokens`` (the namespace root when there is none), ready to ``lock``, and the tree's block ids
        for every whole block (the caller's where they were adopted, the tree's own where the content
        was cached already: a caller holding a duplicate may swap to the tree's block)."""
        q = token_bytes(tokens)
        namespace = _check_namespace(namespace)
        bs4 = self._bs4
        nblocks = len(q) // bs4
        ids = as_block_ids(blocks, "insert")
        if len(ids) != nblocks:
            raise ValueError(f"insert: {len(q) >> 2} tokens cover {nblocks} whole blocks of "
                             f"{self.block_size}, got {len(ids)} block ids")
        if len(q) != nblocks * bs4:
            q = q[:nblocks * bs4]
        node, pos, path = self._walk(q, self._root(namespace), True)
        adopted = ids[pos // bs4:]
        # Where the caller passes the tree's own blocks for the cached part (as match returned
        # them), those are valid by construction; otherwise every id is checked.
        checked = adopted if ids[:pos // bs4] == path else ids
        if has_duplicates(checked):
            raise CacheError("insert: the same block id appears twice")
        self.allocator.check_held(checked, "insert")
        if adopted:
            owned = self._marked(adopted)
            if owned:
                raise CacheError(f"insert: blocks {owned[:8]} already belong to the tree at other positions")
            store = self.store
            self.recency.discard(node)
            child = store.new(node, q[pos:], adopted, 0)
            if store.kids[node] is None:
                store.kids[node] = {}
            store.kids[node][q[pos:pos + bs4]] = child
            self.allocator.retain_checked(adopted)
            self._mark(adopted, 1)
            self._cached_blocks += len(adopted)
            self.stats.inserted_tokens += len(adopted) * self.block_size
            path += adopted
            self._touch(child)
            self.recency.add(child)
            node = child
        elif self.store.parent[node] >= 0:
            self._touch(node)
        return Adopted(pos >> 2, self._handle(node), tuple(path))

    def lock(self, node: Node) -> None:
        """Pin the path from the namespace root to ``node``: none of it is evicted until ``unlock``.
        Locks nest."""
        i = self._node_id(node, "lock")
        store = self.store
        self.recency.discard(i)
        store.own_locks[i] += 1
        lock_ref, parent, blocks = store.lock_ref, store.parent, store.blocks
        while i >= 0:
            if lock_ref[i] == 0 and parent[i] >= 0:
                self._pinned_blocks += len(blocks[i])
            lock_ref[i] += 1
            i = parent[i]

    def unlock(self, node: Node) -> None:
        """Undo one ``lock(node)``. Raises ``CacheError`` if ``node`` is not locked."""
        i = self._node_id(node, "unlock")
        store = self.store
        if store.own_locks[i] == 0:
            raise CacheError("unlock: node is not locked (lock() was not called on it)")
        store.own_locks[i] -= 1
        lock_ref, parent, blocks = store.lock_ref, store.parent, store.blocks
        leaf = i
        while i >= 0:
            lock_ref[i] -= 1
            if lock_ref[i] == 0 and parent[i] >= 0:
                self._pinned_blocks -= len(blocks[i])
            i = parent[i]
        if self._is_evictable_leaf(leaf):
            self.recency.add(leaf)

    def retain(self, node: Node, until: float) -> None:
        """Keep the path from the namespace root to ``node`` until ``until`` on the tree's clock: a
        soft hint, separate from locks and never released. While it lasts, the path's blocks are
        evicted only after every block without retention (and before ``OutOfBlocks``); once the clock
        passes ``until`` they are exactly as evictable as blocks never retained. Retention only ever
        extends: the latest deadline given for a node holds. Raises ``TypeError``/``ValueError`` for
        a deadline that is not a real number, ``CacheError`` for a node no longer in the tree."""
        i = self._node_id(node, "retain")
        if isinstance(until, bool) or not isinstance(until, (int, float)):
            raise TypeError(f"retain: until must be a number of seconds on the tree's clock, got {until!r}")
        if math.isnan(until):
            raise ValueError("retain: until is NaN")
        store = self.store
        if until > store.until[i]:
            store.until[i] = until
            if i in self.recency:
                self.recency.discard(i)
                self.recency.add(i)

    def evict(self, num_blocks: int) -> int:
        """Drop the tree's reference on up to ``num_blocks`` blocks (never more), taken from unpinned
        leaves, least recently used first, a leaf's deepest blocks first; leaves under retention go
        only after every other one. Returns how many were dropped."""
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 0:
            raise ValueError(f"num_blocks must be a non-negative int, got {num_blocks!r}")
        store, recency, bs4 = self.store, self.recency, self._bs4
        if recency.kept:
            recency.expire(self.clock())
        dropped = 0
        gone = array("I")
        while dropped < num_blocks:
            i = recency.pop()
            if i is None:
                break
            blocks = store.blocks[i]
            keep = max(0, len(blocks) - (num_blocks - dropped))
            gone += blocks[keep:]
            dropped += len(blocks) - keep
            if keep:
                store.blocks[i] = blocks[:keep]
                store.keys[i] = store.keys[i][:keep * bs4]
                recency.add(i)
            else:
                self._remove_leaf(i)
        if gone:
            self.allocator.release(gone)
            self._mark(gone, 0)
            self._cached_blocks -= dropped
        self.stats.evicted_blocks += dropped
        return dropped

    def _remove_leaf(self, i: int) -> None:
        store = self.store
        parent = store.parent[i]
        siblings = store.kids[parent]
        del siblings[store.keys[i][:self._bs4]]
        if not siblings:
            store.kids[parent] = None
        until = store.until[i]
        store.free(i)
        if store.parent[parent] < 0:
            if store.kids[parent] is None and store.lock_ref[parent] == 0:
                self._drop_root(parent)
            return
        if until > store.until[parent]:
            store.until[parent] = until  # the parent is on the retained path: it inherits it
        if self._is_evictable_leaf(parent):
            self.recency.add(parent)

    def _drop_root(self, root: int) -> None:
        del self._roots[self._root_ns.pop(root)]
        self.store.free(root)

    def reset(self) -> None:
        """Drop every unpinned node (pinned paths stay) and release the tree's references on them."""
        self.evict(self.evictable_blocks)
        store = self.store
        for root in list(self._root_ns):
            if store.kids[root] is None and store.lock_ref[root] == 0:
                self._drop_root(root)

    # ----------------------------------------------------------------- introspection
    def nodes(self):
        """Yield a handle on every non-root node (depth first)."""
        kids = self.store.kids
        stack = [c for r in self._root_ns for c in (kids[r] or {}).values()]
        while stack:
            i = stack.pop()
            yield self._handle(i)
            stack.extend((kids[i] or {}).values())

    def check(self) -> None:
        """Verify the tree's structural invariants; raise ``AssertionError`` naming what is wrong."""
        from radixcache.tree_check import check_tree

        check_tree(self, self._roots, self._in_tree, self._cached_blocks, self._pinned_blocks)

    def leaks(self) -> list[str]:
        """What is still held outside the tree: pinned nodes and blocks with holders besides the tree.

        Empty when every request has finished and released its references (the end-of-test check).
        """
        problems = []
        store = self.store
        if self._pinned_blocks or any(store.lock_ref[r] for r in self._root_ns):
            problems.append(f"{self._pinned_blocks} pinned blocks / locked roots remain")
        counts = self.allocator.refcounts()
        marks = np.frombuffer(self._in_tree, np.uint8)
        for b in np.flatnonzero(counts != marks)[:11].tolist():
            problems.append(f"block {b}: refcount {counts[b]}, tree holds {marks[b]}")
        return problems

    def __repr__(self) -> str:
        return (f"RadixCache(block_size={self.block_size}, cached_blocks={self.cached_blocks}, "
                f"pinned_blocks={self.pinned_blocks}, namespaces={len(self._roots)})")
