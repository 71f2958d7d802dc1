"""BlockAllocator: block ids, reference counts and the free list of the KV pool.

Memory layout: the reference counts are one ``array('i')`` (4 B per block) and the free list one
``array('I')`` used as a stack (4 B per free block). Neither is a container the cyclic garbage
collector tracks, so a pool of millions of blocks adds nothing to a collection (Python lists of
ints would be walked on every full pass). Calls over many ids are validated and applied with numpy
on views of the same memory; short calls (the decode path: one or two ids) take a plain loop, which
is faster below ``VECTOR_MIN`` ids. Both paths do the same checks and leave the same state.
"""

from __future__ import annotations

import operator
from array import array
from collections.abc import Iterable

import numpy as np

from radixcache.errors import CacheError, OutOfBlocks

VECTOR_MIN = 128  # calls with at least this many ids are checked and applied with numpy
MAX_ID = 2**32 - 1  # block ids are stored as unsigned 32-bit ints


def _bad_id(blocks, what: str) -> Exception:
    """The precise error for the first id of ``blocks`` that is not a block id (slow path)."""
    for block in blocks:
        if isinstance(block, bool) or not hasattr(type(block), "__index__"):
            return TypeError(f"{what}: block ids are ints, got {block!r}")
        value = operator.index(block)
        if not 0 <= value <= MAX_ID:
            return CacheError(f"{what}: block id {value} is outside the pool")
    return TypeError(f"{what}: block ids must be ints")


def as_block_ids(blocks, what: str) -> array:
    """``blocks`` (a list, tuple, iterable, ``array('I')`` or integer numpy array of block ids) as an
    ``array('I')``. Raises ``TypeError`` for anything that is not an int (bools included) and
    ``CacheError`` for a negative id or one of 2**32 or more. The ids are not checked against a pool."""
    if type(blocks) is array and blocks.typecode == "I":
        return blocks
    if isinstance(blocks, np.ndarray):
        if blocks.ndim != 1 or blocks.dtype.kind not in "iu":
            raise TypeError(f"{what}: block ids are ints, got a {blocks.dtype} array of shape {blocks.shape}")
        if blocks.size and (blocks.min() < 0 or blocks.max() > MAX_ID):
            raise CacheError(f"{what}: block id {blocks.min() if blocks.min() < 0 else blocks.max()} "
                             f"is outside the pool")
        return array("I", blocks.astype(np.uint32, copy=False).tobytes())
    if type(blocks) is not list and type(blocks) is not tuple:
        if isinstance(blocks, (str, bytes, bytearray)):
            raise TypeError(f"{what}: block ids are ints, got {type(blocks).__name__}")
        blocks = list(blocks)
    try:
        ids = array("I", blocks)
    except (TypeError, OverflowError):
        raise _bad_id(blocks, what) from None
    # array('I') takes True and False as 1 and 0: look for bools where those values are.
    if len(ids) < VECTOR_MIN:
        suspects = blocks if True in blocks or False in blocks else ()
    else:
        suspects = [blocks[i] for i in np.flatnonzero(np.frombuffer(ids, np.uint32) <= 1).tolist()]
    for block in suspects:
        if isinstance(block, bool):
            raise TypeError(f"{what}: block ids are ints, got {block!r}")
    return ids


def has_duplicates(ids: array) -> bool:
    """Whether an ``array('I')`` of ids names some id twice."""
    if len(ids) < VECTOR_MIN:
        return len(set(ids)) != len(ids)
    v = np.frombuffer(ids, np.uint32)
    return bool((np.diff(np.sort(v)) == 0).any())


class BlockAllocator:
    """Hands out the ids ``0 .. num_blocks-1`` of fixed-size KV blocks with reference counts.

    A block is free exactly when its count is 0. ``allocate`` returns fresh blocks with count 1,
    ``retain`` adds a holder, ``release`` drops one; the last release frees the block. Every method
    checks all of its arguments before changing anything, so a failed call changes nothing. Ids may
    be passed as any iterable of ints, an ``array('I')`` or an integer numpy array.
    """

    __slots__ = ("_counts", "_free")

    def __init__(self, num_blocks: int):
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        if num_blocks > MAX_ID + 1:
            raise ValueError(f"num_blocks must be at most 2**32, got {num_blocks}")
        self._counts = array("i", bytes(4 * num_blocks))
        # Popped from the end: low ids are handed out first, which keeps tests readable.
        self._free = array("I", np.arange(num_blocks - 1, -1, -1, dtype=np.uint32).tobytes())

    @property
    def num_blocks(self) -> int:
        """Total number of blocks managed (free and used)."""
        return len(self._counts)

    @property
    def num_free(self) -> int:
        """Number of blocks whose reference count is 0."""
        return len(self._free)

    def _view(self) -> np.ndarray:
        return np.frombuffer(self._counts, np.int32)

    def allocate(self, n: int) -> list[int]:
        """Return ``n`` free blocks, each with reference count 1.

        Raises ``OutOfBlocks`` (changing nothing) when fewer than ``n`` blocks are free.
        """
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"n must be a non-negative int, got {n!r}")
        free = self._free
        if n > len(free):
            raise OutOfBlocks(f"asked for {n} blocks, only {len(free)} of {self.num_blocks} free")
        if n == 0:
            return []
        taken = free[len(free) - n:]
        del free[len(free) - n:]
        taken.reverse()
        if n < VECTOR_MIN:
            counts = self._counts
            for block in taken:
                counts[block] = 1
        else:
            self._view()[np.frombuffer(taken, np.uint32)] = 1
        return taken.tolist()

    def retain(self, blocks: Iterable[int]) -> None:
        """Add one reference to each block (twice if named twice); every block must be in use."""
        self.retain_checked(self.require_held(blocks, "retain"))

    def release(self, blocks: Iterable[int]) -> None:
        """Drop one reference from each block; a block whose count reaches 0 is free again.

        Releasing a free block (or one block more often than it is held) raises ``CacheError``.
        """
        ids = self.require_held(blocks, "release")
        if not ids:
            return
        if len(ids) < VECTOR_MIN:
            self._release_loop(ids)
            return
        counts = self._view()
        v = np.frombuffer(ids, np.uint32)
        if has_duplicates(ids):
            v, times = np.unique(v, return_counts=True)
            over = v[counts[v] < times]
            if over.size:
                raise CacheError(f"release: blocks {over.tolist()} released more times than they are held")
            counts[v] -= times.astype(np.int32)
        else:
            counts[v] -= 1
        self._free.frombytes(v[counts[v] == 0].tobytes())

    def _release_loop(self, ids: array) -> None:
        counts = self._counts
        if len(set(ids)) != len(ids):
            need: dict[int, int] = {}
            for block in ids:
                need[block] = need.get(block, 0) + 1
            over = [b for b, k in need.items() if k > counts[b]]
            if over:
                raise CacheError(f"release: blocks {over} released more times than they are held")
        free = self._free
        for block in ids:
            counts[block] -= 1
            if counts[block] == 0:
                free.append(block)

    def require_held(self, blocks: Iterable[int], what: str) -> array:
        """Validate ``blocks`` and return them as an ``array('I')``: ``TypeError`` unless every id is
        an int, ``CacheError`` unless every id is in range and in use (count >= 1)."""
        ids = as_block_ids(blocks, what)
        n = len(self._counts)
        if len(ids) < VECTOR_MIN:
            counts = self._counts
            for block in ids:
                if block >= n:
                    raise CacheError(f"{what}: block id {block} is outside 0..{n - 1}")
                if counts[block] == 0:
                    raise CacheError(f"{what}: block {block} is free; the caller must hold its blocks")
            return ids
        v = np.frombuffer(ids, np.uint32)
        if int(v.max()) >= n:
            raise CacheError(f"{what}: block id {int(v.max())} is outside 0..{n - 1}")
        free = np.flatnonzero(self._view()[v] == 0)
        if free.size:
            raise CacheError(f"{what}: blocks {v[free[:8]].tolist()} are free (reference count 0); "
                             f"the caller must hold its blocks")
        return ids

    def adoptable(self, ids: array, marks: bytearray) -> bool:
        """Whether every id of ``ids`` (an ``array('I')``) is inside the pool, held (count >= 1),
        named once, and 0 in ``marks`` (one byte per pool block): all an insert must know of the
        blocks a tree adopts, in one pass. False says only that some check failed: the caller then
        runs the checks that name the problem."""
        n = len(ids)
        if n < VECTOR_MIN:
            if len(set(ids)) != n:
                return False
            counts, size = self._counts, len(self._counts)
            for block in ids:
                if block >= size or not counts[block] or marks[block]:
                    return False
            return True
        v = np.frombuffer(ids, np.uint32)
        if int(v.max()) >= len(self._counts) or not self._view()[v].all():
            return False
        if np.frombuffer(marks, np.uint8)[v].any():
            return False
        v = np.sort(v)
        return not (v[1:] == v[:-1]).any()

    def retain_checked(self, ids: array, distinct: bool = False) -> None:
        """``retain`` for ids ``require_held`` returned (the hot path of tree inserts); ``distinct``
        says the caller knows no id is named twice."""
        if len(ids) < VECTOR_MIN:
            counts = self._counts
            for block in ids:
                counts[block] += 1
        elif not distinct and has_duplicates(ids):
            np.add.at(self._view(), np.frombuffer(ids, np.uint32), 1)
        else:
            self._view()[np.frombuffer(ids, np.uint32)] += 1

    def refcount(self, block: int) -> int:
        """The reference count of ``block`` (0 when free)."""
        if isinstance(block, bool) or not hasattr(type(block), "__index__"):
            raise TypeError(f"refcount: block ids are ints, got {block!r}")
        block = operator.index(block)
        if not 0 <= block < len(self._counts):
            raise CacheError(f"refcount: block id {block} is outside 0..{len(self._counts) - 1}")
        return self._counts[block]

    def refcounts(self) -> np.ndarray:
        """Every block's reference count, as a read-only int32 numpy view (index = block id)."""
        view = self._view()
        view.flags.writeable = False
        return view

    def __repr__(self) -> str:
        return f"BlockAllocator(num_blocks={self.num_blocks}, free={self.num_free})"
