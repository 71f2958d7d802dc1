"""The compact tree at production shapes: nothing the garbage collector walks grows with the tree,
token ids are unsigned 32-bit, long prompts and long block lists (the vectorised paths) behave like
short ones, errors in long calls change nothing, and node handles are unique while held."""

import gc
from array import array

import numpy as np
import pytest

from radixcache import BlockAllocator, CacheError, RadixCache


def build(tree, n, length, seed=0):
    """Insert ``n`` sequences of ``length`` tokens sharing 3 prefixes, some with a partial tail."""
    rng = np.random.default_rng(seed)
    alloc, bs = tree.allocator, tree.block_size
    prefixes = rng.integers(0, 2**32, size=(3, length // 2), dtype=np.uint32)
    for i in range(n):
        own = rng.integers(0, 2**32, length - length // 2, dtype=np.uint32)
        tokens = np.concatenate([prefixes[i % 3], own])
        tail = i % 2 and length % bs
        blocks = alloc.allocate(length // bs + bool(tail))
        tree.adopt(tokens, blocks[:length // bs], tail_block=blocks[-1] if tail else None)
        alloc.release(blocks)


def tracked_objects(n):
    """Objects a cyclic-GC pass walks that a tree of ``n`` sequences adds, and the tree."""
    gc.collect()
    before = len(gc.get_objects())
    tree = RadixCache(BlockAllocator(n * 9 + 16), block_size=16)
    build(tree, n, 136)
    gc.collect()
    return len(gc.get_objects()) - before, tree


def test_the_collector_tracks_a_constant_number_of_objects_whatever_the_size():
    """A tree of 300 or 3,000 sequences (thousands of nodes, tens of thousands of blocks and tokens)
    adds the same few dozen objects to what a cyclic-GC pass walks: nodes are rows of flat arrays,
    tokens and block ids are bytes, child tables are dicts of bytes to ints (untracked by CPython)."""
    tracked_objects(30)  # first use: numpy and friends create their own objects once
    for n in (300, 3000):
        added, tree = tracked_objects(n)
        assert sum(1 for _ in tree.nodes()) > n
        assert added < 60, f"{added} tracked objects for {n} sequences"
        assert all(not gc.is_tracked(d) for d in tree.node_table.kids if d is not None)
        tree.check()
        tree.reset()


def test_tokens_are_unsigned_32_bit_in_every_container():
    alloc = BlockAllocator(8)
    tree = RadixCache(alloc, block_size=2)
    top = 2**32 - 1
    tokens = [top, 0, 7, top]
    blocks = alloc.allocate(2)
    tree.insert(tokens, blocks)
    for same in (tuple(tokens), array("I", tokens), np.array(tokens, dtype=np.uint32),
                 np.array(tokens, dtype=np.int64), array("q", tokens)):
        m = tree.match(same)
        assert (m.length, m.blocks) == (4, tuple(blocks))
    for bad in ([2**32, 1], np.array([2**32], dtype=np.int64), array("q", [-1]), array("d", [1.0])):
        with pytest.raises((ValueError, TypeError)):
            tree.match(bad)
    alloc.release(blocks)
    tree.reset()


def test_a_191k_token_prompt_round_trips():
    """The longest Mooncake prompt: 11,961 blocks inserted, matched whole, matched one block short
    (splitting its node), and evicted."""
    n = 191_378
    alloc = BlockAllocator(n // 16 + 8)
    tree = RadixCache(alloc, block_size=16)
    tokens = np.random.default_rng(1).integers(0, 2**32, n, dtype=np.uint32)
    blocks = alloc.allocate(n // 16)
    assert tree.insert(tokens, blocks) == 0
    alloc.release(blocks)
    m = tree.match(tokens)
    assert m.length == n // 16 * 16 and m.blocks == tuple(blocks)
    other = tokens.copy()
    other[-1000] ^= 1
    m = tree.match(other)
    assert m.length == (n - 1000) // 16 * 16 and m.blocks == tuple(blocks[:len(m.blocks)])
    tree.check()
    assert tree.evict(10**9) == n // 16 and alloc.num_free == alloc.num_blocks


@pytest.mark.parametrize("case", ["duplicate", "free", "owned", "out of range"])
def test_long_inserts_refuse_bad_ids_and_change_nothing(case):
    """The checks of long calls (numpy) refuse what the short ones refuse, changing nothing."""
    alloc = BlockAllocator(1200)
    tree = RadixCache(alloc, block_size=4)
    base = list(range(4 * 300))
    mine = alloc.allocate(300)
    tree.insert(base, mine)
    held = alloc.allocate(400)
    blocks = list(mine) + held  # 700 blocks for 2,800 tokens: the first 300 are cached already
    free = next(b for b in range(alloc.num_blocks) if alloc.refcount(b) == 0)
    if case == "duplicate":
        blocks[500] = blocks[600]
    elif case == "free":
        blocks[650] = free
    elif case == "owned":
        blocks[650] = mine[10]
    else:
        blocks[650] = 5000
    before = (alloc.refcounts().tolist(), tree.cached_blocks, tree.match(base).blocks)
    with pytest.raises(CacheError):
        tree.insert(base + list(range(10_000, 10_000 + 1600)), blocks)
    assert (alloc.refcounts().tolist(), tree.cached_blocks, tree.match(base).blocks) == before
    alloc.release(mine + held)
    tree.check()
    tree.reset()


def test_handles_are_unique_while_held_and_stale_after_reuse():
    alloc = BlockAllocator(8)
    tree = RadixCache(alloc, block_size=2)
    blocks = alloc.allocate(2)
    tree.insert((1, 1, 2, 2), blocks)
    alloc.release(blocks)
    a = tree.match((1, 1, 2, 2)).node
    assert tree.match((1, 1, 2, 2)).node is a and a == tree.match((1, 1, 2, 2)).node
    assert tree.evict(10) == 2 and not a.alive
    blocks = alloc.allocate(2)
    tree.insert((3, 3, 4, 4), blocks)  # may reuse the freed node id
    alloc.release(blocks)
    b = tree.match((3, 3, 4, 4)).node
    assert b is not a and b != a and b.alive and not a.alive
    with pytest.raises(CacheError, match="evicted"):
        tree.lock(a)
    tree.reset()


def test_common_prefix_over_any_mix_of_sequence_types():
    """``tokens.common_prefix`` gives the same length for lists, tuples, arrays and numpy arrays in
    any mix (a list never equals a tuple in Python, so a naive slice compare would say 0)."""
    from radixcache.tokens import common_prefix

    a = list(range(100))
    b = a[:57] + [999] + a[58:]
    forms = (list, tuple, lambda x: array("I", x), np.array)
    for fa in forms:
        for fb in forms:
            assert common_prefix(fa(a), fb(b)) == 57
            assert common_prefix(fa(a), fb(a[:10])) == 10
    assert common_prefix([], [1]) == 0 and common_prefix([1, 2], [3]) == 0
