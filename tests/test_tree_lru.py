"""Exact block-level LRU: which blocks a match or an insert refreshes, and the order evict follows.

``BlockLRU`` is the reference model (the property machine in test_tree_properties drives it on
random request sequences): every cached block has a last-use tick. A match uses the blocks it
returns, plus its tail block when that is a partial tail kept at the matched node (not when it is
the first block of a child that continues the query: the caller only copies from it). An insert
uses every whole block of its tokens, plus the partial tail it keeps or finds there covering its
tokens. ``evict(k)`` must drop the ``k`` least recently used evictable blocks, deepest first among
blocks used together, blocks under live retention last.

The scenario tests are vLLM's ``test_evict``: request A (5 whole blocks and a partial one) and B (3
blocks) finish, then C matches A's first 2 blocks and copies a few tokens from A's third. A's
untouched remainder must go before B. The tree before this fix refreshed the whole child C copied
from (and, on insert, the whole child covering a partial tail), so B went first.
"""

import itertools

import pytest

from radixcache import BlockAllocator, RadixCache


class BlockLRU:
    """Reference model of exact block-level LRU (see the module docstring)."""

    def __init__(self):
        self.ticks = itertools.count(1)
        self.last: dict = {}   # block -> tick of its last use
        self.depth: dict = {}  # block -> position on its path (a partial tail: below its node's last)

    def use(self, path, tail=None) -> None:
        """One use of the whole blocks ``path`` (root first) and, if given, of the partial tail below
        their last block: all at one tick."""
        tick = next(self.ticks)
        for depth, b in enumerate(path, 1):
            self.last[b], self.depth[b] = tick, depth
        if tail is not None:
            self.last[tail], self.depth[tail] = tick, len(path) + 0.5

    def forget(self, blocks) -> None:
        """Blocks that left the tree."""
        for b in blocks:
            self.last.pop(b, None)
            self.depth.pop(b, None)

    def order(self, evictable, retained=frozenset()) -> list:
        """The blocks of ``evictable`` in the order ``evict`` must drop them."""
        return sorted(evictable, key=lambda b: (b in retained, self.last[b], -self.depth[b]))


def eviction_order(tree) -> list:
    """Evict one block at a time until nothing is evictable; the blocks in the order they went."""
    held = [b for b in range(tree.allocator.num_blocks) if tree.holds(b)]
    order = []
    while tree.evict(1):
        gone = [b for b in held if not tree.holds(b) and b not in order]
        assert len(gone) == 1, f"evict(1) dropped {gone}"
        order += gone
    tree.check()
    return order


def finish(tree, tokens, model=None):
    """Play a finished request: blocks for every whole block (and one for a partial last block,
    offered as the tail), ``adopt``, release the caller's references. Returns (the tree's whole
    blocks for ``tokens``, the block offered as the tail)."""
    alloc, bs = tree.allocator, tree.block_size
    n, partial = divmod(len(tokens), bs)
    blocks = alloc.allocate(n + (partial > 0))
    tail = blocks[n] if partial else None
    got = tree.adopt(tokens, blocks[:n], tail_block=tail)
    alloc.release(blocks)
    if model is not None:
        model.use(got.blocks, tail)
    return list(got.blocks), tail


def scenario(bs):
    """A (5 blocks + a partial one) and B (3 blocks) finished, A first; C's prompt: A's first 2
    blocks and the first few tokens of A's third."""
    tree = RadixCache(BlockAllocator(32), block_size=bs)
    a_tokens = tuple(range(1000, 1000 + 5 * bs + min(7, bs - 1)))
    b_tokens = tuple(range(5000, 5000 + 3 * bs))
    model = BlockLRU()
    a, a_tail = finish(tree, a_tokens, model)
    b, _ = finish(tree, b_tokens, model)
    c_tokens = a_tokens[:2 * bs + min(5, bs - 1)]
    return tree, model, a, a_tail, b, c_tokens


BLOCK_SIZES = [2, 4, 16]


def start_c(tree, c_tokens, a):
    """C's admission: match, lock, hold the matched blocks, copy the partial block it continues
    into a fresh block of its own (copy on write). Returns (match, C's own references)."""
    alloc, bs = tree.allocator, tree.block_size
    m = tree.match(c_tokens)
    assert (m.length, m.blocks) == (2 * bs, tuple(a[:2]))
    assert (m.tail_length, m.tail_block) == (min(5, bs - 1), a[2])  # copied from A's third block
    tree.lock(m.node)
    alloc.retain(m.blocks)
    alloc.retain([m.tail_block])
    own = alloc.allocate(1)
    alloc.release([m.tail_block])
    return m, list(m.blocks) + own


@pytest.mark.parametrize("bs", BLOCK_SIZES)
def test_a_running_request_that_copied_a_partial_block_leaves_the_rest_of_that_node_oldest(bs):
    """C runs (its 2 matched blocks locked): eviction takes A's tail, A[4], A[3], A[2], then B's
    blocks deepest first, and nothing of C's path."""
    tree, model, a, a_tail, b, c_tokens = scenario(bs)
    m, held = start_c(tree, c_tokens, a)
    model.use(m.blocks)
    expected = [a_tail, a[4], a[3], a[2], b[2], b[1], b[0]]
    assert model.order(expected) == expected
    assert eviction_order(tree) == expected
    assert tree.pinned_blocks == 2 and tree.evictable_blocks == 0
    tree.unlock(m.node)
    tree.allocator.release(held)
    assert eviction_order(tree) == [a[1], a[0]]


@pytest.mark.parametrize("bs", BLOCK_SIZES)
def test_an_aborted_request_that_copied_a_partial_block_refreshed_only_what_it_matched(bs):
    """C aborts (unlocked and released without inserting): A's untouched remainder goes first, then
    B, then the 2 blocks C matched."""
    tree, model, a, a_tail, b, c_tokens = scenario(bs)
    m, held = start_c(tree, c_tokens, a)
    tree.unlock(m.node)
    tree.allocator.release(held)
    model.use(m.blocks)
    expected = [a_tail, a[4], a[3], a[2], b[2], b[1], b[0], a[1], a[0]]
    assert model.order(expected) == expected
    assert eviction_order(tree) == expected


@pytest.mark.parametrize("bs", BLOCK_SIZES)
def test_an_insert_whose_tail_a_child_covers_refreshes_only_its_whole_blocks(bs):
    """D (A's first 2 blocks and a few tokens of A's third, with a tail block) finishes: a child
    covers its tail, so the tail is not kept and nothing of that child is refreshed."""
    tree, model, a, a_tail, b, c_tokens = scenario(bs)
    got, d_tail = finish(tree, c_tokens)
    assert got == a[:2] and not tree.holds(d_tail)
    expected = [a_tail, a[4], a[3], a[2], b[2], b[1], b[0], a[1], a[0]]
    assert eviction_order(tree) == expected


@pytest.mark.parametrize("bs", BLOCK_SIZES)
def test_a_block_aligned_match_refreshes_the_same_blocks(bs):
    """The same with C's prompt ending at A's second block (no partial block to copy)."""
    tree, model, a, a_tail, b, _ = scenario(bs)
    m = tree.match(tuple(range(1000, 1000 + 2 * bs)))
    assert m.blocks == tuple(a[:2]) and m.tail_block is None
    assert eviction_order(tree) == [a_tail, a[4], a[3], a[2], b[2], b[1], b[0], a[1], a[0]]


@pytest.mark.parametrize("bs", BLOCK_SIZES)
def test_a_match_or_insert_that_uses_a_kept_partial_tail_refreshes_it(bs):
    """The partial tail kept at a node is one block of its own: a match that copies from it, or an
    insert whose tokens it covers, uses it with the path above it."""
    for how in ("match", "insert"):
        tree = RadixCache(BlockAllocator(16), block_size=bs)
        model = BlockLRU()
        a_tokens = tuple(range(100, 100 + 2 * bs + bs - 1))
        a, a_tail = finish(tree, a_tokens, model)
        b, _ = finish(tree, tuple(range(500, 500 + bs)), model)
        short = a_tokens[:2 * bs + 1]
        if how == "match":
            m = tree.match(short)
            assert (m.blocks, m.tail_block) == (tuple(a), a_tail)
        else:
            got, mine = finish(tree, short)
            assert got == a and not tree.holds(mine)
        model.use(a, a_tail)
        expected = [b[0], a_tail, a[1], a[0]]
        assert model.order(expected) == expected
        assert eviction_order(tree) == expected, how
