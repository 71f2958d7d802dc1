"""BlockAllocator: block ids, reference counts and the free list of the KV pool."""

from __future__ import annotations

import operator
from collections.abc import Iterable

from radixcache.errors import CacheError, OutOfBlocks


class BlockAllocator:
    """Hands out the ids ``0 .. num_blocks-1`` of fixed-size KV blocks with reference counts.

    A block is free exactly when its count is 0. ``allocate`` returns fresh blocks with count 1,
    ``retain`` adds a holder, ``release`` drops one; the last release frees the block. Every method
    checks all of its arguments before changing anything, so a failed call changes nothing.
    """

    __slots__ = ("_counts", "_free")

    def __init__(self, num_blocks: int):
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        self._counts = [0] * num_blocks
        # Popped from the end: low ids are handed out first, which keeps tests readable.
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_blocks(self) -> int:
        """Total number of blocks managed (free and used)."""
        return len(self._counts)

    @property
    def num_free(self) -> int:
        """Number of blocks whose reference count is 0."""
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Return ``n`` free blocks, each with reference count 1.

        Raises ``OutOfBlocks`` (changing nothing) when fewer than ``n`` blocks are free.
        """
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"n must be a non-negative int, got {n!r}")
        if n > len(self._free):
            raise OutOfBlocks(f"asked for {n} blocks, only {len(self._free)} of {self.num_blocks} free")
        if n == 0:
            return []
        taken = self._free[-n:]
        del self._free[-n:]
        taken.reverse()
        for block in taken:
            self._counts[block] = 1
        return taken

    def retain(self, blocks: Iterable[int]) -> None:
        """Add one reference to each block; every block must be in use (count >= 1)."""
        blocks = self._used_ids(blocks, "retain")
        for block in blocks:
            self._counts[block] += 1

    def release(self, blocks: Iterable[int]) -> None:
        """Drop one reference from each block; a block whose count reaches 0 is free again.

        Releasing a free block (or one block more often than it is held) raises ``CacheError``.
        """
        blocks = self._used_ids(blocks, "release")
        counts = self._counts
        if len(set(blocks)) != len(blocks):
            need: dict[int, int] = {}
            for block in blocks:
                need[block] = need.get(block, 0) + 1
            over = [b for b, k in need.items() if k > counts[b]]
            if over:
                raise CacheError(f"release: blocks {over} released more times than they are held")
        for block in blocks:
            counts[block] -= 1
            if counts[block] == 0:
                self._free.append(block)

    def check_held(self, blocks: Iterable[int], what: str) -> None:
        """Raise ``CacheError`` unless every id is in range and in use (count >= 1)."""
        counts = self._counts
        n = len(counts)
        for block in blocks:
            if not 0 <= block < n:
                raise CacheError(f"{what}: block id {block} is outside 0..{n - 1}")
            if counts[block] == 0:
                raise CacheError(f"{what}: block {block} is free; the caller must hold its blocks")

    def retain_checked(self, blocks: Iterable[int]) -> None:
        """``retain`` for ids already validated by ``check_held`` (the hot path of tree inserts)."""
        counts = self._counts
        for block in blocks:
            counts[block] += 1

    def refcount(self, block: int) -> int:
        """The reference count of ``block`` (0 when free)."""
        return self._counts[self._ids([block], "refcount")[0]]

    def _ids(self, blocks: Iterable[int], what: str) -> list[int]:
        n = len(self._counts)
        ids = []
        for block in blocks:
            if isinstance(block, bool):
                raise TypeError(f"{what}: block ids are ints, got {block!r}")
            try:
                block = operator.index(block)
            except TypeError:
                raise TypeError(f"{what}: block ids are ints, got {block!r}") from None
            if not 0 <= block < n:
                raise CacheError(f"{what}: block id {block} is outside 0..{n - 1}")
            ids.append(block)
        return ids

    def _used_ids(self, blocks: Iterable[int], what: str) -> list[int]:
        ids = self._ids(blocks, what)
        counts = self._counts
        free = [b for b in ids if counts[b] == 0]
        if free:
            raise CacheError(f"{what}: blocks {free} are free (reference count 0)")
        return ids

    def __repr__(self) -> str:
        return f"BlockAllocator(num_blocks={self.num_blocks}, free={self.num_free})"
