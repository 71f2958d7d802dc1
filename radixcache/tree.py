"""RadixCache: a block-aligned radix tree over token ids that owns reference-counted KV blocks.

Every non-root node holds a run of whole blocks: ``key`` is the tokens they cover (a multiple of
``block_size`` long) and ``blocks`` their ids, one per ``block_size`` tokens. A child is found by
the tuple of its first ``block_size`` tokens. A node may also keep one *partial tail*: a leaf with
fewer than ``block_size`` tokens in one block (the end of a finished sequence), kept in ``tail``
rather than among the children; it is never locked and is evicted like any leaf. The tree holds
one reference on each block it holds; callers hold their own. Unpinned leaves sit in a SortedList
ordered by recency, so eviction pops the least recently used leaf in O(log n) and never scans the
tree.
"""

from __future__ import annotations

import itertools
import operator
import weakref
from array import array
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from sortedcontainers import SortedList

from radixcache.blocks import BlockAllocator
from radixcache.errors import CacheError

Namespace = tuple
TAIL_SCAN = 32  # children scanned for a partially matching first block (more: only the tail is tried)

# Every RadixCache alive in the process; the test suite's leak check walks it.
LIVE_CACHES: weakref.WeakSet = weakref.WeakSet()


class Node:
    """One run of whole blocks in the tree. Opaque to callers: pass it to ``lock``/``unlock``.

    A handle stays meaningful while the node is locked; an unlocked node may be split (the handle
    keeps the deeper part, so it still ends at the same depth), truncated or evicted.
    """

    __slots__ = ("parent", "children", "tail", "key", "blocks", "lock_ref", "own_locks",
                 "last_access", "serial", "namespace", "alive", "owner")

    def __init__(self, parent: Node | None, key: tuple, blocks: tuple, namespace: Namespace,
                 serial: int, owner: RadixCache | None = None):
        self.owner = owner if parent is None else parent.owner
        self.parent = parent
        self.children: dict[tuple, Node] = {}
        self.tail: Node | None = None  # a partial last block below this node (fewer than bs tokens)
        self.key = key
        self.blocks = blocks
        self.lock_ref = 0  # locks on this node or below it (the path count)
        self.own_locks = 0  # lock() calls on exactly this node
        self.last_access = 0
        self.serial = serial
        self.namespace = namespace
        self.alive = True

    @property
    def depth_tokens(self) -> int:
        """Number of tokens from the namespace root to the end of this node."""
        n, node = 0, self
        while node is not None:
            n += len(node.key)
            node = node.parent
        return n

    def __repr__(self) -> str:
        return (f"Node(tokens={len(self.key)}, blocks={len(self.blocks)}, lock_ref={self.lock_ref}, "
                f"children={len(self.children)})")


class Match(NamedTuple):
    """Result of ``RadixCache.match``.

    ``length`` tokens (a multiple of block_size) are cached in ``blocks`` (in order); ``node`` is the
    deepest matched node (the namespace root when nothing matched), ready to ``lock``.

    After those tokens, the next ``tail_length`` tokens of the query (``0 <= tail_length <
    block_size``) are cached in positions ``0 .. tail_length-1`` of block ``tail_block`` (a partial
    tail kept at a leaf, or the first block of a child that diverges inside it). The tree keeps its
    reference: a caller that wants those tokens retains the block at once, copies it into a block
    of its own (copy on write) and never writes into ``tail_block``.
    """

    length: int
    blocks: tuple
    node: Node
    tail_length: int = 0
    tail_block: int | None = None


class Adopted(NamedTuple):
    """Result of ``RadixCache.adopt``: ``cached`` leading tokens were in the tree already; ``node``
    ends at the last whole block of the inserted tokens (ready to ``lock``); ``blocks`` are the
    tree's ids for every whole block of them (where they differ from the caller's, the caller holds
    a duplicate and may swap it for the tree's)."""

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


def as_token_tuple(tokens: Sequence[int]) -> tuple:
    """Validate ``tokens`` (non-negative ints; a list, tuple, array, numpy array or 1-D tensor) and
    return them as a tuple of ints. Raises ``TypeError`` for non-integers, ``ValueError`` for negatives."""
    if type(tokens) is list or type(tokens) is tuple:
        try:
            array("Q", tokens)  # C-speed check: every item an int in 0 .. 2**64-1
            return tuple(tokens)
        except (TypeError, OverflowError):
            pass  # fall through for the precise error
    if hasattr(tokens, "tolist") and not isinstance(tokens, array):
        if getattr(tokens, "ndim", 1) != 1:
            raise ValueError(f"tokens must be one-dimensional, got shape {tuple(tokens.shape)}")
        dtype = str(getattr(tokens, "dtype", ""))
        if "float" in dtype or "complex" in dtype or "bool" in dtype:
            raise TypeError(f"tokens must be integers, got dtype {dtype}")
        tokens = tokens.tolist()
    if isinstance(tokens, (str, bytes)):
        raise TypeError("tokens must be a sequence of ints, got a string")
    try:
        packed = array("q", tokens)
    except (TypeError, OverflowError) as e:
        bad = next((t for t in tokens if isinstance(t, bool) or not hasattr(t, "__index__")), None)
        raise TypeError(f"tokens must be ints, got {bad!r} ({e})") from None
    if packed and min(packed) < 0:
        raise ValueError(f"tokens must be non-negative, got {min(packed)}")
    return tuple(packed)


def _below(node: Node) -> list:
    """``node``'s children and its tail."""
    below = list(node.children.values())
    if node.tail is not None:
        below.append(node.tail)
    return below


def _common_prefix(a: tuple, b: tuple) -> int:
    """Length of the common prefix of two short tuples."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _check_namespace(namespace: Namespace) -> Namespace:
    if not isinstance(namespace, tuple):
        raise TypeError(f"namespace must be a tuple, got {type(namespace).__name__}")
    try:
        hash(namespace)
    except TypeError:
        raise TypeError("namespace must be hashable") from None
    return namespace


class RadixCache:
    """Token-keyed, block-aligned radix tree with reference-counted blocks and LRU leaf eviction.

    Only whole blocks are cached: L tokens cover ``L // block_size`` blocks, the tail is ignored.
    ``namespace`` tuples partition the tree completely: no node or block is shared between them.
    See DESIGN.md for the contracts of each method; ``check()`` verifies the invariants.
    """

    def __init__(self, allocator: BlockAllocator, block_size: int = 16):
        if not isinstance(allocator, BlockAllocator):
            raise TypeError("allocator must be a BlockAllocator")
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.allocator = allocator
        self.block_size = block_size
        self.stats = CacheStats()
        self._roots: dict[Hashable, Node] = {}
        self._serials = itertools.count()
        self._clock = itertools.count(1)
        self._lru = SortedList()  # (last_access, serial, node) of every unpinned non-root leaf
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
        """Exactly how many blocks ``evict`` could drop right now."""
        return self._cached_blocks - self._pinned_blocks

    @property
    def cached_tokens(self) -> int:
        """Tokens covered by the blocks the tree holds."""
        return self._cached_blocks * self.block_size

    # ----------------------------------------------------------------- helpers
    def _root(self, namespace: Namespace) -> Node:
        root = self._roots.get(namespace)
        if root is None:
            root = Node(None, (), (), namespace, next(self._serials), owner=self)
            self._roots[namespace] = root
        return root

    def _is_evictable_leaf(self, node: Node) -> bool:
        return (node.parent is not None and not node.children and node.tail is None
                and node.lock_ref == 0)

    def _is_tail(self, node: Node) -> bool:
        return node.parent is not None and len(node.key) < self.block_size

    def _lru_discard(self, node: Node) -> None:
        if self._is_evictable_leaf(node):
            self._lru.discard((node.last_access, node.serial, node))

    def _lru_add(self, node: Node) -> None:
        if self._is_evictable_leaf(node):
            self._lru.add((node.last_access, node.serial, node))

    def _touch(self, node: Node) -> None:
        """Refresh the recency of ``node`` and its ancestors (one clock tick for the whole path)."""
        now = next(self._clock)
        self._lru_discard(node)
        leaf = node
        while node is not None:
            node.last_access = now
            node = node.parent
        self._lru_add(leaf)

    def _matched_blocks(self, key: tuple, tokens: tuple, pos: int) -> int:
        """How many whole blocks of ``key`` equal ``tokens[pos:]`` (the first block is known equal)."""
        n = len(key)
        if tokens[pos:pos + n] == key:
            return n // self.block_size
        bs = self.block_size
        limit = min(n, len(tokens) - pos) // bs * bs
        lo = bs
        while lo < limit and key[lo:lo + bs] == tokens[pos + lo:pos + lo + bs]:
            lo += bs
        return lo // bs

    def _split(self, node: Node, nblocks: int) -> Node:
        """Split ``node`` after its first ``nblocks`` blocks; return the new upper node.

        The original object keeps the lower part, so handles keep pointing at the same depth.
        """
        cut = nblocks * self.block_size
        upper = Node(node.parent, node.key[:cut], node.blocks[:nblocks], node.namespace,
                     next(self._serials))
        upper.lock_ref = node.lock_ref
        upper.last_access = node.last_access
        upper.parent.children[node.key[:self.block_size]] = upper
        node.key = node.key[cut:]
        node.blocks = node.blocks[nblocks:]
        node.parent = upper
        upper.children[node.key[:self.block_size]] = node
        return upper

    def _walk(self, tokens: tuple, namespace: Namespace) -> tuple[Node, int, list]:
        """Follow ``tokens`` from the namespace root, splitting a node where the match ends inside it.
        Returns (deepest matched node, matched token count, matched blocks)."""
        bs = self.block_size
        node = self._root(namespace)
        pos = 0
        blocks: list = []
        end = len(tokens) // bs * bs
        while pos < end:
            child = node.children.get(tokens[pos:pos + bs])
            if child is None:
                break
            k = self._matched_blocks(child.key, tokens, pos)
            if k < len(child.blocks):
                child = self._split(child, k)
            blocks.extend(child.blocks)
            pos += len(child.key)
            node = child
        return node, pos, blocks

    # ----------------------------------------------------------------- public API
    def match(self, tokens: Sequence[int], namespace: Namespace = ()) -> Match:
        """Longest cached block-aligned prefix of ``tokens`` in ``namespace``.

        Never changes reference counts; refreshes the recency of the matched path and counts the
        query in ``stats``. Callers that must compute at least one token pass ``tokens[:-1]``.
        """
        tokens = as_token_tuple(tokens)
        namespace = _check_namespace(namespace)
        node, length, blocks = self._walk(tokens, namespace)
        tail_length, tail_node = self._best_tail(node, tokens[length:length + self.block_size - 1])
        if tail_node is not None:
            self._touch(tail_node)
        elif node.parent is not None:
            self._touch(node)
        self.stats.queried_tokens += len(tokens)
        self.stats.hit_tokens += length
        if tail_node is None:
            return Match(length, tuple(blocks), node)
        return Match(length, tuple(blocks), node, tail_length, tail_node.blocks[0])

    def _best_tail(self, node: Node, rest: tuple) -> tuple[int, Node | None]:
        """The longest run (>= 1 token) of ``rest`` (fewer than block_size tokens) that the first
        block of ``node``'s tail or of one of its children holds: (tokens, that node)."""
        if not rest:
            return 0, None
        best, found = 0, None
        candidates = [node.tail] if node.tail is not None else []
        if len(node.children) <= TAIL_SCAN:
            candidates.extend(node.children.values())
        for cand in candidates:
            n = _common_prefix(cand.key, rest)
            if n > best:
                best, found = n, cand
        return best, found

    def peek(self, tokens: Sequence[int], namespace: Namespace = ()) -> int:
        """Length of the longest cached block-aligned prefix of ``tokens``, with no side effect at all
        (no split, no recency refresh, no stats): for schedulers that rank waiting requests."""
        tokens = as_token_tuple(tokens)
        bs = self.block_size
        node = self._roots.get(_check_namespace(namespace))
        pos, end = 0, len(tokens) // bs * bs
        while node is not None and pos < end:
            child = node.children.get(tokens[pos:pos + bs])
            if child is None:
                break
            k = self._matched_blocks(child.key, tokens, pos)
            pos += k * bs
            node = child if k == len(child.blocks) else None
        return pos

    def insert(self, tokens: Sequence[int], blocks: Sequence[int], namespace: Namespace = (),
               tail_block: int | None = None) -> int:
        """Put the whole blocks of ``tokens`` into the tree; return how many leading tokens were cached.

        ``blocks`` are the caller's blocks for ``tokens`` (``len(tokens) // block_size`` of them).
        The tree retains each block it adopts for a new node and keeps its own block where the content
        was already cached. The caller's own references are untouched: it always releases what it holds.
        With ``tail_block`` (a block the caller holds with the K/V of the last ``len(tokens) %
        block_size`` tokens, which must be > 0) those tokens are kept as the partial tail of the node
        ending at the last whole block, unless the tail there already covers them; a different or
        shorter tail is replaced, and no tail is kept where a whole-block child covers it.
        All arguments are checked before anything changes.
        """
        return self.adopt(tokens, blocks, namespace, tail_block).cached

    def adopt(self, tokens: Sequence[int], blocks: Sequence[int], namespace: Namespace = (),
              tail_block: int | None = None) -> Adopted:
        """``insert``, also returning the node that ends at the last whole block of ``tokens`` (the
        namespace root when there is none) and the tree's block ids for every whole block, in one walk."""
        tokens = as_token_tuple(tokens)
        namespace = _check_namespace(namespace)
        bs = self.block_size
        nblocks = len(tokens) // bs
        try:
            blocks = tuple(operator.index(b) for b in blocks)
            if tail_block is not None:
                tail_block = operator.index(tail_block)
        except TypeError:
            raise TypeError("blocks and tail_block must be int block ids") from None
        if len(blocks) != nblocks:
            raise ValueError(f"insert: {len(tokens)} tokens cover {nblocks} whole blocks of "
                             f"{bs}, got {len(blocks)} block ids")
        if tail_block is not None and len(tokens) % bs == 0:
            raise ValueError(f"insert: a tail_block needs a partial last block, but {len(tokens)} "
                             f"tokens are whole blocks of {bs}")
        every = blocks if tail_block is None else blocks + (tail_block,)
        if len(set(every)) != len(every):
            raise CacheError("insert: the same block id appears twice")
        self.allocator.check_held(every, "insert")
        if tail_block is not None and self._in_tree[tail_block]:
            raise CacheError(f"insert: tail block {tail_block} already belongs to the tree")
        whole = tokens[:nblocks * bs]
        node, cached, path_blocks = self._walk(whole, namespace)
        first_new = cached // bs
        adopted = blocks[first_new:]
        owned = [b for b in adopted if self._in_tree[b]]
        if owned:
            raise CacheError(f"insert: blocks {owned} already belong to the tree at other positions")
        if adopted:
            self._lru_discard(node)
            if node.tail is not None and _common_prefix(node.tail.key, whole[cached:]) == len(node.tail.key):
                self._drop_tail(node)  # the new whole block covers it
            child = Node(node, whole[cached:], adopted, namespace, next(self._serials))
            node.children[whole[cached:cached + bs]] = child
            self.allocator.retain_checked(adopted)
            for b in adopted:
                self._in_tree[b] = 1
            self._cached_blocks += len(adopted)
            self.stats.inserted_tokens += len(adopted) * bs
            node = child
        if tail_block is not None:
            self._keep_tail(node, tokens[nblocks * bs:], tail_block)
        if node.parent is not None:
            self._touch(node)
        return Adopted(cached, node, tuple(path_blocks) + adopted)

    def _keep_tail(self, node: Node, tokens: tuple, block: int) -> None:
        """Make ``block`` (holding ``tokens``) the tail of ``node`` unless something covers it."""
        old = node.tail
        cover = old if old is not None and _common_prefix(old.key, tokens) == len(tokens) else next(
            (c for c in node.children.values() if _common_prefix(c.key, tokens) == len(tokens)), None)
        if cover is not None:  # the tail there, or a whole-block child, already holds these tokens
            self._touch(cover)
            return
        if old is not None:
            self._drop_tail(node)
        self._lru_discard(node)
        tail = Node(node, tokens, (block,), node.namespace, next(self._serials))
        tail.last_access = node.last_access
        node.tail = tail
        self.allocator.retain_checked((block,))
        self._in_tree[block] = 1
        self._cached_blocks += 1
        self._lru_add(tail)
        self._touch(tail)

    def _drop_tail(self, node: Node) -> None:
        """Release ``node``'s tail (the caller re-files ``node`` in the LRU list if needed)."""
        tail = node.tail
        self._lru_discard(tail)
        node.tail = None
        tail.alive = False
        tail.parent = None
        self.allocator.release(tail.blocks)
        self._in_tree[tail.blocks[0]] = 0
        self._cached_blocks -= 1

    def lock(self, node: Node) -> None:
        """Pin the path from the namespace root to ``node``: none of it is evicted until ``unlock``.
        Locks nest."""
        self._check_node(node, "lock")
        self._lru_discard(node)
        node.own_locks += 1
        while node is not None:
            if node.lock_ref == 0 and node.parent is not None:
                self._pinned_blocks += len(node.blocks)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        """Undo one ``lock(node)``. Raises ``CacheError`` if ``node`` is not locked."""
        self._check_node(node, "unlock")
        if node.own_locks <= 0:
            raise CacheError("unlock: node is not locked (lock() was not called on it)")
        node.own_locks -= 1
        leaf = node
        while node is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0 and node.parent is not None:
                self._pinned_blocks -= len(node.blocks)
            node = node.parent
        self._lru_add(leaf)

    def _check_node(self, node: Node, what: str) -> None:
        if not isinstance(node, Node):
            raise TypeError(f"{what}: expected a node from match(), got {type(node).__name__}")
        if node.owner is not self:
            raise CacheError(f"{what}: node belongs to another RadixCache")
        if not node.alive:
            raise CacheError(f"{what}: node was evicted; lock the node a match returns right away")
        if self._is_tail(node):
            raise CacheError(f"{what}: a partial tail is never locked; copy its block instead")

    def evict(self, num_blocks: int) -> int:
        """Drop the tree's reference on up to ``num_blocks`` blocks (never more), taken from unpinned
        leaves, least recently used first, a leaf's deepest blocks first. Returns how many were dropped."""
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 0:
            raise ValueError(f"num_blocks must be a non-negative int, got {num_blocks!r}")
        dropped = 0
        while dropped < num_blocks and self._lru:
            _, _, leaf = self._lru.pop(0)
            take = min(num_blocks - dropped, len(leaf.blocks))
            keep = len(leaf.blocks) - take
            gone = leaf.blocks[keep:]
            self.allocator.release(gone)
            for b in gone:
                self._in_tree[b] = 0
            dropped += take
            self._cached_blocks -= take
            if keep:
                leaf.blocks = leaf.blocks[:keep]
                leaf.key = leaf.key[:keep * self.block_size]
                self._lru_add(leaf)
            else:
                self._remove_leaf(leaf)
        self.stats.evicted_blocks += dropped
        return dropped

    def _remove_leaf(self, leaf: Node) -> None:
        parent = leaf.parent
        if parent.tail is leaf:
            parent.tail = None
        else:
            del parent.children[leaf.key[:self.block_size]]
        leaf.alive = False
        leaf.parent = None
        if parent.parent is None:
            if not parent.children and parent.tail is None and parent.lock_ref == 0:
                self._roots.pop(parent.namespace, None)
                parent.alive = False
        else:
            self._lru_add(parent)

    def reset(self) -> None:
        """Drop every unpinned node (pinned paths stay) and release the tree's references on them."""
        self.evict(self.evictable_blocks)
        for namespace, root in list(self._roots.items()):
            if not root.children and root.tail is None and root.lock_ref == 0:
                root.alive = False
                del self._roots[namespace]

    # ----------------------------------------------------------------- introspection
    def nodes(self):
        """Yield every non-root node, partial tails included (depth first, parents before children)."""
        stack = [c for r in self._roots.values() for c in _below(r)]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(_below(node))

    def check(self) -> None:
        """Verify the tree's structural invariants; raise ``AssertionError`` naming what is wrong."""
        bs = self.block_size
        seen: set = set()
        cached = pinned = 0
        evictable_leaves = set()
        for ns, root in self._roots.items():
            assert root.parent is None and root.alive and root.namespace == ns, "bad namespace root"
            assert root.lock_ref == root.own_locks + sum(c.lock_ref for c in root.children.values()), \
                "root lock count is not own locks + children's"
        for node in self.nodes():
            assert node.alive, f"dead node {node} still linked"
            if self._is_tail(node):
                assert node.parent.tail is node and len(node.blocks) == 1, f"{node}: bad tail"
                assert not node.children and node.tail is None and node.lock_ref == 0 == \
                    node.own_locks, f"{node}: a tail has no children and is never locked"
                assert not any(_common_prefix(c.key, node.key) == len(node.key)
                               for c in node.parent.children.values()), f"{node}: covered tail kept"
            else:
                assert len(node.key) == len(node.blocks) * bs > 0, f"{node}: key/blocks length mismatch"
                assert node.parent.children.get(node.key[:bs]) is node, f"{node}: wrong child key"
            assert node.namespace == node.parent.namespace, f"{node}: crosses namespaces"
            assert node.lock_ref == node.own_locks + sum(c.lock_ref for c in node.children.values()), \
                f"{node}: path lock count is not own locks + children's"
            assert node.last_access >= max((c.last_access for c in _below(node)),
                                           default=0), f"{node}: older than a child"
            for b in node.blocks:
                assert b not in seen, f"block {b} held by two nodes"
                seen.add(b)
                assert self.allocator.refcount(b) >= 1, f"tree block {b} is free"
                assert self._in_tree[b], f"block {b} not marked as in the tree"
            cached += len(node.blocks)
            if node.lock_ref:
                pinned += len(node.blocks)
            elif not node.children and node.tail is None:
                evictable_leaves.add(node.serial)
        assert sum(self._in_tree) == len(seen), "in-tree marks disagree with the nodes"
        assert cached == self._cached_blocks, f"cached_blocks {self._cached_blocks} != {cached}"
        assert pinned == self._pinned_blocks, f"pinned_blocks {self._pinned_blocks} != {pinned}"
        lru = [(t, s) for t, s, n in self._lru]
        assert {s for _, s in lru} == evictable_leaves and len(lru) == len(evictable_leaves), \
            "LRU list differs from the set of unpinned leaves"
        for t, s, n in self._lru:
            assert n.last_access == t, "stale LRU entry"

    def leaks(self) -> list[str]:
        """What is still held outside the tree: pinned nodes and blocks with holders besides the tree.

        Empty when every request has finished and released its references (the end-of-test check).
        """
        problems = []
        if self._pinned_blocks or any(r.lock_ref for r in self._roots.values()):
            problems.append(f"{self._pinned_blocks} pinned blocks / locked roots remain")
        alloc = self.allocator
        for b in range(alloc.num_blocks):
            count = alloc.refcount(b)
            expected = 1 if self._in_tree[b] else 0
            if count != expected:
                problems.append(f"block {b}: refcount {count}, tree holds {expected}")
                if len(problems) > 10:
                    break
        return problems

    def __repr__(self) -> str:
        return (f"RadixCache(block_size={self.block_size}, cached_blocks={self.cached_blocks}, "
                f"pinned_blocks={self.pinned_blocks}, namespaces={len(self._roots)})")
