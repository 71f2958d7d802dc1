"""Unit tests of BlockAllocator (radixcache/blocks.py) against its docstrings' contract.

Every failing call must raise the documented exception AND leave the allocator exactly as it was;
``snapshot`` captures everything observable (every block's count and the number of free blocks).
"""

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixcache import BlockAllocator, CacheError, OutOfBlocks


def snapshot(alloc):
    """Everything observable about an allocator: (num_blocks, num_free, every block's count)."""
    return (alloc.num_blocks, alloc.num_free, tuple(alloc.refcount(b) for b in range(alloc.num_blocks)))


# --------------------------------------------------------------------------- construction

def test_new_allocator_is_all_free():
    """A new allocator of n blocks manages ids 0..n-1, all free with count 0."""
    alloc = BlockAllocator(5)
    assert alloc.num_blocks == 5
    assert alloc.num_free == 5
    assert [alloc.refcount(b) for b in range(5)] == [0] * 5


def test_constructor_rejects_non_positive_or_non_int():
    """num_blocks must be a positive int (bool, float, str and None are refused with ValueError)."""
    for bad in (0, -1, -100, 1.5, 2.0, True, False, "4", None, [4]):
        with pytest.raises(ValueError):
            BlockAllocator(bad)


# --------------------------------------------------------------------------- allocate

def test_allocate_gives_distinct_in_range_blocks_with_count_one():
    """allocate(n) returns n distinct ids in 0..num_blocks-1, each with count 1, and num_free drops by n."""
    alloc = BlockAllocator(8)
    a = alloc.allocate(3)
    b = alloc.allocate(5)
    assert len(a) == 3 and len(b) == 5
    assert sorted(a + b) == list(range(8))
    assert all(alloc.refcount(x) == 1 for x in a + b)
    assert alloc.num_free == 0
    alloc.release(a + b)
    assert alloc.num_free == 8


def test_allocate_zero_is_empty_and_changes_nothing():
    """allocate(0) returns [] and changes nothing, even when no block is free."""
    alloc = BlockAllocator(2)
    before = snapshot(alloc)
    assert alloc.allocate(0) == []
    assert snapshot(alloc) == before
    held = alloc.allocate(2)
    before = snapshot(alloc)
    assert alloc.allocate(0) == []
    assert snapshot(alloc) == before
    alloc.release(held)


def test_allocate_rejects_bad_counts():
    """allocate(n) with a negative, bool or non-int n raises ValueError and changes nothing."""
    alloc = BlockAllocator(4)
    held = alloc.allocate(1)
    before = snapshot(alloc)
    for bad in (-1, 1.0, True, "1", None):
        with pytest.raises(ValueError):
            alloc.allocate(bad)
        assert snapshot(alloc) == before, bad
    alloc.release(held)


def test_out_of_blocks_is_a_cache_error_and_changes_nothing():
    """Asking for more blocks than are free raises OutOfBlocks (a CacheError) and changes nothing:
    the same blocks are still free and a later allocation that fits behaves as if it never happened."""
    assert issubclass(OutOfBlocks, CacheError)
    alloc = BlockAllocator(4)
    twin = BlockAllocator(4)
    held = alloc.allocate(3)
    twin.allocate(3)
    before = snapshot(alloc)
    for n in (2, 4, 5, 1000):
        with pytest.raises(OutOfBlocks):
            alloc.allocate(n)
        with pytest.raises(CacheError):
            alloc.allocate(n)
        assert snapshot(alloc) == before
    last = alloc.allocate(1)
    assert last == twin.allocate(1)
    assert alloc.refcount(last[0]) == 1 and alloc.num_free == 0
    with pytest.raises(OutOfBlocks):
        alloc.allocate(1)
    alloc.release(held + last)
    assert alloc.num_free == 4


# --------------------------------------------------------------------------- retain / release

def test_retain_release_count_and_free():
    """retain adds one per block, release drops one; the last release frees the block, not before."""
    alloc = BlockAllocator(4)
    [a, b] = alloc.allocate(2)
    alloc.retain([a])
    alloc.retain([a, b])
    assert alloc.refcount(a) == 3 and alloc.refcount(b) == 2
    alloc.release([a, b])
    assert alloc.refcount(a) == 2 and alloc.refcount(b) == 1 and alloc.num_free == 2
    alloc.release([b])
    assert alloc.refcount(b) == 0 and alloc.num_free == 3
    alloc.release([a])
    alloc.release([a])
    assert alloc.refcount(a) == 0 and alloc.num_free == 4
    # Freed blocks come back from allocate.
    again = alloc.allocate(4)
    assert sorted(again) == [0, 1, 2, 3]
    alloc.release(again)


def test_retain_and_release_accept_any_iterable_and_numpy_ints():
    """Block ids may come as a tuple, a generator or numpy integers; empty iterables are no-ops."""
    alloc = BlockAllocator(3)
    blocks = alloc.allocate(2)
    alloc.retain(tuple(blocks))
    alloc.retain(b for b in blocks)
    alloc.retain(np.array(blocks, dtype=np.int64))
    assert [alloc.refcount(b) for b in blocks] == [4, 4]
    before = snapshot(alloc)
    alloc.retain([])
    alloc.release(())
    assert snapshot(alloc) == before
    alloc.release([np.int32(blocks[0]), np.int64(blocks[1])])
    alloc.release(iter(blocks))
    alloc.release(blocks)
    alloc.release(blocks)
    assert alloc.num_free == 3


def test_same_block_twice_in_one_release_when_held_twice_frees_it():
    """Releasing [b, b] is fine when b is held twice: it ends free."""
    alloc = BlockAllocator(2)
    [b] = alloc.allocate(1)
    alloc.retain([b])
    alloc.release([b, b])
    assert alloc.refcount(b) == 0 and alloc.num_free == 2


def test_same_block_twice_in_one_release_when_held_once_raises_and_changes_nothing():
    """Releasing [b, b] when b is held once is a double release: CacheError, b keeps its count,
    and the other blocks in the same call are not released either."""
    alloc = BlockAllocator(4)
    [a, b] = alloc.allocate(2)
    before = snapshot(alloc)
    for bad in ([b, b], [a, b, b], [b, a, b], [a, a, a]):
        with pytest.raises(CacheError):
            alloc.release(bad)
        assert snapshot(alloc) == before
    alloc.retain([b])
    before = snapshot(alloc)
    with pytest.raises(CacheError):
        alloc.release([b, b, b])  # held twice, released three times
    assert snapshot(alloc) == before
    alloc.release([a, b, b])
    assert alloc.num_free == 4


def test_double_release_raises_and_changes_nothing():
    """Releasing a block that is already free raises CacheError (never a silent no-op) and changes
    nothing, also for the valid blocks named in the same call."""
    alloc = BlockAllocator(4)
    [a, b] = alloc.allocate(2)
    alloc.release([a])
    before = snapshot(alloc)
    with pytest.raises(CacheError):
        alloc.release([a])
    assert snapshot(alloc) == before
    with pytest.raises(CacheError):
        alloc.release([b, a])
    assert snapshot(alloc) == before
    never_used = ({0, 1, 2, 3} - {a, b}).pop()
    with pytest.raises(CacheError):
        alloc.release([never_used])
    assert snapshot(alloc) == before
    alloc.release([b])
    assert alloc.num_free == 4


def test_retain_of_a_free_block_raises_and_changes_nothing():
    """retain is for blocks in use: a free block raises CacheError and nothing is retained."""
    alloc = BlockAllocator(3)
    [a] = alloc.allocate(1)
    free = [x for x in range(3) if x != a]
    before = snapshot(alloc)
    with pytest.raises(CacheError):
        alloc.retain([free[0]])
    with pytest.raises(CacheError):
        alloc.retain([a, free[1]])
    assert snapshot(alloc) == before
    alloc.release([a])


def test_out_of_range_ids_raise_cache_error_and_change_nothing():
    """Ids outside 0..num_blocks-1 raise CacheError in retain, release and refcount; mixed with valid
    ids, nothing is changed."""
    alloc = BlockAllocator(4)
    [a] = alloc.allocate(1)
    before = snapshot(alloc)
    for bad in (-1, 4, 5, 10**12, -(10**12)):
        with pytest.raises(CacheError):
            alloc.retain([bad])
        with pytest.raises(CacheError):
            alloc.retain([a, bad])
        with pytest.raises(CacheError):
            alloc.release([bad])
        with pytest.raises(CacheError):
            alloc.release([a, bad])
        with pytest.raises(CacheError):
            alloc.refcount(bad)
        assert snapshot(alloc) == before, bad
    alloc.release([a])


def test_non_int_ids_raise_type_error_and_change_nothing():
    """Block ids must be ints (bools, floats, strings, None... raise TypeError) in retain, release and
    refcount; mixed with valid ids, nothing is changed."""
    alloc = BlockAllocator(4)
    held = alloc.allocate(2)
    before = snapshot(alloc)
    for bad in (1.0, 0.5, "0", None, True, False, b"\x00", (0,), np.float64(0.0)):
        with pytest.raises(TypeError):
            alloc.retain([bad])
        with pytest.raises(TypeError):
            alloc.retain(held + [bad])
        with pytest.raises(TypeError):
            alloc.release([bad])
        with pytest.raises(TypeError):
            alloc.release(held + [bad])
        with pytest.raises(TypeError):
            alloc.refcount(bad)
        assert snapshot(alloc) == before, bad
    alloc.release(held)


def test_errors_derive_from_cache_error():
    """OutOfBlocks and CacheError are exceptions and exported from the package top level."""
    import radixcache
    from radixcache import errors

    assert radixcache.CacheError is errors.CacheError
    assert radixcache.OutOfBlocks is errors.OutOfBlocks
    assert issubclass(CacheError, Exception)
    assert issubclass(OutOfBlocks, CacheError)


# --------------------------------------------------------------------------- random sequences

OPS = st.lists(
    st.tuples(st.sampled_from(["allocate", "retain", "release"]), st.integers(0, 7),
              st.lists(st.integers(-1, 8), max_size=4)),
    max_size=40,
)


def model_step(alloc, model, n, op, k, ids, arg=None):
    """One allocate/retain/release (of ``arg``, the same ids as ``ids`` in some container) against
    the Counter model: a valid call does exactly +1/-1 per id, an invalid one raises and changes
    nothing; afterwards every count agrees and num_free + used == num_blocks."""
    arg = ids if arg is None else arg
    before = snapshot(alloc)
    if op == "allocate":
        free = n - len(+model)
        if k > free:
            with pytest.raises(OutOfBlocks):
                alloc.allocate(k)
            assert snapshot(alloc) == before
            return
        got = alloc.allocate(k)
        assert len(set(got)) == k and not any(model[b] for b in got)
        model.update(got)
    else:
        in_range = all(0 <= b < n for b in ids)
        need = Counter(ids)
        if op == "retain":
            ok = in_range and all(model[b] >= 1 for b in ids)
        else:
            ok = in_range and all(model[b] >= c for b, c in need.items())
        if not ok:
            with pytest.raises(CacheError):
                getattr(alloc, op)(arg)
            assert snapshot(alloc) == before
            return
        getattr(alloc, op)(arg)
        if op == "retain":
            model.update(ids)
        else:
            model.subtract(ids)
    assert [alloc.refcount(b) for b in range(n)] == [model[b] for b in range(n)]
    assert alloc.refcounts().tolist() == [model[b] for b in range(n)]
    used = sum(1 for b in range(n) if model[b] > 0)
    assert alloc.num_free + used == n


@settings(max_examples=150, deadline=None, derandomize=True)
@given(OPS)
def test_allocator_matches_a_counter_model(ops):
    """Random allocate/retain/release sequences (including invalid ones) agree with a plain
    Counter model: valid calls do exactly +1/-1, invalid calls raise and change nothing, and
    num_free + used == num_blocks throughout."""
    alloc = BlockAllocator(8)
    model = Counter()
    for op, k, ids in ops:
        model_step(alloc, model, 8, op, k, ids)


# --------------------------------------------------------------------------- long calls (numpy path)

BIG = 200
BIG_OPS = st.lists(
    st.tuples(st.sampled_from(["allocate", "retain", "release"]), st.integers(0, 120),
              st.lists(st.integers(-1, BIG), min_size=40, max_size=130),
              st.sampled_from(["list", "tuple", "array", "numpy"])),
    max_size=25,
)


def as_container(ids, kind):
    """The same ids as a list, tuple, array('I') (when non-negative) or int64 numpy array."""
    if kind == "tuple":
        return tuple(ids)
    if kind == "array" and min(ids, default=0) >= 0:
        from array import array
        return array("I", ids)
    if kind == "numpy":
        return np.array(ids, dtype=np.int64)
    return list(ids)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(BIG_OPS)
def test_long_calls_match_a_counter_model(ops):
    """The same model with calls of 40-130 ids (the vectorised path), in every container: valid calls
    do exactly +1/-1 per occurrence, invalid ones (free, out of range, over-released) raise and change
    nothing; refcounts() always equals refcount() of every block."""
    alloc = BlockAllocator(BIG)
    model = Counter()
    for op, k, ids, kind in ops:
        if op != "allocate" and kind != "numpy" and not ids[0] % 3:  # mostly held ids: calls succeed
            held = sorted(+model)
            ids = [held[i % len(held)] for i in ids if i >= 0] if held else ids
        model_step(alloc, model, BIG, op, k, ids, as_container(ids, kind))


def test_long_calls_refuse_non_ints_and_bools_anywhere():
    """A bool, float or None at any position of a long call raises TypeError and changes nothing;
    so does a float or bool numpy array; a negative or too-large id raises CacheError."""
    alloc = BlockAllocator(300)
    held = alloc.allocate(200)
    before = snapshot(alloc)
    for bad in (True, False, 1.0, None, "3"):
        for at in (0, 57, 199):
            ids = list(held)
            ids[at] = bad
            for op in (alloc.retain, alloc.release, alloc.require_held):
                with pytest.raises(TypeError):
                    op(ids) if op != alloc.require_held else op(ids, "test")
            assert snapshot(alloc) == before
    for arr in (np.array(held, dtype=np.float64), np.array(held, dtype=bool), np.array([held, held])):
        with pytest.raises(TypeError):
            alloc.retain(arr)
    for bad in (-1, 300, 2**32, 10**12):
        with pytest.raises(CacheError):
            alloc.release(held[:100] + [bad])
        with pytest.raises(CacheError):
            alloc.release(np.array(held[:100] + [bad], dtype=np.int64))
    assert snapshot(alloc) == before
    alloc.release(np.array(held, dtype=np.int32))
    assert alloc.num_free == 300


def test_allocate_many_then_release_in_any_order_frees_all():
    """Large allocations come from the free list in id order and all come back."""
    alloc = BlockAllocator(10_000)
    a = alloc.allocate(6_000)
    assert a == list(range(6_000))
    b = alloc.allocate(4_000)
    alloc.retain(a[::2])
    alloc.release(a + b[::-1])
    assert alloc.num_free == 7_000
    alloc.release(a[::2])
    assert alloc.num_free == 10_000 and not alloc.refcounts().any()


def test_refcounts_is_a_read_only_view():
    alloc = BlockAllocator(4)
    [a] = alloc.allocate(1)
    view = alloc.refcounts()
    assert view.tolist() == [1, 0, 0, 0]
    with pytest.raises(ValueError):
        view[0] = 5
    alloc.release([a])
    assert alloc.refcounts().tolist() == [0, 0, 0, 0]


def test_the_allocator_holds_nothing_the_garbage_collector_tracks():
    """Counts and the free list are flat arrays: a pool of a million blocks adds two objects to a
    cyclic-GC pass and nothing inside them to walk (a list of ints would be walked item by item)."""
    import gc

    alloc = BlockAllocator(1_000_000)
    held = alloc.allocate(300_000)
    alloc.release(held[::3])
    parts = [p for p in gc.get_referents(alloc) if p is not type(alloc)]
    assert len(parts) == 2
    assert all(gc.get_referents(part) in ([], [type(part)]) for part in parts)
    alloc.release([b for i, b in enumerate(held) if i % 3])
    assert alloc.num_free == 1_000_000
