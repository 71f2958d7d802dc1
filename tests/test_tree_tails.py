"""Partial tails and ``adopt``: the end of a finished sequence kept copy-on-write, and one-walk inserts.

Error tests assert the exception type and an unchanged snapshot (see test_tree_errors.snapshot).
"""

import pytest

from radixcache import Adopted, BlockAllocator, CacheError, RadixCache
from test_tree_errors import QUERIES, snapshot

BS = 4


def make(num_blocks=16):
    alloc = BlockAllocator(num_blocks)
    return alloc, RadixCache(alloc, block_size=BS)


def finish(tree, tokens, namespace=()):
    """Play a finished request: blocks for every whole block plus one for the partial tail,
    adopt them with the tail, release the caller's references. Returns (Adopted, tail block)."""
    alloc = tree.allocator
    n = len(tokens) // BS
    blocks = alloc.allocate(n + 1)
    got = tree.adopt(tokens, blocks[:n], namespace, tail_block=blocks[n])
    alloc.release(blocks)
    return got, blocks[n]


def test_a_finished_turn_keeps_its_tail_for_the_next_turn():
    """Turn 1 ends 2 tokens into a block: the next turn's match reports those 2 tokens in the tail
    block, after the whole blocks, and the tree keeps holding it."""
    alloc, tree = make()
    turn1 = tuple(range(10, 20))  # 2 whole blocks + 2 tokens
    got, tail = finish(tree, turn1)
    assert isinstance(got, Adopted) and got.cached == 0 and got.node.depth_tokens == 8
    assert alloc.refcount(tail) == 1 and tree.cached_blocks == 3
    m = tree.match(turn1 + (7, 7, 7))
    assert (m.length, m.tail_length, m.tail_block) == (8, 2, tail)
    assert m.node is got.node
    # the tail never covers a token the query does not have
    m = tree.match(turn1[:9])
    assert (m.length, m.tail_length) == (8, 1)
    tree.check()


def test_tail_is_replaced_when_different_or_longer_and_kept_when_it_covers():
    alloc, tree = make()
    base = tuple(range(8))
    _, first = finish(tree, base + (1, 2))
    _, shorter = finish(tree, base + (1,))          # covered by the tail there: not adopted
    assert alloc.refcount(shorter) == 0 and alloc.refcount(first) == 1
    _, longer = finish(tree, base + (1, 2, 3))      # longer: replaces it
    assert alloc.refcount(first) == 0 and alloc.refcount(longer) == 1
    _, other = finish(tree, base + (5,))            # different: the newest wins
    assert alloc.refcount(longer) == 0 and alloc.refcount(other) == 1
    assert tree.match(base + (5, 0)).tail_block == other
    assert tree.cached_blocks == 3
    tree.check()


def test_a_whole_block_child_drops_the_tail_it_covers_and_blocks_new_ones():
    alloc, tree = make()
    base = tuple(range(8))
    _, tail = finish(tree, base + (1, 2))
    blocks = alloc.allocate(3)
    tree.insert(base + (1, 2, 3, 4), blocks)       # a whole block (1, 2, 3, 4) covers (1, 2)
    alloc.release(blocks)
    assert alloc.refcount(tail) == 0
    _, again = finish(tree, base + (1, 2, 3))      # covered by that child: not kept
    assert alloc.refcount(again) == 0
    m = tree.match(base + (1, 2, 3, 9))            # a diverging child's first block serves as tail
    assert (m.length, m.tail_length, m.tail_block) == (8, 3, tree.match(base + (1, 2, 3, 4)).blocks[2])
    tree.check()


def test_tails_are_evicted_first_and_never_pinned():
    alloc, tree = make(8)
    got, tail = finish(tree, tuple(range(6)))
    tree.lock(got.node)
    assert tree.pinned_blocks == 1 and tree.evictable_blocks == 1
    assert tree.evict(5) == 1 and alloc.refcount(tail) == 0  # only the tail could go
    assert tree.match(tuple(range(6))).tail_length == 0
    tree.unlock(got.node)
    tree.check()
    tree.reset()
    assert alloc.num_free == 8 and tree.leaks() == []


def test_a_tail_at_the_namespace_root():
    alloc, tree = make()
    got, tail = finish(tree, (5, 6), ("ns",))
    assert got.node.parent is None and got.blocks == ()
    m = tree.match((5, 6, 7), ("ns",))
    assert (m.length, m.tail_length, m.tail_block) == (0, 2, tail)
    assert tree.match((5, 6, 7)).tail_length == 0  # another namespace sees nothing
    tree.reset()
    assert alloc.num_free == 16


def test_adopt_returns_the_trees_blocks_where_the_content_was_cached():
    alloc, tree = make()
    tokens = tuple(range(12))
    mine = alloc.allocate(3)
    first = tree.adopt(tokens, mine)
    assert first == Adopted(0, first.node, tuple(mine))
    dup = alloc.allocate(3)
    again = tree.adopt(tokens, dup)
    assert again.cached == 12 and again.blocks == tuple(mine) and again.node is first.node
    assert [alloc.refcount(b) for b in dup] == [1, 1, 1]  # the caller's duplicates are untouched
    alloc.release(mine + dup)
    tree.check()


@pytest.fixture
def tree():
    """The error tests' tree (block size 2, A, B, C inserted), from test_tree_errors."""
    from test_tree_errors import INSERTED, NUM_BLOCKS, put
    t = RadixCache(BlockAllocator(NUM_BLOCKS), block_size=2)
    for tokens, ns in INSERTED:
        put(t, tokens, ns)
    return t


@pytest.mark.parametrize("case", ["whole tokens", "tail in blocks", "free tail", "tree's tail",
                                  "not an int", "out of range"])
def test_bad_tail_block_raises_and_changes_nothing(tree, case):
    alloc = tree.allocator
    held = alloc.allocate(3)
    free = next(b for b in range(alloc.num_blocks) if alloc.refcount(b) == 0)
    tokens, blocks, tail, kind = (1, 2, 9), held[:1], held[2], None
    if case == "whole tokens":
        tokens, blocks, kind = (1, 2, 9, 9), held[:2], ValueError
    elif case == "tail in blocks":
        tail, kind = blocks[0], CacheError
    elif case == "free tail":
        tail, kind = free, CacheError
    elif case == "tree's tail":
        tail, kind = tree.match((1, 2)).blocks[0], CacheError
    elif case == "not an int":
        tail, kind = "3", TypeError
    else:
        tail, kind = alloc.num_blocks, CacheError
    before = snapshot(tree, QUERIES)
    with pytest.raises(kind):
        tree.insert(tokens, blocks, (), tail_block=tail)
    assert snapshot(tree, QUERIES) == before
    alloc.release(held)


def test_a_tail_node_cannot_be_locked():
    alloc, tree = make()
    finish(tree, (1, 2, 3, 4, 5))
    tail = next(n for n in tree.nodes() if len(n.key) < BS)
    with pytest.raises(CacheError, match="tail"):
        tree.lock(tail)
    tree.check()
