"""What changed in a tree's content, for callers that cache what ``peek`` told them.

``epoch`` changes with every change of the cached content (blocks or tails added or dropped),
``evicted_epoch`` is the epoch of the last eviction, and a bounded log keeps, for every insert,
the index and packed tokens of its first new whole block. That is enough to know which cached
peeks an insert may have lengthened: a ``peek`` grows only through an insert whose first new
block is one of the queried tokens' blocks, at the same index, at or before the first block the
peek did not find (the insert's earlier blocks were cached already, so they are the query's).
"""

from __future__ import annotations

from collections import deque

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
