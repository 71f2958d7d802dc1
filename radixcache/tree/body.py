"""The radix tree's state and every structural change to it; ``RadixCache`` validates and calls these.

Nodes live in one struct of arrays (``NodeTable``), indexed by node id, and callers hold ``Node``
handles on them (``HandleTable``). Layout (why: at millions of cached blocks the tree must be
neither slow nor big, and add nothing a cyclic-GC pass has to walk per node, block or token):

- per node, in flat ``array`` columns: ``parent`` (-1 for a namespace root), ``lock_ref`` (locks
  on the node or below it), ``own_locks`` (``lock`` calls on exactly this node), ``access`` (the
  recency tick), ``until`` (retention deadline on the tree's clock, 0 for none), ``tail`` (the id of
  the node's partial tail, -1 for none) and ``gen`` (bumped when the id is freed, so a stale handle
  is recognised);
- ``keys[i]``: the node's tokens, ``blocks[i]`` its block ids, both packed uint32 ``bytes`` (4 B
  per token, 4 B per block), and ``kids[i]`` its children as a dict from the packed first block of
  the child to the child's id (``None`` for a leaf). None of these is tracked by the collector:
  bytes hold no references (an ``array`` would be tracked), and CPython leaves a dict of bytes to
  ints untracked. The whole table is a dozen tracked objects, however many nodes it holds.

A partial tail is a node too: fewer than ``block_size`` tokens in one block, below its parent in
``tail[parent]`` rather than among the children; it has no children or tail and is never locked.
``set_tail`` files one (replacing the one there through ``TreeBody.drop_tail``, which the body's
own structural changes also call when a new child or extension covers a tail).

``TreeBody`` holds the state: the nodes, the eviction order (``radixcache.tree.eviction``), the
namespace roots, the in-tree marks (one byte per pool block: 1 where the tree holds a reference),
the cached, pinned and partial-tail block counts, and ``events``: None, or the
``radixcache.kv_events.BlockEventLog`` told of every whole block that enters (``add_child`` and
``extend``, the only ways one does) or leaves (``radixcache.tree.eviction.evict_lru``, the only way
one does) the tree. ``insert_below`` is the insertion behind ``insert`` / ``adopt`` /
``adopt_below``: the walk, the blocks adopted, the partial tail kept and the recency of what was
used refreshed (with one tick, the deepest node it used). ``ChangeLog`` says when the content
changed and what was inserted, for callers that cache ``peek`` results.

Invariants every method keeps (``check_tree`` asserts them, for ``RadixCache.check``):

1. the tree holds one allocator reference on every block of every node, partial tails included,
   and ``in_tree`` is 1 exactly for those blocks; ``cached`` counts them;
2. a node's tokens are the concatenation of its blocks' tokens (``len(keys[i]) == block_size *
   len(blocks[i]) > 0`` for a node that is not a tail); a child is filed under its first block, so
   two children of a node never start with the same block; a partial tail (fewer than
   ``block_size`` tokens, one block) is filed in ``tail[parent]``, is never covered by a child
   (no child's tokens start with the tail's), has no children and is never locked;
3. ``lock_ref`` of a node is its own locks plus its children's ``lock_ref``; ``pinned`` counts the
   blocks of nodes with ``lock_ref > 0`` (a tail is never pinned);
4. ``access`` never decreases from a node to its parent (every ``touch`` refreshes a whole path
   from the root, and splits, truncations and new tails copy their node's tick); the recency tiers
   hold exactly the evictable leaves: non-root, no children, no tail, ``lock_ref == 0``;
5. freed ids have ``keys[i] is None`` and sit in ``free``.

``access`` is the last use of every block of a node (``RadixCache.evict`` says what uses a block).
A touch ends at a node boundary (a match splits the node it ends inside first), so the blocks of
one node always share their last use, and ordering leaves by it, deepest blocks first, is exact
block-level LRU.
"""

from __future__ import annotations

import itertools
import weakref
from array import array
from collections import deque
from collections.abc import Hashable

import numpy as np

from radixcache.blocks import VECTOR_MIN, BlockAllocator, has_duplicates
from radixcache.errors import CacheError
from radixcache.tokens import common_blocks, common_tokens, unpack
from radixcache.tree.eviction import Recency


_EMPTY = b""


# ------------------------------------------------------------ nodes and their handles
class NodeTable:
    """Columns of every node, alive or free; ``new`` and ``free`` manage ids."""

    __slots__ = ("parent", "lock_ref", "own_locks", "access", "until", "tail", "gen", "keys", "blocks",
                 "kids", "free_ids")

    def __init__(self):
        self.parent = array("i")
        self.lock_ref = array("I")
        self.own_locks = array("I")
        self.access = array("Q")
        self.until = array("d")
        self.tail = array("i")
        self.gen = array("I")
        self.keys: list = []
        self.blocks: list = []
        self.kids: list = []
        self.free_ids = array("I")

    def new(self, parent: int, key: bytes, blocks: bytes, access: int) -> int:
        """A fresh node id with the given fields, no locks, no children, tail or retention."""
        if self.free_ids:
            i = self.free_ids.pop()
            self.parent[i] = parent
            self.lock_ref[i] = self.own_locks[i] = 0
            self.access[i] = access
            self.until[i] = 0.0
            self.tail[i] = -1
            self.keys[i] = key
            self.blocks[i] = blocks
            return i
        self.parent.append(parent)
        self.lock_ref.append(0)
        self.own_locks.append(0)
        self.access.append(access)
        self.until.append(0.0)
        self.tail.append(-1)
        self.gen.append(0)
        self.keys.append(key)
        self.blocks.append(blocks)
        self.kids.append(None)
        return len(self.parent) - 1

    def free(self, i: int) -> None:
        """Forget node ``i``; handles to it become stale."""
        self.keys[i] = None
        self.blocks[i] = _EMPTY
        self.kids[i] = None
        self.parent[i] = -1
        self.tail[i] = -1
        self.gen[i] = (self.gen[i] + 1) & 0xFFFFFFFF
        self.free_ids.append(i)

    def is_live(self, i: int, gen: int) -> bool:
        """Whether id ``i`` still names the node a handle of generation ``gen`` was made for."""
        return 0 <= i < len(self.gen) and self.gen[i] == gen and self.keys[i] is not None

    def path_blocks(self, i: int) -> bytes:
        """The packed block ids (``array('I')`` bytes) on the path from the root down to node
        ``i``, root first."""
        runs = []
        while i >= 0:
            runs.append(self.blocks[i])
            i = self.parent[i]
        return b"".join(reversed(runs))

    def live_count(self) -> int:
        """Number of live nodes, roots included."""
        return len(self.keys) - len(self.free_ids)


class Node:
    """A handle on one node of a ``RadixCache``: opaque to callers, who pass it to ``lock``,
    ``unlock`` and ``keep``. Two handles are equal when they name the same node.

    A handle stays meaningful while the node is locked; an unlocked node may be split (the handle
    keeps the deeper part, so it still ends at the same depth), truncated or evicted (``alive`` is
    then False). While a handle is alive the tree hands out that same object for its node. The
    read-only properties are for introspection and tests.
    """

    __slots__ = ("owner", "id", "gen", "__weakref__")

    def __init__(self, owner, node_id: int, gen: int):
        self.owner = owner
        self.id = node_id
        self.gen = gen

    def __eq__(self, other) -> bool:
        return (type(other) is Node and other.owner is self.owner and other.id == self.id
                and other.gen == self.gen)

    def __hash__(self) -> int:
        return hash((id(self.owner), self.id, self.gen))

    @property
    def _table(self) -> NodeTable:
        return self.owner.node_table

    @property
    def alive(self) -> bool:
        """Whether the node is still in the tree."""
        return self._table.is_live(self.id, self.gen)

    @property
    def parent(self) -> Node | None:
        """The parent's handle (None for a namespace root)."""
        p = self._table.parent[self.id]
        return None if p < 0 else self.owner.handle_of(p)

    @property
    def children(self) -> list[Node]:
        """Handles of the whole-block children (empty for a leaf; the partial tail is ``tail``)."""
        return [self.owner.handle_of(c) for c in (self._table.kids[self.id] or {}).values()]

    @property
    def tail(self) -> Node | None:
        """The handle of the node's partial tail, or None."""
        t = self._table.tail[self.id]
        return None if t < 0 else self.owner.handle_of(t)

    @property
    def key(self) -> array:
        """The node's tokens (empty for a root)."""
        return unpack(self._table.keys[self.id])

    @property
    def blocks(self) -> array:
        """The node's block ids, in order."""
        return unpack(self._table.blocks[self.id])

    @property
    def lock_ref(self) -> int:
        """Locks on this node or below it."""
        return self._table.lock_ref[self.id]

    @property
    def namespace(self) -> tuple:
        """The namespace of the node's tree."""
        nodes, i = self._table, self.id
        while nodes.parent[i] >= 0:
            i = nodes.parent[i]
        return self.owner.namespace_of_root(i)

    @property
    def depth_tokens(self) -> int:
        """Number of tokens from the namespace root to the end of this node."""
        nodes, i, n = self._table, self.id, 0
        while i >= 0:
            n += len(nodes.keys[i])
            i = nodes.parent[i]
        return n // 4

    def __repr__(self) -> str:
        if not self.alive:
            return f"Node(id={self.id}, evicted)"
        nodes = self._table
        return (f"Node(id={self.id}, tokens={len(nodes.keys[self.id]) // 4}, "
                f"blocks={len(nodes.blocks[self.id]) >> 2}, lock_ref={nodes.lock_ref[self.id]}, "
                f"children={len(nodes.kids[self.id] or ())})")


class _HandleRef(weakref.ref):
    """A weak reference to a handle that remembers its node id (for the table's cleanup)."""

    __slots__ = ("node_id",)

    def __new__(cls, handle, callback, node_id):
        self = weakref.ref.__new__(cls, handle, callback)
        self.node_id = node_id
        return self

    def __init__(self, handle, callback, node_id):
        super().__init__(handle, callback)


class HandleTable:
    """At most one live ``Node`` per node id, held weakly: while a caller holds a handle, every
    other handle on that node is the same object (``is`` works); the table holds only handles some
    caller still holds, so it stays as small as the requests in flight."""

    __slots__ = ("table", "forget")

    def __init__(self):
        table: dict[int, _HandleRef] = {}

        def forget(ref, table=table):
            if table.get(ref.node_id) is ref:
                del table[ref.node_id]

        self.table, self.forget = table, forget

    def get(self, owner, node_id: int, gen: int) -> Node:
        """The handle on node ``node_id`` of generation ``gen`` (a new one if none is alive)."""
        ref = self.table.get(node_id)
        handle = None if ref is None else ref()
        if handle is None or handle.gen != gen:
            handle = Node(owner, node_id, gen)
            self.table[node_id] = _HandleRef(handle, self.forget, node_id)
        return handle


# ------------------------------------------------------------ what changed
INSERT_LOG = 1024  # inserts ``ChangeLog.inserted_since`` remembers


class ChangeLog:
    """The epochs and the insert log of one tree (see the module docstring)."""

    __slots__ = ("epoch", "evicted_epoch", "_inserts", "_forgotten")

    def __init__(self, size: int = INSERT_LOG):
        self.epoch = 0
        self.evicted_epoch = 0
        self._inserts: deque = deque(maxlen=size)  # (epoch, first new block index, its tokens)
        self._forgotten = 0  # inserts up to this epoch may have left the log

    def inserted(self, index: int, block: bytes) -> None:
        """Whole blocks were added; the first of them is block ``index`` holding ``block``."""
        self.epoch += 1
        log = self._inserts
        if len(log) == log.maxlen:
            self._forgotten = log[0][0]
        log.append((self.epoch, index, block))

    def changed(self) -> None:
        """Something else changed (a partial tail kept)."""
        self.epoch += 1

    def evicted(self) -> None:
        """Blocks were dropped."""
        self.epoch += 1
        self.evicted_epoch = self.epoch

    def inserted_since(self, epoch: int) -> list | None:
        """``(index, packed tokens)`` of the first new whole block of every insert after ``epoch``
        (an earlier ``self.epoch``), or None when the log no longer reaches back that far."""
        if epoch < self._forgotten:
            return None
        out = []
        for entry in reversed(self._inserts):
            if entry[0] <= epoch:
                break
            out.append(entry[1:])
        return out


# ------------------------------------------------------------ the body
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


# ------------------------------------------------------------ partial tails
def set_tail(body: TreeBody, node: int, rest: bytes, block: array) -> int:
    """Make ``block`` (holding the tokens ``rest``) the tail of ``node`` unless the tail there or
    a whole-block child already covers them; a different or shorter tail is replaced.

    Returns the tail that now holds ``rest`` (the new one, or the one there that covers it),
    for the caller to ``touch``; -1 where a child covers it (only the child's first block holds
    those tokens, so refreshing the child would refresh blocks the insert never used)."""
    nodes = body.nodes
    old = nodes.tail[node]
    if old >= 0 and nodes.keys[old].startswith(rest):
        return old
    kids = nodes.kids[node]
    if kids is not None and any(nodes.keys[c].startswith(rest) for c in kids.values()):
        return -1
    if old >= 0:
        body.drop_tail(node)
    body.recency.discard(node)
    tail = nodes.tail[node] = nodes.new(node, rest, block.tobytes(), nodes.access[node])
    body.allocator.retain_checked(block)
    body.in_tree[block[0]] = 1
    body.cached += 1
    body.tails += 1
    return tail


# ------------------------------------------------------------ insertion
def insert_below(body, allocator, stats, changes, start: int, args: tuple, depth: int,
                 extend: bool) -> tuple[int, int, bytearray]:
    """Insert ``args`` (``RadixCache._insert_args``) below node ``start``, which ends ``depth`` bytes of
    tokens deep (a namespace root: 0). With ``extend`` a caller-locked leaf may grow in place
    (``TreeBody.can_extend``). Returns (bytes already cached below ``start``, the node ending at
    the last whole block, the tree's packed block ids of every whole block)."""
    q, ids, tail, nblocks = args
    bs4 = body.bs4
    whole = q if len(q) == nblocks * bs4 else q[:nblocks * bs4]
    node, pos, path = body.walk(whole, start, True)
    adopted = ids[pos // bs4:]
    # Where the caller passes the tree's own blocks for the cached part (as match returned them),
    # those are valid by construction; otherwise every id is checked.
    own_prefix = ids[:pos // bs4].tobytes() == path
    checked = adopted if own_prefix else ids
    if tail is not None:
        checked = checked + tail
    if checked and not (own_prefix and allocator.adoptable(checked, body.in_tree)):
        _raise_unadoptable(body, allocator, checked, adopted, tail)
    if adopted:
        changes.inserted((depth + pos) // bs4, whole[pos:pos + bs4])
        if extend and pos == 0 and body.can_extend(node, whole):
            body.extend(node, whole, adopted)
        else:
            node = body.add_child(node, whole[pos:], adopted)
        stats.inserted_tokens += len(adopted) * (bs4 // 4)
        path += adopted
    used = node
    if tail is not None:
        kept = set_tail(body, node, q[nblocks * bs4:], tail)
        changes.changed()
        if kept >= 0:
            used = kept
    if body.nodes.parent[used] >= 0:
        body.touch(used)
    return pos, node, path


def _raise_unadoptable(body, allocator, checked: array, adopted: array, tail: array | None) -> None:
    """Raise the error that names why ``checked`` (the blocks an insert adopts, or every block it
    was given, plus the tail) cannot be adopted."""
    if has_duplicates(checked):
        raise CacheError("insert: the same block id appears twice")
    allocator.require_held(checked, "insert")
    if tail is not None and body.in_tree[tail[0]]:
        raise CacheError(f"insert: tail block {tail[0]} already belongs to the tree")
    owned = body.marked(adopted)
    if owned:
        raise CacheError(f"insert: blocks {owned[:8]} already belong to the tree at other positions")


# ------------------------------------------------------------ the invariants
def _lock_ref_ok(nodes, i: int) -> bool:
    kids = nodes.kids[i] or {}
    return nodes.lock_ref[i] == nodes.own_locks[i] + sum(nodes.lock_ref[c] for c in kids.values())


def _check_tail(body, parent: int, t: int) -> None:
    nodes = body.nodes
    key = nodes.keys[t]
    assert nodes.tail[parent] == t and 0 < len(key) < body.bs4 and len(nodes.blocks[t]) == 4, \
        f"node {t}: bad partial tail"
    assert nodes.kids[t] is None and nodes.tail[t] < 0 and nodes.lock_ref[t] == 0 == nodes.own_locks[t], \
        f"node {t}: a tail has no children and is never locked"
    assert not any(nodes.keys[c].startswith(key) for c in (nodes.kids[parent] or {}).values()), \
        f"node {t}: a child covers the tail"


def check_tree(body, block_size: int) -> None:
    """Assert every invariant of the tree whose ``TreeBody`` is ``body``."""
    nodes, bs4 = body.nodes, body.bs4
    assert bs4 == 4 * block_size
    for ns, r in body.roots.items():
        assert nodes.parent[r] == -1 and nodes.keys[r] == b"", f"namespace root of {ns} is not a root"
        assert body.root_ns[r] == ns, f"root {r} maps to another namespace"
        assert nodes.kids[r] is None or nodes.kids[r], f"root {r} has an empty child table"
        assert _lock_ref_ok(nodes, r), "root lock count is not own locks + children's"
    assert len(body.root_ns) == len(body.roots), "root tables out of step"
    stack = [(r, c) for r in body.roots.values() for c in body.below(r)]
    leaves, visited, pinned, tails = set(), 0, 0, 0
    held = bytearray()
    while stack:
        p, i = stack.pop()
        visited += 1
        key, blocks, kids = nodes.keys[i], nodes.blocks[i], nodes.kids[i]
        assert key is not None, f"freed node {i} still linked"
        assert nodes.parent[i] == p, f"node {i}: parent {nodes.parent[i]}, linked under {p}"
        assert nodes.access[p] >= nodes.access[i], f"node {p}: older than child {i}"
        if body.is_tail(i):
            _check_tail(body, p, i)
            tails += 1
        else:
            assert len(key) == len(blocks) * block_size > 0, f"node {i}: key/blocks length mismatch"
            assert nodes.kids[p].get(key[:bs4]) == i, f"node {i}: wrong child key"
            assert kids is None or kids, f"node {i} has an empty child table"
            assert _lock_ref_ok(nodes, i), f"node {i}: path lock count is not own locks + children's"
        stack.extend((i, c) for c in body.below(i))
        held += blocks
        if nodes.lock_ref[i]:
            pinned += len(blocks) >> 2
        elif body.is_evictable_leaf(i):
            leaves.add(i)
    assert visited + len(body.roots) == nodes.live_count(), "live nodes unreachable from the roots"
    assert all(nodes.keys[i] is None for i in nodes.free_ids), "a free node id is still in use"
    v = np.frombuffer(held, np.uint32)
    assert np.unique(v).size == v.size, "a block is held by two nodes"
    assert (body.allocator.refcounts()[v] >= 1).all(), "a tree block is free in the allocator"
    marks = np.frombuffer(body.in_tree, np.uint8)
    assert marks[v].all() and int(marks.sum()) == v.size, "in-tree marks disagree with the nodes"
    assert v.size == body.cached, f"cached_blocks {body.cached} != {v.size}"
    assert pinned == body.pinned, f"pinned_blocks {body.pinned} != {pinned}"
    assert tails == body.tails, f"partial tails {body.tails} != {tails}"
    body.recency.check(leaves)


def held_outside(body, allocator) -> list[str]:
    """``RadixCache.leaks``: pinned blocks or locked roots, and (up to 11) blocks whose reference
    count is not exactly the tree's own mark: what some caller still holds."""
    problems = []
    nodes = body.nodes
    if body.pinned or any(nodes.lock_ref[r] for r in body.root_ns):
        problems.append(f"{body.pinned} pinned blocks / locked roots remain")
    counts = allocator.refcounts()
    marks = np.frombuffer(body.in_tree, np.uint8)
    for b in np.flatnonzero(counts != marks)[:11].tolist():
        problems.append(f"block {b}: refcount {counts[b]}, tree holds {marks[b]}")
    return problems
