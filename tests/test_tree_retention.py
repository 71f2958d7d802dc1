"""Soft retention in the tree: ``RadixCache(..., clock=)`` and ``retain(node, until)``.

Retained paths are evicted only after every unretained block and before anything is refused; once
the clock passes the deadline they are exactly as evictable as blocks never retained (a hypothesis
differential test against a twin that never saw the hints); retention is separate from locks. The
state machine in test_tree_properties.py runs retention and a hypothesis-driven clock against its
reference model; these tests pin down the rest of the contract.
"""

import math
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixcache import BlockAllocator, CacheError, RadixCache

BS = 2


class Clock:
    """A clock the test moves by hand."""

    def __init__(self, now=0.0):
        self.now = now

    def __call__(self):
        return self.now


def make(num_blocks=32, clock=None):
    clock = clock or Clock()
    alloc = BlockAllocator(num_blocks)
    return alloc, RadixCache(alloc, block_size=BS, clock=clock), clock


def put(tree, tokens, namespace=()):
    """Insert ``tokens`` as a finished request would; return the node that ends at them."""
    blocks = tree.allocator.allocate(len(tokens) // tree.block_size)
    node = tree.adopt(tokens, blocks, namespace).node
    tree.allocator.release(blocks)
    return node


def in_tree(tree, tokens, namespace=()):
    return tree.peek(tokens, namespace)


def test_default_clock_is_monotonic_and_clock_must_be_callable():
    tree = RadixCache(BlockAllocator(4), 2)
    assert tree.clock is time.monotonic
    with pytest.raises(TypeError, match="clock"):
        RadixCache(BlockAllocator(4), 2, clock=5.0)


def test_a_retained_leaf_goes_after_every_unretained_one_and_before_refusing():
    """Oldest-first would take (1,1,...) first; retained, it outlives two newer leaves, and still
    goes when more is asked for than the unretained blocks."""
    alloc, tree, clock = make()
    old = put(tree, (1, 1, 2, 2))
    put(tree, (3, 3, 4, 4))
    put(tree, (5, 5))
    tree.keep(old, until=10.0)
    tree.check()
    assert tree.evict(3) == 3
    assert in_tree(tree, (1, 1, 2, 2)) == 4 and in_tree(tree, (3, 3)) == 0 and in_tree(tree, (5, 5)) == 0
    assert tree.evictable_blocks == 2  # retained blocks are still evictable
    assert tree.evict(1) == 1           # the retained leaf's deepest block goes first
    assert in_tree(tree, (1, 1, 2, 2)) == 2
    assert tree.evict(5) == 1 and alloc.num_free == alloc.num_blocks
    tree.check()


def test_retention_expires_into_plain_lru_order():
    alloc, tree, clock = make()
    a = put(tree, (1, 1))
    put(tree, (2, 2))
    tree.keep(a, until=5.0)
    clock.now = 4.99
    assert tree.evict(1) == 1 and in_tree(tree, (1, 1)) == 2 and in_tree(tree, (2, 2)) == 0
    put(tree, (3, 3))
    clock.now = 5.0  # the deadline is not ahead any more: (1,1) is the least recently used again
    assert tree.evict(1) == 1 and in_tree(tree, (1, 1)) == 0 and in_tree(tree, (3, 3)) == 2
    tree.check()
    tree.reset()


def test_retention_covers_the_path_and_the_parent_inherits_it():
    """retain(node) keeps root..node: once the retained leaf is gone, its parent (still on the
    retained path) goes after the unretained leaves."""
    alloc, tree, clock = make()
    leaf = put(tree, (1, 1, 2, 2))
    put(tree, (1, 1, 3, 3))            # splits: (1,1) is now a shared parent
    tree.keep(leaf, until=100.0)
    put(tree, (9, 9))
    assert tree.evict(2) == 2          # (3,3) and (9,9): the unretained ones
    assert in_tree(tree, (1, 1, 2, 2)) == 4 and in_tree(tree, (1, 1, 3, 3)) == 2
    assert tree.evict(1) == 1          # now the retained leaf
    put(tree, (7, 7))
    assert tree.evict(1) == 1          # (7,7), newer and unretained, goes before the parent
    assert in_tree(tree, (1, 1)) == 2 and in_tree(tree, (7, 7)) == 0
    tree.check()
    tree.reset()


def test_split_keeps_retention_with_the_deeper_part():
    alloc, tree, clock = make()
    node = put(tree, (1, 1, 2, 2, 3, 3))
    tree.keep(node, until=50.0)
    tree.match((1, 1))                 # splits the node; the handle keeps (2,2,3,3)
    put(tree, (8, 8))
    assert tree.evict(1) == 1 and in_tree(tree, (8, 8)) == 0
    assert in_tree(tree, (1, 1, 2, 2, 3, 3)) == 6
    assert node.alive and node.depth_tokens == 6
    tree.check()
    tree.reset()


def test_retention_only_extends():
    alloc, tree, clock = make()
    a = put(tree, (1, 1))
    put(tree, (2, 2))
    tree.keep(a, until=10.0)
    tree.keep(a, until=3.0)          # an earlier deadline does not shorten it
    clock.now = 5.0
    assert tree.evict(1) == 1 and in_tree(tree, (1, 1)) == 2
    tree.reset()


def test_retention_is_separate_from_locks():
    """A locked, retained node is pinned; unlocking does not drop the retention; retention does not
    make a node unlockable; lock semantics (unlock of an unlocked node) are unchanged."""
    alloc, tree, clock = make()
    a = put(tree, (1, 1, 2, 2))
    b = put(tree, (3, 3))
    tree.lock(a)
    tree.keep(a, until=10.0)
    assert tree.pinned_blocks == 2 and tree.evictable_blocks == 1
    assert tree.evict(10) == 1 and in_tree(tree, (1, 1, 2, 2)) == 4
    tree.unlock(a)
    with pytest.raises(CacheError):
        tree.unlock(a)
    put(tree, (3, 3))
    assert tree.evict(1) == 1 and in_tree(tree, (1, 1, 2, 2)) == 4  # still retained after unlock
    tree.keep(b if b.alive else tree.match((1, 1)).node, until=1.0)
    tree.check()
    tree.reset()
    assert alloc.num_free == alloc.num_blocks


def test_retaining_a_namespace_root_keeps_nothing():
    alloc, tree, clock = make()
    put(tree, (1, 1))
    root = tree.match((5, 5)).node
    tree.keep(root, until=100.0)
    assert tree.evict(1) == 1 and alloc.num_free == alloc.num_blocks
    tree.check()


@pytest.mark.parametrize("bad, error", [("10", TypeError), (None, TypeError), (True, TypeError),
                                        ([1.0], TypeError), (math.nan, ValueError)])
def test_bad_deadlines_are_refused_and_change_nothing(bad, error):
    alloc, tree, clock = make()
    a = put(tree, (1, 1))
    put(tree, (2, 2))
    with pytest.raises(error):
        tree.keep(a, bad)
    assert tree.evict(1) == 1 and in_tree(tree, (1, 1)) == 0  # not retained
    tree.check()
    tree.reset()


def test_retain_refuses_dead_foreign_and_non_nodes():
    alloc, tree, clock = make()
    other = make()[1]
    a = put(tree, (1, 1))
    with pytest.raises(CacheError, match="another RadixCache"):
        other.keep(a, 10.0)
    with pytest.raises(TypeError):
        tree.keep("node", 10.0)
    assert tree.evict(1) == 1
    with pytest.raises(CacheError, match="evicted"):
        tree.keep(a, 10.0)
    tree.check()


def test_infinite_deadline_retains_until_pressure():
    alloc, tree, clock = make()
    a = put(tree, (1, 1))
    put(tree, (2, 2))
    tree.keep(a, math.inf)
    clock.now = 1e12
    assert tree.evict(1) == 1 and in_tree(tree, (1, 1)) == 2
    assert tree.evict(1) == 1 and alloc.num_free == alloc.num_blocks


# --------------------------------------------------------------------------- expired == never retained

SEQS = st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=8), min_size=1, max_size=10)
BUILD = st.lists(st.tuples(st.sampled_from(["insert", "match", "lock", "unlock", "retain"]),
                           st.integers(0, 9), st.integers(-2, 6)), max_size=30)
AFTER = st.lists(st.tuples(st.sampled_from(["insert", "match", "lock", "unlock", "evict"]),
                           st.integers(0, 9), st.integers(0, 5)), max_size=30)


class Twin:
    """One tree of the differential test and the handles and locks its caller holds."""

    def __init__(self, bs):
        self.clock = Clock()
        self.alloc = BlockAllocator(64)
        self.tree = RadixCache(self.alloc, block_size=bs, clock=self.clock)
        self.handles, self.locks = [], []
        self.latest = 0.0  # the latest deadline given

    def apply(self, op, seq, a, b, hints):
        tree, alloc = self.tree, self.alloc
        node = self.handles[a % len(self.handles)] if self.handles else None
        if op == "insert" and len(seq) // tree.block_size <= alloc.num_free:
            blocks = alloc.allocate(len(seq) // tree.block_size)
            self.handles.append(tree.adopt(seq, blocks).node)
            alloc.release(blocks)
        elif op == "match":
            self.handles.append(tree.match(seq).node)
        elif op == "lock" and node is not None and node.alive:
            tree.lock(node)
            self.locks.append(node)
        elif op == "unlock" and self.locks:
            tree.unlock(self.locks.pop(a % len(self.locks)))
        elif op == "retain" and hints and node is not None and node.alive:
            tree.keep(node, self.clock.now + b)
            self.latest = max(self.latest, self.clock.now + b)
        elif op == "evict":
            return tree.evict(b), alloc.refcounts().tolist()
        tree.check()
        return None


@settings(max_examples=200, deadline=None, derandomize=True)
@given(SEQS, BUILD, st.sampled_from([0.0, 1e-9, 0.5, 100.0]), AFTER, st.sampled_from([1, 2, 4]))
def test_expired_retention_is_exactly_as_evictable_as_none(seqs, build, wait, after, bs):
    """Two trees see the same inserts, matches, locks and unlocks; only one also gets retention
    hints (some already expired when given). Once the clock has passed every deadline, both evict
    exactly the same blocks at every eviction and in a full eviction at the end: an expired hint
    leaves no trace."""
    twins = [Twin(bs), Twin(bs)]
    for op, a, b in build:
        for k, twin in enumerate(twins):
            twin.apply(op, tuple(seqs[a % len(seqs)]), a, b, hints=k == 0)
    for twin in twins:
        twin.clock.now = twins[0].latest + wait  # a deadline equal to the clock has passed
    for op, a, b in after:
        results = [twin.apply(op, tuple(seqs[a % len(seqs)]), a, b, hints=False) for twin in twins]
        assert results[0] == results[1], (op, results)
    orders = []
    for twin in twins:
        order = []
        while twin.tree.evictable_blocks:
            before = twin.alloc.refcounts().copy()
            assert twin.tree.evict(1) == 1
            order.append(int((before != twin.alloc.refcounts()).nonzero()[0][0]))
        orders.append(order)
        twin.tree.check()
    assert orders[0] == orders[1]
    for twin in twins:
        for node in twin.locks:
            twin.tree.unlock(node)
        twin.tree.reset()
        assert twin.alloc.num_free == twin.alloc.num_blocks
