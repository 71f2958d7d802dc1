"""Error paths of RadixCache, plus namespaces, mid-node splits and LRU eviction order.

Every error test asserts the exception type AND that nothing observable changed: ``snapshot`` takes
every block's reference count, num_free, cached/pinned/evictable counts and the result of ``match``
on everything inserted before (it also runs ``check()``).
"""

import numpy as np
import pytest
import torch

from radixcache import BlockAllocator, CacheError, RadixCache

BS = 2
NUM_BLOCKS = 16
NS_B = ("model-b", "tenant-1")

# What the populated tree holds (block size 2): in the default namespace A and B share [1, 2];
# NS_B holds C, which repeats A's first tokens (namespaces never share anything).
A = (1, 2, 3, 4, 5, 6)
B = (1, 2, 7, 8)
C = (1, 2, 3, 4)
INSERTED = [(A, ()), (B, ()), (C, NS_B)]
# Queries whose match results the snapshot compares (hits, partial hits, misses, tails).
QUERIES = INSERTED + [(A + (9,), ()), (A[:5], ()), ((1, 2, 3, 9), ()), ((5, 6), ()),
                      (A, NS_B), (B, NS_B), (C, ()), ((), ()), ((1,), ())]


def put(tree, tokens, namespace=()):
    """Play a caller: allocate blocks for ``tokens``, insert them, release the caller's references."""
    blocks = tree.allocator.allocate(len(tokens) // tree.block_size)
    cached = tree.insert(tokens, blocks, namespace)
    tree.allocator.release(blocks)
    return cached


def snapshot(tree, queries=QUERIES):
    """Everything the error tests compare before and after a failing call."""
    tree.check()
    alloc = tree.allocator
    return {
        "refcounts": tuple(alloc.refcount(b) for b in range(alloc.num_blocks)),
        "num_free": alloc.num_free,
        "cached": tree.cached_blocks,
        "pinned": tree.pinned_blocks,
        "evictable": tree.evictable_blocks,
        "matches": tuple((q, ns, m.length, m.blocks)
                         for q, ns in queries for m in [tree.match(q, ns)]),
    }


@pytest.fixture
def tree():
    """A RadixCache (block size 2, 16 blocks) holding A and B in the default namespace, C in NS_B."""
    t = RadixCache(BlockAllocator(NUM_BLOCKS), block_size=BS)
    for tokens, ns in INSERTED:
        put(t, tokens, ns)
    assert t.cached_blocks == 3 + 1 + 2
    t.check()
    return t


def tree_block(tree, tokens, namespace=(), index=-1):
    """The tree's block at ``index`` on the path of ``tokens``."""
    return tree.match(tokens, namespace).blocks[index]


def free_block(tree):
    """Some block id with reference count 0."""
    alloc = tree.allocator
    return next(b for b in range(alloc.num_blocks) if alloc.refcount(b) == 0)


# =========================================================================== insert: block ids

def test_insert_out_of_range_block_id(tree):
    """A block id outside 0..num_blocks-1 (anywhere in the list) raises CacheError; nothing changes."""
    held = tree.allocator.allocate(1)
    a = list(tree.match(A).blocks)
    before = snapshot(tree)
    for bad in (-1, NUM_BLOCKS, NUM_BLOCKS + 7, 10**9):
        for blocks in ([held[0], bad], [bad, held[0]]):
            with pytest.raises(CacheError):
                tree.insert((9, 9, 8, 8), blocks)
        with pytest.raises(CacheError):
            tree.insert(A + (9, 9), a + [bad])
        assert snapshot(tree) == before, bad
    tree.allocator.release(held)


def test_insert_free_block_id(tree):
    """A block the caller does not hold (count 0) raises CacheError, even at an already-cached
    position; nothing changes and the free block stays free."""
    held = tree.allocator.allocate(1)
    free = free_block(tree)
    before = snapshot(tree)
    with pytest.raises(CacheError):
        tree.insert((9, 9, 8, 8), [held[0], free])
    with pytest.raises(CacheError):
        tree.insert(B, [free, held[0]])  # position 0 is cached: still refused
    with pytest.raises(CacheError):
        tree.insert(A + (9, 9), [tree_block(tree, A, (), i) for i in range(3)] + [free])
    assert snapshot(tree) == before
    assert tree.allocator.refcount(free) == 0
    tree.allocator.release(held)


def test_insert_wrong_number_of_blocks(tree):
    """len(blocks) must be len(tokens) // block_size: anything else raises ValueError; nothing changes."""
    held = tree.allocator.allocate(4)
    before = snapshot(tree)
    for tokens, nblocks in [((9, 9, 8, 8), 1), ((9, 9, 8, 8), 3), ((9, 9, 8, 8, 7), 3),
                            ((9, 9, 8, 8, 7), 1), ((9,), 1), ((), 1), ((9, 9), 0), (A, 2), (A, 4)]:
        with pytest.raises(ValueError):
            tree.insert(tokens, held[:nblocks])
        assert snapshot(tree) == before, (tokens, nblocks)
    tree.allocator.release(held)


def test_insert_duplicate_block_ids(tree):
    """The same block id twice in one insert raises CacheError; nothing changes."""
    held = tree.allocator.allocate(2)
    a0 = tree_block(tree, A, (), 0)
    before = snapshot(tree)
    with pytest.raises(CacheError):
        tree.insert((9, 9, 8, 8), [held[0], held[0]])
    with pytest.raises(CacheError):
        tree.insert((9, 9, 8, 8, 7, 7), [held[0], held[1], held[0]])
    with pytest.raises(CacheError):
        tree.insert(A + (9, 9), [a0, tree_block(tree, A, (), 1), tree_block(tree, A, (), 2), a0])
    assert snapshot(tree) == before
    tree.allocator.release(held)


def test_insert_blocks_owned_by_the_tree_elsewhere(tree):
    """A new position may not adopt a block the tree already holds at another position (same
    namespace, new branch or extension, or another namespace): CacheError, nothing changes. The last
    case makes insert's walk end in the middle of a node first."""
    held = tree.allocator.allocate(2)
    a = tree.match(A).blocks
    b = tree.match(B).blocks
    c = tree.match(C, NS_B).blocks
    before = snapshot(tree)
    cases = [
        ((9, 9, 8, 8), (), [held[0], a[2]]),          # new branch, block of A's leaf
        ((9, 9, 8, 8), (), [a[0], held[0]]),          # new branch, block of the shared prefix
        (A + (9, 9), (), [a[0], a[1], a[2], b[1]]),   # extension of A with B's block
        (A, NS_B, [c[0], c[1], a[2]]),               # another namespace: A's block
        (A, ("other",), list(a)),                     # a new namespace may not share A's blocks
        ((1, 2, 3, 4, 9, 9), (), [held[0], held[1], c[1]]),  # splits A's node, then refuses
    ]
    for tokens, ns, blocks in cases:
        with pytest.raises(CacheError):
            tree.insert(tokens, blocks, ns)
        assert snapshot(tree) == before, (tokens, ns, blocks)
    tree.allocator.release(held)


def test_insert_non_int_block_ids(tree):
    """Block ids that are not ints raise TypeError; nothing changes."""
    held = tree.allocator.allocate(1)
    before = snapshot(tree)
    for bad in (1.5, "1", None, [0], np.float32(1.0)):
        with pytest.raises(TypeError):
            tree.insert((9, 9, 8, 8), [held[0], bad])
        assert snapshot(tree) == before, bad
    tree.allocator.release(held)


# =========================================================================== tokens

NON_INT_TOKENS = {
    "floats": [1.0, 2.0, 3.0, 4.0],
    "one-float": [1, 2, 3.5, 4],
    "str": "abcd",
    "bytes": b"abcd",
    "list-of-str": ["a", "b", "c", "d"],
    "none": [1, None, 3, 4],
    "complex": [1, 2, 3, 4j],
    "numpy-float-scalar": [1, 2, 3, np.float64(4.0)],
    "numpy-float": np.array([1.0, 2.0, 3.0, 4.0]),
    "torch-float32": torch.tensor([1.0, 2.0, 3.0, 4.0]),
    "torch-bf16": torch.tensor([1, 2, 3, 4], dtype=torch.bfloat16),
    "torch-fp16": torch.tensor([1, 2, 3, 4], dtype=torch.float16),
    "torch-bool": torch.tensor([True, False, True, True]),
}


def test_non_integer_tokens(tree):
    """Non-integer tokens (floats, strings, float/bool tensors...) raise TypeError in match, peek and
    insert; nothing changes (the stats included)."""
    held = tree.allocator.allocate(2)
    before = snapshot(tree)
    stats = (tree.stats.queried_tokens, tree.stats.hit_tokens, tree.stats.inserted_tokens)
    for name, tokens in NON_INT_TOKENS.items():
        with pytest.raises(TypeError):
            tree.match(tokens)
        with pytest.raises(TypeError):
            tree.match(tokens, NS_B)
        with pytest.raises(TypeError):
            tree.peek(tokens)
        with pytest.raises(TypeError):
            tree.insert(tokens, held)
        assert (tree.stats.queried_tokens, tree.stats.hit_tokens,
                tree.stats.inserted_tokens) == stats, name
    assert snapshot(tree) == before
    tree.allocator.release(held)


NEGATIVE_TOKENS = {
    "first": [-1, 2, 3, 4],
    "last": [1, 2, 3, -4],
    "in-tail": [1, 2, -3],
    "numpy": np.array([1, 2, -1, 4]),
    "torch": torch.tensor([1, 2, 3, -7]),
    "large": (1, 2) + (-(2**40),) + (4,),
}


def test_negative_tokens(tree):
    """Negative tokens (also in the ignored tail) raise ValueError in match, peek and insert; nothing
    changes."""
    held = tree.allocator.allocate(2)
    before = snapshot(tree)
    for name, tokens in NEGATIVE_TOKENS.items():
        with pytest.raises(ValueError):
            tree.match(tokens)
        with pytest.raises(ValueError):
            tree.peek(tokens)
        with pytest.raises(ValueError):
            tree.insert(tokens, held[:len(tokens) // BS])
        assert snapshot(tree) == before, name
    tree.allocator.release(held)


def test_two_dimensional_tensor_tokens(tree):
    """A 2-D tensor of tokens is refused with ValueError; nothing changes."""
    held = tree.allocator.allocate(2)
    before = snapshot(tree)
    with pytest.raises(ValueError):
        tree.match(torch.tensor([[1, 2, 3, 4]]))
    with pytest.raises(ValueError):
        tree.insert(np.array([[1, 2], [3, 4]]), held)
    assert snapshot(tree) == before
    tree.allocator.release(held)


def test_integer_containers_are_equivalent(tree):
    """A list, tuple, numpy int array and torch int tensor of the same tokens match the same way."""
    expected = tree.match(A)
    assert expected.length == 6
    for tokens in (list(A), A, np.array(A, dtype=np.int64), np.array(A, dtype=np.int32),
                   torch.tensor(A), torch.tensor(A, dtype=torch.int32)):
        m = tree.match(tokens)
        assert (m.length, m.blocks) == (expected.length, expected.blocks)


def test_peek_agrees_with_match_and_has_no_side_effect():
    """peek returns match's length without splitting, refreshing recency or counting stats: a peek of
    the oldest leaf does not save it from eviction."""
    alloc, tree = make_tree()
    put(tree, (1, 1, 2, 2, 3, 3))
    put(tree, (4, 4))
    nodes = sum(1 for _ in tree.nodes())
    stats = (tree.stats.queried_tokens, tree.stats.hit_tokens)
    for q, ns in [((1, 1, 2, 2, 3, 3, 9), ()), ((1, 1, 2, 2), ()), ((1, 1, 2, 9), ()), ((1,), ()),
                  ((4, 4), ()), ((4, 4), NS_B), ((5, 5), ("never-used",)), ((), ())]:
        expected = {(1, 1, 2, 2, 3, 3, 9): 6, (1, 1, 2, 2): 4, (1, 1, 2, 9): 2, (4, 4): 2}.get(q, 0)
        assert tree.peek(q, ns) == (expected if ns == () else 0), (q, ns)
    assert sum(1 for _ in tree.nodes()) == nodes  # no split
    assert (tree.stats.queried_tokens, tree.stats.hit_tokens) == stats
    assert tree.evict(3) == 3  # (1,1,2,2,3,3) is older than (4,4) despite the peeks
    assert tree.peek((4, 4)) == 2 and tree.peek((1, 1, 2, 2, 3, 3)) == 0
    assert tree.match((1, 1, 2, 2, 3, 3)).length == 0
    assert tree.evict(100) == 1 and alloc.num_free == 16


# =========================================================================== namespaces

def test_bad_namespace(tree):
    """A namespace that is not a hashable tuple raises TypeError in match, peek and insert; nothing
    changes."""
    held = tree.allocator.allocate(2)
    before = snapshot(tree)
    for bad in ([], ["model-b"], list(NS_B), "model-b", None, 0, {"m": 1}, (["unhashable"],)):
        with pytest.raises(TypeError):
            tree.match(A, bad)
        with pytest.raises(TypeError):
            tree.peek(A, bad)
        with pytest.raises(TypeError):
            tree.insert((9, 9, 8, 8), held, bad)
        assert snapshot(tree) == before, bad
    tree.allocator.release(held)


def test_namespaces_are_isolated():
    """Same namespace hits; a different namespace misses even for identical tokens; inserting the same
    tokens in both gives two disjoint sets of blocks, and neither namespace sees the other's blocks."""
    alloc = BlockAllocator(12)
    tree = RadixCache(alloc, block_size=BS)
    ns_a, ns_b = ("model-x", "tenant-a"), ("model-x", "tenant-b")
    tokens = (5, 6, 7, 8, 9, 10, 11)

    blocks_a = alloc.allocate(3)
    assert tree.insert(tokens, blocks_a, ns_a) == 0
    hit = tree.match(tokens, ns_a)
    assert (hit.length, hit.blocks) == (6, tuple(blocks_a))
    for other in (ns_b, (), ("model-x",), ("model-x", "tenant-a", "adapter")):
        miss = tree.match(tokens, other)
        assert (miss.length, miss.blocks) == (0, ())
        # The miss still returns a lockable handle (the namespace root).
        tree.lock(miss.node)
        tree.unlock(miss.node)

    blocks_b = alloc.allocate(3)
    assert tree.insert(tokens, blocks_b, ns_b) == 0  # nothing counted as cached from ns_a
    alloc.release(blocks_a)
    alloc.release(blocks_b)
    in_a = tree.match(tokens, ns_a).blocks
    in_b = tree.match(tokens, ns_b).blocks
    assert in_a == tuple(blocks_a) and in_b == tuple(blocks_b)
    assert not set(in_a) & set(in_b)
    assert tree.cached_blocks == 6
    # A shared prefix in one namespace does not leak into the other at any depth.
    extra = alloc.allocate(4)
    assert tree.insert(tokens[:4] + (1, 1, 2, 2), list(in_b[:2]) + extra[:2], ns_b) == 4
    assert tree.match(tokens[:4] + (1, 1, 2, 2), ns_a).length == 4
    assert tree.match(tokens[:4] + (1, 1, 2, 2), ns_b).length == 8
    # Adopting ns_b's blocks into ns_a is refused even where the tokens are identical.
    before = snapshot(tree, [(tokens, ns_a), (tokens, ns_b)])
    with pytest.raises(CacheError):
        tree.insert(tokens[:4] + (1, 1, 2, 2), list(in_a[:2]) + [tree_block(tree, tokens[:4] + (1, 1), ns_b)]
                    + [extra[2]], ns_a)
    assert snapshot(tree, [(tokens, ns_a), (tokens, ns_b)]) == before
    alloc.release(extra)
    # Evicting everything frees every block of both namespaces.
    assert tree.evict(100) == 8
    assert alloc.num_free == 12
    tree.check()


# =========================================================================== lock / unlock

def test_unlock_of_an_unlocked_node(tree):
    """unlock of a node that is not locked (a leaf, an inner node, a namespace root), or one time more
    than it was locked, raises CacheError; nothing changes."""
    leaf = tree.match(A).node
    inner = tree.match(A[:2]).node
    root = tree.match((99, 99)).node
    before = snapshot(tree)
    for node in (leaf, inner, root):
        with pytest.raises(CacheError):
            tree.unlock(node)
        assert snapshot(tree) == before
    tree.lock(leaf)
    tree.lock(leaf)
    locked = snapshot(tree)
    assert locked["pinned"] == 3
    tree.unlock(leaf)
    tree.unlock(leaf)
    assert snapshot(tree) == before
    with pytest.raises(CacheError):
        tree.unlock(leaf)
    assert snapshot(tree) == before


@pytest.mark.parametrize("which", ["ancestor", "root", "split-upper"])
def test_unlock_of_a_node_pinned_only_by_a_locked_descendant(tree, which):
    """A node on a locked path that was never locked itself (an ancestor of the locked node, the
    namespace root, or the upper half split off the locked node afterwards) is not locked: unlock
    raises CacheError and changes nothing. (Regression: unlock used to check the path count, so this
    succeeded and broke the lock counts and evictable_blocks.)"""
    child = tree.match(A).node
    tree.lock(child)
    if which == "ancestor":
        ancestor = tree.match(A[:2]).node
    elif which == "root":
        ancestor = tree.match((99, 99)).node
    else:
        ancestor = tree.match(A[:4]).node  # splits the locked node: the handle keeps [5, 6]
        assert ancestor is not child and tree.match(A).node is child
    before = snapshot(tree)
    unlocked_wrongly = True
    try:
        tree.unlock(ancestor)
    except CacheError:
        unlocked_wrongly = False
    if unlocked_wrongly:
        tree.lock(ancestor)  # undo the wrong unlock so the test can clean up
    after = snapshot(tree)
    tree.unlock(child)
    assert not unlocked_wrongly, f"unlock of a never-locked {which} did not raise"
    assert after == before
    assert tree.pinned_blocks == 0 and tree.evictable_blocks == 6
    assert tree.evict(100) == 6 and tree.allocator.num_free == NUM_BLOCKS


def test_lock_and_unlock_of_an_evicted_node(tree):
    """lock/unlock of a node that eviction removed raises CacheError; nothing changes."""
    leaf = tree.match(B).node
    split_lower = tree.match(A).node
    tree.match(A[:4])  # splits A's node: the handle keeps the deeper part
    assert tree.evict(100) == 6
    for dead in (leaf, split_lower):
        before = snapshot(tree)
        with pytest.raises(CacheError):
            tree.lock(dead)
        with pytest.raises(CacheError):
            tree.unlock(dead)
        assert snapshot(tree) == before
    assert tree.allocator.num_free == NUM_BLOCKS


def test_lock_and_unlock_of_a_non_node(tree):
    """lock/unlock of something that is not a node (the Match itself, None, ...) raises TypeError;
    nothing changes."""
    before = snapshot(tree)
    for bad in (None, "node", 0, (), tree.match(A)):
        with pytest.raises(TypeError):
            tree.lock(bad)
        with pytest.raises(TypeError):
            tree.unlock(bad)
        assert snapshot(tree) == before, bad


# =========================================================================== evict

def test_evict_bad_count(tree):
    """evict with a negative or non-int count raises ValueError; nothing changes."""
    before = snapshot(tree)
    for bad in (-1, -100, 1.5, True, "1", None):
        with pytest.raises(ValueError):
            tree.evict(bad)
        assert snapshot(tree) == before, bad


def test_constructor_bad_arguments():
    """RadixCache needs a BlockAllocator (TypeError) and a positive int block_size (ValueError)."""
    with pytest.raises(TypeError):
        RadixCache(None)
    with pytest.raises(TypeError):
        RadixCache(16)
    for bad in (0, -2, 1.5, True, "16"):
        with pytest.raises(ValueError):
            RadixCache(BlockAllocator(4), block_size=bad)


# =========================================================================== splits

def test_match_ending_mid_node_splits_and_locks_exactly_the_matched_path():
    """A match that ends inside a node (whole-block divergence, mid-block divergence, or a short query)
    returns the right blocks, keeps the tree consistent, and its handle pins exactly the matched
    blocks: evicting everything else drops the unmatched tail of the node only."""
    alloc = BlockAllocator(8)
    tree = RadixCache(alloc, block_size=BS)
    tokens = (1, 2, 3, 4, 5, 6, 7, 8)
    blocks = alloc.allocate(4)
    tree.insert(tokens, blocks)
    alloc.release(blocks)
    assert tree.cached_blocks == 4

    # Short query ending mid-node (plus a tail that is ignored).
    m = tree.match((1, 2, 3, 4, 5))
    assert (m.length, m.blocks) == (4, tuple(blocks[:2]))
    tree.check()
    # Mid-block divergence: the block [5, 9] does not match [5, 6].
    assert tree.match((1, 2, 3, 4, 5, 9)).blocks == tuple(blocks[:2])
    # Divergence inside the first block: nothing matches.
    assert tree.match((1, 9, 3, 4)).length == 0
    # The full sequence still matches across the split.
    full = tree.match(tokens)
    assert (full.length, full.blocks) == (8, tuple(blocks))
    tree.check()

    tree.lock(m.node)
    assert tree.pinned_blocks == 2 and tree.evictable_blocks == 2
    assert tree.evict(100) == 2
    assert [alloc.refcount(b) for b in blocks] == [1, 1, 0, 0]
    after = tree.match(tokens)
    assert (after.length, after.blocks) == (4, tuple(blocks[:2]))
    tree.check()
    # A second split of the locked part keeps both halves pinned.
    tree.match((1, 2))
    assert tree.pinned_blocks == 2 and tree.evict(100) == 0
    tree.check()
    tree.unlock(m.node)
    assert tree.evictable_blocks == 2 and tree.evict(100) == 2
    assert alloc.num_free == 8


def test_insert_ending_mid_node_splits_and_branches():
    """Inserting a sequence that diverges inside a cached node splits it at the block boundary, keeps
    the tree's blocks for the shared part and adopts only the caller's new blocks."""
    alloc = BlockAllocator(8)
    tree = RadixCache(alloc, block_size=BS)
    first = alloc.allocate(3)
    tree.insert((1, 2, 3, 4, 5, 6), first)
    alloc.release(first)
    second = alloc.allocate(3)
    assert tree.insert((1, 2, 3, 9, 5, 6), second) == 2
    # The caller's duplicate of the shared block is not adopted and frees itself on release.
    assert alloc.refcount(second[0]) == 1 and alloc.refcount(second[1]) == 2
    alloc.release(second)
    assert alloc.refcount(second[0]) == 0
    assert tree.match((1, 2, 3, 9, 5, 6)).blocks == (first[0], second[1], second[2])
    assert tree.match((1, 2, 3, 4, 5, 6)).blocks == tuple(first)
    assert tree.cached_blocks == 5
    tree.check()
    assert tree.evict(100) == 5 and alloc.num_free == 8


# =========================================================================== LRU eviction order

def make_tree(num_blocks=16):
    alloc = BlockAllocator(num_blocks)
    return alloc, RadixCache(alloc, block_size=BS)


def test_evict_takes_lru_leaves_first_and_deepest_blocks_first():
    """evict drops blocks from the least recently used unpinned leaf first, deepest block first, never
    more than asked, and returns how many it dropped."""
    alloc, tree = make_tree()
    seq_a, seq_b, seq_c = (1, 1, 2, 2), (3, 3, 4, 4), (5, 5, 6, 6)
    for s in (seq_a, seq_b, seq_c):
        put(tree, s)
    a, b, c = (tree.match(s).blocks for s in (seq_a, seq_b, seq_c))
    tree.match(seq_a)  # recency now: b (oldest), c, a
    assert tree.evict(0) == 0 and tree.cached_blocks == 6

    assert tree.evict(1) == 1  # b's deepest block only
    assert alloc.refcount(b[1]) == 0 and alloc.refcount(b[0]) == 1
    assert tree.match(seq_b, ()).length == 2  # this refreshes b: now c is the oldest
    tree.check()

    assert tree.evict(3) == 3  # c (2 blocks, deepest first), then a's deepest
    assert [alloc.refcount(x) for x in c] == [0, 0]
    assert alloc.refcount(a[1]) == 0 and alloc.refcount(a[0]) == 1
    assert alloc.refcount(b[0]) == 1
    tree.check()

    assert tree.evict(1) == 1  # a's remaining block is older than b's refreshed one
    assert alloc.refcount(a[0]) == 0 and alloc.refcount(b[0]) == 1
    assert tree.evict(10) == 1  # only one block left: never more than there is
    assert tree.cached_blocks == 0 and alloc.num_free == 16
    assert tree.evict(5) == 0


def test_evict_inner_nodes_become_leaves_in_recency_order():
    """When all children of a node are evicted, the node becomes a leaf with its own recency: a prefix
    refreshed by a match ending at it outlives a leaf used before that match, and its children (older)
    go first; pinned leaves are skipped. (Checked through reference counts, which do not touch LRU.)"""
    alloc, tree = make_tree()
    put(tree, (1, 1, 2, 2))
    put(tree, (1, 1, 3, 3))   # [1,1] now has two children
    put(tree, (7, 7))
    put(tree, (8, 8, 9, 9))
    [shared, child2] = tree.match((1, 1, 2, 2)).blocks
    [_, child3] = tree.match((1, 1, 3, 3)).blocks
    [lone] = tree.match((7, 7)).blocks
    pinned = tree.match((8, 8, 9, 9))
    tree.lock(pinned.node)
    # Recency from here: child2 (oldest), child3, [7,7], then [1,1] itself.
    tree.match((1, 1, 2, 2))
    tree.match((1, 1, 3, 3))
    tree.match((7, 7))
    tree.match((1, 1))
    assert tree.evictable_blocks == 4 and tree.pinned_blocks == 2
    in_tree = lambda b: alloc.refcount(b) == 1  # noqa: E731 (the caller holds nothing)

    assert tree.evict(1) == 1
    assert not in_tree(child2) and in_tree(child3) and in_tree(lone) and in_tree(shared)
    assert tree.evict(1) == 1
    assert not in_tree(child3) and in_tree(lone) and in_tree(shared)
    tree.check()
    assert tree.evict(1) == 1  # [7,7] is older than the refreshed [1,1]
    assert not in_tree(lone) and in_tree(shared)
    assert tree.evict(100) == 1 and not in_tree(shared)
    assert all(in_tree(b) for b in pinned.blocks)  # the pinned path survives
    assert tree.match((8, 8, 9, 9)).blocks == pinned.blocks
    assert tree.cached_blocks == tree.pinned_blocks == 2
    tree.unlock(pinned.node)
    assert tree.evict(100) == 2 and alloc.num_free == 16
    tree.check()


def test_match_and_insert_refresh_recency():
    """Both match and insert (also of an already cached sequence) make a path the most recently used;
    match of a mid-node prefix refreshes only that prefix, so the node's tail goes first."""
    alloc, tree = make_tree()
    put(tree, (1, 1, 2, 2, 3, 3))  # one node of 3 blocks
    put(tree, (4, 4))
    put(tree, (1, 1, 2, 2, 3, 3))  # fully cached: still refreshes it
    assert tree.evict(1) == 1
    assert tree.match((4, 4)).length == 0
    assert tree.match((1, 1, 2, 2, 3, 3)).length == 6
    put(tree, (5, 5))              # now (5,5) is the newest
    tree.match((1, 1))             # splits, refreshes only [1,1]: [2,2,3,3] keeps its old time
    assert tree.evict(2) == 2      # the old tail [2,2,3,3] goes before [5,5]
    assert tree.match((5, 5)).length == 2
    assert tree.match((1, 1, 2, 2, 3, 3)).length == 2
    assert tree.evict(100) == 2 and alloc.num_free == 16


def test_lock_of_a_node_from_another_cache_is_refused():
    """A node handle only works with the RadixCache that returned it; nothing changes otherwise."""
    from radixcache import BlockAllocator, CacheError, RadixCache

    a, b = RadixCache(BlockAllocator(4), 2), RadixCache(BlockAllocator(4), 2)
    blocks = a.allocator.allocate(1)
    a.insert([1, 2], blocks)
    a.allocator.release(blocks)
    node = a.match([1, 2]).node
    with pytest.raises(CacheError, match="another RadixCache"):
        b.lock(node)
    with pytest.raises(CacheError, match="another RadixCache"):
        b.unlock(node)
    assert a.pinned_blocks == b.pinned_blocks == 0
    a.check()
    b.check()
