"""The tree's node storage: one struct of arrays, indexed by node id, and the handles callers hold.

Layout (why: at millions of cached blocks the tree must be neither slow nor big, and add nothing a
cyclic-GC pass has to walk per node, block or token):

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

Invariants (checked by ``RadixCache.check``): a live non-root node that is not a tail has
``len(keys[i]) == block_size * len(blocks[i]) > 0`` and is ``kids[parent[i]][keys[i][:4 *
block_size]]``;
``lock_ref[i] == own_locks[i] + sum(lock_ref[c] for c in kids[i])``; ``access[i] >= access[c]``
for every child; freed ids have ``keys[i] is None`` and sit in ``free``.
"""

from __future__ import annotations

import weakref
from array import array

from radixcache.tokens import unpack

_EMPTY = b""


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
