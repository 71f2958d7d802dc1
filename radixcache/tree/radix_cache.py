"""RadixCache: a block-aligned radix tree over token ids that owns reference-counted KV blocks.

Every non-root node holds a run of whole blocks: its tokens (a multiple of ``block_size``) and their
block ids, one per ``block_size`` tokens. A node may also keep one *partial tail*: fewer than
``block_size`` tokens in one block (the end of a finished sequence), reused copy-on-write by the
next match, never locked, evicted like any leaf. Nodes live in a struct of arrays (``radixcache.tree.body``):
tokens are packed uint32 bytes compared with one ``memcmp`` per node, children are found by the
packed bytes of their first block, and nothing the cyclic garbage collector walks grows with nodes,
blocks or tokens. The tree holds one reference on each block it holds; callers hold their own.
Evictable leaves are kept in eviction order by ``radixcache.tree.eviction`` (block-level LRU, with soft
retention as a second tier; ``RadixCache.evict`` states the rule), so eviction never scans the
tree. Calls over many block ids check them with numpy.

Every method checks its arguments before it changes anything (the checks sit beside the methods
they guard): ``TypeError`` for a wrong type, ``ValueError`` for a bad value, ``CacheError`` for a
node that does not fit the tree's state. Results are ``Match`` (``match``), ``Adopted``
(``adopt``) and ``CacheStats`` (the token counters).
"""

from __future__ import annotations

import math
import time
import weakref
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from radixcache.blocks import BlockAllocator, as_block_ids
from radixcache.errors import CacheError
from radixcache.tokens import token_bytes, unpack
from radixcache.tree.body import (ChangeLog, HandleTable, Node, TreeBody, check_tree, held_outside,
                                  insert_below)
from radixcache.tree.events import attach_event_log, muted_then_resynced
from radixcache.tree.eviction import evict_lru


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


Namespace = tuple

# Every RadixCache alive in the process; the test suite's leak check walks it.
LIVE_CACHES: weakref.WeakSet = weakref.WeakSet()


class RadixCache:
    """Token-keyed, block-aligned radix tree with reference-counted blocks and LRU leaf eviction.

    Only whole blocks are cached, plus at most one partial tail per node: L tokens cover
    ``L // block_size`` blocks. ``namespace`` tuples partition the tree completely: no node or block
    is shared between them. ``clock`` (seconds, non-decreasing) is what ``keep`` deadlines are read
    against. Each method's docstring states its contract; ``check()`` verifies the invariants
    (``radixcache.tree.body`` states them). ``changes`` (a ``radixcache.tree.body.ChangeLog``) says
    when the content changed and what was inserted, for callers that cache ``peek`` results.
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
        self.changes = ChangeLog()  # content epochs and recent inserts (for callers caching peeks)
        self.body = TreeBody(allocator, block_size, clock)
        self.node_table = self.body.nodes      # node columns, for introspection (Node handles read it)
        self.recency = self.body.recency  # eviction order, for introspection
        self._handles = HandleTable()
        LIVE_CACHES.add(self)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        del state["_handles"]  # handles belong to this tree's callers; a copy starts with none
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._handles = HandleTable()

    # ----------------------------------------------------------------- sizes
    @property
    def cached_blocks(self) -> int:
        """Blocks the tree holds a reference on (partial tails included)."""
        return self.body.cached

    @property
    def pinned_blocks(self) -> int:
        """Blocks on a locked path (never evicted)."""
        return self.body.pinned

    @property
    def evictable_blocks(self) -> int:
        """Exactly how many blocks ``evict`` could drop right now (retained ones included)."""
        return self.body.cached - self.body.pinned

    @property
    def whole_blocks(self) -> int:
        """Whole blocks the tree holds (partial tails not counted): with KV events on, exactly the
        blocks announced by ``BlockStored`` and not yet by ``BlockRemoved`` since the last
        ``AllBlocksCleared``."""
        return self.body.cached - self.body.tails

    @property
    def cached_tokens(self) -> int:
        """Tokens covered by the blocks the tree holds."""
        return self.body.cached * self.block_size

    # ----------------------------------------------------------------- handles
    def namespace_of_root(self, root: int) -> Namespace:
        """The namespace whose root has id ``root`` (for ``Node.namespace``)."""
        return self.body.root_ns[root]

    def handle_of(self, node_id: int) -> Node:
        """The handle on the live node ``node_id`` (for ``Node`` introspection)."""
        return self._handles.get(self, node_id, self.node_table.gen[node_id])

    def _node_id(self, node, what: str) -> int:
        """The id of the node ``node`` names, for the verb ``what``: TypeError unless it is a
        ``Node``; CacheError when it belongs to another tree, was evicted, or is a partial tail
        (never locked or retained)."""
        if not isinstance(node, Node):
            raise TypeError(f"{what}: expected a node from match(), got {type(node).__name__}")
        if node.owner is not self:
            raise CacheError(f"{what}: node belongs to another RadixCache")
        if not self.node_table.is_live(node.id, node.gen):
            raise CacheError(f"{what}: node was evicted; lock the node a match returns right away")
        if self.body.is_tail(node.id):
            raise CacheError(f"{what}: a partial tail is never locked or retained; copy its block instead")
        return node.id

    # ----------------------------------------------------------------- queries
    @staticmethod
    def _namespace(namespace) -> tuple:
        """``namespace``, once it is known to be a hashable tuple (TypeError otherwise)."""
        if not isinstance(namespace, tuple):
            raise TypeError(f"namespace must be a tuple, got {type(namespace).__name__}")
        try:
            hash(namespace)
        except TypeError:
            raise TypeError("namespace must be hashable") from None
        return namespace

    def match(self, tokens: Sequence[int], namespace: Namespace = ()) -> Match:
        """Longest cached block-aligned prefix of ``tokens`` in ``namespace``, and the partial tail
        that continues it, if any (see ``Match``).

        Never changes reference counts; counts the query in ``stats`` and refreshes the recency of
        exactly the blocks the match uses (see ``evict``): the matched blocks (a node the match ends
        inside is split there first) and, when ``tail_block`` is a partial tail kept at the matched
        node, that block. A tail taken from the first block of a child is not refreshed, nor is
        anything else of that child: the caller copies it and the tree's next eviction owes it
        nothing. Callers that must compute at least one token pass ``tokens[:-1]``, so the tail
        never covers the last token.
        """
        q = token_bytes(tokens)
        body = self.body
        root = body.root(self._namespace(namespace))
        node, pos, blocks = body.walk(q, root, True)
        tail_length, tail = body.best_tail(node, q[pos:pos + body.bs4 - 4])
        if tail >= 0 and self.node_table.tail[node] == tail:
            body.touch(tail)
        elif node != root:
            body.touch(node)
        self.stats.queried_tokens += len(q) >> 2
        self.stats.hit_tokens += pos >> 2
        blocks = tuple(array("I", blocks))
        if tail < 0:
            return Match(pos >> 2, blocks, self.handle_of(node))
        return Match(pos >> 2, blocks, self.handle_of(node), tail_length, unpack(self.node_table.blocks[tail])[0])

    def peek(self, tokens: Sequence[int], namespace: Namespace = ()) -> int:
        """Length of the longest cached block-aligned prefix of ``tokens``, with no side effect at all
        (no split, no recency refresh, no stats): for schedulers that rank waiting requests."""
        q = token_bytes(tokens)
        root = self.body.roots.get(self._namespace(namespace))
        return 0 if root is None else self.body.walk(q, root, False)[1] >> 2

    # ----------------------------------------------------------------- inserts
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
        return self._adopt(tokens, blocks, namespace, tail_block)[0] >> 2

    def adopt(self, tokens: Sequence[int], blocks: Sequence[int], namespace: Namespace = (),
              tail_block: int | None = None) -> Adopted:
        """``insert``, also returning the node that ends at the last whole block of ``tokens`` (the
        namespace root when there is none), ready to ``lock``, and the tree's block ids for every
        whole block (the caller's where they were adopted, the tree's own where the content was
        cached already: a caller holding a duplicate may swap it for the tree's), in one walk."""
        pos, node, path = self._adopt(tokens, blocks, namespace, tail_block)
        return Adopted(pos >> 2, self.handle_of(node), tuple(array("I", path)))

    def _insert_args(self, tokens, blocks, tail_block, what: str) -> tuple:
        """(packed tokens, block ids, tail id or None, whole blocks) of an insert, checked:
        ``ValueError``/``TypeError`` naming ``what`` for tokens and ids that do not fit together."""
        bs4 = self.body.bs4
        q = token_bytes(tokens)
        nblocks = len(q) // bs4
        ids = as_block_ids(blocks, what)
        tail = None if tail_block is None else as_block_ids((tail_block,), what)
        if len(ids) != nblocks:
            raise ValueError(f"{what}: {len(q) >> 2} tokens cover {nblocks} whole blocks of "
                             f"{bs4 // 4}, got {len(ids)} block ids")
        if tail is not None and len(q) == nblocks * bs4:
            raise ValueError(f"{what}: a tail_block needs a partial last block, but {len(q) >> 2} "
                             f"tokens are whole blocks of {bs4 // 4}")
        return q, ids, tail, nblocks

    def _adopt(self, tokens, blocks, namespace, tail_block) -> tuple[int, int, bytearray]:
        """The insertion; returns (cached bytes, end node id, the tree's packed block ids)."""
        args = self._insert_args(tokens, blocks, tail_block, "insert")
        root = self.body.root(self._namespace(namespace))
        return insert_below(self.body, self.allocator, self.stats, self.changes, root, args, 0, False)

    def adopt_below(self, node: Node, tokens: Sequence[int], blocks: Sequence[int],
                    tail_block: int | None = None) -> Adopted:
        """``adopt`` of the tokens that continue the path ending at ``node``, which the caller has
        locked: ``tokens`` and ``blocks`` are only those after it (the path is not walked or
        compared again), so the call costs what the new tokens do. ``cached`` counts the tokens
        after ``node`` that the tree held already; ``blocks`` are the tree's ids for the whole
        blocks of ``tokens``. When the caller holds the only lock on ``node``, a leaf that was
        never retained and holds fewer than ``EXTEND_LIMIT`` blocks, the new blocks extend
        ``node`` itself rather than a new child (so a sequence committed block by block stays a
        few nodes deep): the returned node is then ``node``, which ends deeper now. ``CacheError``
        for a node that is not locked; every argument is checked before anything changes."""
        start = self._node_id(node, "adopt_below")
        body = self.body
        if self.node_table.lock_ref[start] == 0:
            raise CacheError("adopt_below: lock the node first (an unlocked node may be split or evicted)")
        args = self._insert_args(tokens, blocks, tail_block, "adopt_below")
        pos, end, path = insert_below(body, self.allocator, self.stats, self.changes, start, args,
                                      body.depth(start), True)
        return Adopted(pos >> 2, self.handle_of(end), tuple(array("I", path)))

    # ----------------------------------------------------------------- pins and retention
    def lock(self, node: Node) -> None:
        """Pin the path from the namespace root to ``node``: none of it is evicted until ``unlock``.
        Locks nest. A partial tail is never locked (``CacheError``)."""
        self.body.pin(self._node_id(node, "lock"))

    def unlock(self, node: Node) -> None:
        """Undo one ``lock(node)``. Raises ``CacheError`` if ``node`` is not locked."""
        i = self._node_id(node, "unlock")
        if self.node_table.own_locks[i] == 0:
            raise CacheError("unlock: node is not locked (lock() was not called on it)")
        self.body.unpin(i)

    def keep(self, node: Node, until: float) -> None:
        """Keep the path from the namespace root to ``node`` until ``until`` on the tree's clock: a
        soft hint, separate from locks and never released. While it lasts, the path's blocks are
        evicted only after every block without retention (and before anything is refused for lack of
        blocks); once the clock reaches ``until`` they are exactly as evictable as blocks never
        retained. Retention only ever extends: the latest deadline given for a node holds. A partial
        tail below ``node`` is not covered. Raises ``TypeError``/``ValueError`` for a deadline that is
        not a real number, ``CacheError`` for a node no longer in the tree."""
        i = self._node_id(node, "keep")
        if isinstance(until, bool) or not isinstance(until, (int, float)):
            raise TypeError(f"keep: until must be a number of seconds on the tree's clock, got {until!r}")
        if math.isnan(until):
            raise ValueError("keep: until is NaN")
        self.recency.extend_deadline(i, until)

    # ----------------------------------------------------------------- eviction
    def evict(self, num_blocks: int) -> int:
        """Drop the tree's reference on up to ``num_blocks`` blocks (never more): exactly the
        ``num_blocks`` least recently used unpinned blocks (partial tails included), deepest first
        among blocks last used together; blocks under live retention go only after every other one.
        Returns how many were dropped.

        A block's last use is the latest ``match`` or ``insert``/``adopt`` that used it: every whole
        block a match returns or an insert covers (cached already or adopted), and the partial tail
        a match copies from or an insert keeps (or finds there covering its tokens). Nothing else
        (``peek``, ``lock``, ``unlock``, ``keep``, splits, evictions) changes it. A use always
        covers the path from the namespace root, so a block is never older than the blocks below it
        and the least recently used blocks are always at leaves."""
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 0:
            raise ValueError(f"num_blocks must be a non-negative int, got {num_blocks!r}")
        dropped = evict_lru(self.body, num_blocks, self.clock)
        self.stats.evicted_blocks += dropped
        if dropped:
            self.changes.evicted()
        return dropped

    def reset(self) -> None:
        """Drop every unpinned node (pinned paths stay) and release the tree's references on them.
        KV events announce it as ``AllBlocksCleared``, then ``BlockStored`` for what stays."""
        body = self.body
        with muted_then_resynced(body):
            self.evict(self.evictable_blocks)
            for root in list(body.root_ns):
                body.drop_idle_root(root)

    # ----------------------------------------------------------------- KV events
    def set_event_log(self, log) -> None:
        """Tell ``log`` (a ``radixcache.kv_events.BlockEventLog``, or None to stop) of every whole
        block that enters or leaves the tree from now on. Attaching starts the log with
        ``AllBlocksCleared`` and ``BlockStored`` for every whole block the tree holds already. Call
        it under the lock of whoever changes the tree (``CacheManager.use_events`` does). A log that
        follows another tree or is closed raises ``ValueError``, with nothing changed."""
        attach_event_log(self.body, log)

    def resync_events(self) -> None:
        """Publish ``AllBlocksCleared`` and ``BlockStored`` for every whole block the tree holds (for
        a subscriber that joined late); nothing without an event log."""
        if self.body.events is not None:
            self.body.events.resync(self.body)

    # ----------------------------------------------------------------- introspection
    def path_blocks(self, node: Node) -> tuple:
        """The blocks on the path from the namespace root down to ``node`` (no side effect)."""
        i = self._node_id(node, "path_blocks")
        return tuple(array("I", self.node_table.path_blocks(i)))

    def holds(self, block: int) -> bool:
        """True when the tree holds a reference on ``block`` (a node or a partial tail owns it)."""
        return bool(self.body.in_tree[block])

    def nodes(self):
        """Yield a handle on every non-root node, partial tails included (depth first, parents
        before children). The handles stay alive until the iteration ends, so ``node.parent`` is
        the very handle yielded before (``id`` works as a key while iterating)."""
        body = self.body
        stack = [c for r in body.root_ns for c in body.below(r)]
        yielded = []
        while stack:
            i = stack.pop()
            handle = self.handle_of(i)
            yielded.append(handle)
            yield handle
            stack.extend(body.below(i))

    def check(self) -> None:
        """Verify the tree's structural invariants; raise ``AssertionError`` naming what is wrong."""
        check_tree(self.body, self.block_size)

    def leaks(self) -> list[str]:
        """What is still held outside the tree: pinned nodes and blocks with holders besides the tree.

        Empty when every request has finished and released its references (the end-of-test check).
        """
        return held_outside(self.body, self.allocator)

    def __repr__(self) -> str:
        return (f"RadixCache(block_size={self.block_size}, cached_blocks={self.cached_blocks}, "
                f"pinned_blocks={self.pinned_blocks}, namespaces={len(self.body.roots)})")
