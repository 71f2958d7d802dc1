"""The tree's side of KV events: what changed, queued in order and never waited on.

The tree calls ``stored`` when it adopts whole blocks as a new node (``TreeBody.add_child``) and
``removed`` when it evicts blocks (``TreeBody.evict``, partial tails included: they were never
announced, so the publisher names none of them); ``resync`` snapshots every whole block it holds
(start-up, ``reset``, a late subscriber). Each call runs on the tree's thread, under the lock of
whoever changes the tree, after the change: it appends one record holding references to the
tree's own immutable bytes (tokens and block ids, no copy, no digest) and returns. The publisher's
thread takes records from the other end (``take``) and does the hashing and encoding there.

The queue is bounded by ``max_records``. A record that finds it full is dropped and counted
(``dropped``), and the log is then *lost*: the publisher's view no longer matches the tree, so
further records are dropped too until the queue has drained to half, when the next change is
replaced by a snapshot of the whole tree (``AllBlocksCleared`` then ``BlockStored`` for every whole
block, counted in ``resyncs``). Subscribers are exact again from there on.

Records: ``(STORED, parent_blocks, namespace, key, blocks)`` (``parent_blocks``: the packed block
ids of the node the new one hangs below, whose last id is the new node's parent block, or None
below a namespace root, when ``namespace`` is that root's tuple; ``key``, ``blocks``: the new
node's packed tokens and block ids); ``(REMOVED, ids)`` (packed block ids); ``(SYNC, num_blocks,
block_size, entries)`` with one ``(parent_blocks, namespace, key, blocks)`` per node, parents first.
"""

from __future__ import annotations

import threading
from collections import deque

STORED, REMOVED, SYNC = 0, 1, 2


class BlockEventLog:
    """A bounded, drop-counting queue of the tree's block changes (see the module docstring).

    One tree at a time (``attach``). ``appended`` counts the records queued so far, so a consumer
    can tell when it has handled everything queued before a point (``KVEventPublisher.flush``).
    After ``close`` every call is a no-op.
    """

    def __init__(self, max_records: int = 100_000):
        if isinstance(max_records, bool) or not isinstance(max_records, int) or max_records < 1:
            raise ValueError(f"max_records must be a positive int, got {max_records!r}")
        self.max_records = max_records
        self.records: deque = deque()
        self.appended = 0
        self.dropped = 0
        self.resyncs = 0
        self.lost = False
        self.closed = False
        self.wake = threading.Event()  # set when a record arrives while the consumer may sleep
        self._body = None

    # ------------------------------------------------------------------ attachment
    def attach(self, body) -> None:
        """Start logging the tree whose ``TreeBody`` is ``body``: queue a snapshot of it first."""
        if self._body is not None and self._body is not body:
            raise ValueError("this KV event log already follows another tree")
        if self.closed:
            raise ValueError("this KV event log is closed")
        self._body = body
        self.resync(body)

    def detach(self, body) -> None:
        """Stop following ``body`` (records already queued stay)."""
        if self._body is body:
            self._body = None

    def close(self) -> None:
        """Stop accepting records, wake the consumer."""
        self.closed = True
        self.wake.set()

    # ------------------------------------------------------------------ the tree's calls
    def stored(self, body, node: int, child: int) -> None:
        """Node ``child`` (whole blocks) was just added below ``node``."""
        if self.closed:
            return
        nodes = body.nodes
        if nodes.parent[node] < 0:
            record = (STORED, None, body.root_ns[node], nodes.keys[child], nodes.blocks[child])
        else:
            record = (STORED, nodes.blocks[node], None, nodes.keys[child], nodes.blocks[child])
        self._put(body, record)

    def extended(self, body, before: bytes, key: bytes, blocks: bytes) -> None:
        """A node whose blocks were ``before`` was just extended in place by ``key`` / ``blocks``."""
        if not self.closed:
            self._put(body, (STORED, before, None, key, blocks))

    def removed(self, body, ids: bytes) -> None:
        """The blocks ``ids`` (packed uint32) just left the tree."""
        if not self.closed:
            self._put(body, (REMOVED, ids))

    def resync(self, body) -> None:
        """Queue a snapshot of every whole block ``body`` holds (it replaces everything before)."""
        if self.closed:
            return
        self.lost = False
        self.resyncs += 1
        self._append(snapshot(body))

    # ------------------------------------------------------------------ the consumer's calls
    def take(self):
        """The oldest record, or None when the queue is empty (the consumer's thread only)."""
        try:
            return self.records.popleft()
        except IndexError:
            return None

    def force_resync(self) -> None:
        """Make the next change resync the whole tree (the consumer could not apply a record)."""
        self.lost = True

    # ------------------------------------------------------------------ internals
    def _put(self, body, record) -> None:
        records = self.records
        if self.lost:
            if len(records) > self.max_records // 2:
                self.dropped += 1
                return
            self.resync(body)  # the change is in the snapshot
            return
        if len(records) >= self.max_records:
            self.dropped += 1
            self.lost = True
            return
        self._append(record)

    def _append(self, record) -> None:
        self.records.append(record)
        self.appended += 1
        if not self.wake.is_set():
            self.wake.set()


def snapshot(body) -> tuple:
    """``(SYNC, num_blocks, block_size, entries)``: every non-tail node of ``body``, parents first."""
    nodes = body.nodes
    keys, blocks, kids = nodes.keys, nodes.blocks, nodes.kids
    entries = []
    for root, namespace in body.root_ns.items():
        stack = [(None, namespace, c) for c in (kids[root] or {}).values()]
        while stack:
            parent_blocks, ns, i = stack.pop()
            entries.append((parent_blocks, ns, keys[i], blocks[i]))
            stack.extend((blocks[i], None, c) for c in (kids[i] or {}).values())
    return SYNC, body.allocator.num_blocks, body.bs4 // 4, entries
