"""``RadixCache.check``: every structural invariant of the tree, with block checks vectorised.

Walks every live node once from the namespace roots and asserts (raising ``AssertionError`` naming
what is wrong): the node-store invariants of ``radixcache.nodes``; no block held by two nodes;
every tree block in use in the allocator and marked as the tree's, and nothing else marked; the
cached and pinned counts; the recency tiers hold exactly the evictable leaves
(``radixcache.recency``); every live id is reachable and every freed id is free.
"""

from __future__ import annotations

from array import array

import numpy as np


def _lock_ref_ok(store, i: int, kids) -> bool:
    return store.lock_ref[i] == store.own_locks[i] + sum(store.lock_ref[c] for c in (kids or {}).values())


def check_tree(tree, roots: dict, in_tree: bytearray, cached_count: int, pinned_count: int) -> None:
    """Assert every invariant of ``tree`` (its roots, in-tree marks and counters are passed in)."""
    store, bs4 = tree.store, 4 * tree.block_size
    for ns, r in roots.items():
        assert store.parent[r] == -1 and store.keys[r] == b"", f"namespace root of {ns} is not a root"
        assert tree.namespace_of_root(r) == ns, f"root {r} maps to another namespace"
        assert store.kids[r] is None or store.kids[r], f"root {r} has an empty child table"
        assert _lock_ref_ok(store, r, store.kids[r]), "root lock count is not own locks + children's"
    stack = [(r, c) for r in roots.values() for c in (store.kids[r] or {}).values()]
    leaves, visited, cached, pinned = set(), 0, 0, 0
    held = array("I")
    while stack:
        p, i = stack.pop()
        visited += 1
        key, blocks, kids = store.keys[i], store.blocks[i], store.kids[i]
        assert key is not None, f"freed node {i} still linked"
        assert store.parent[i] == p, f"node {i}: parent {store.parent[i]}, linked under {p}"
        assert len(key) == len(blocks) * bs4 > 0, f"node {i}: key/blocks length mismatch"
        assert store.kids[p].get(key[:bs4]) == i, f"node {i}: wrong child key"
        assert kids is None or kids, f"node {i} has an empty child table"
        assert _lock_ref_ok(store, i, kids), f"node {i}: path lock count is not own locks + children's"
        for c in (kids or {}).values():
            assert store.access[i] >= store.access[c], f"node {i}: older than child {c}"
            stack.append((i, c))
        held += blocks
        cached += len(blocks)
        if store.lock_ref[i]:
            pinned += len(blocks)
        elif kids is None:
            leaves.add(i)
    assert visited + len(roots) == store.live_count(), "live nodes unreachable from the roots"
    assert all(store.keys[i] is None for i in store.free_ids), "a free node id is still in use"
    v = np.frombuffer(held, np.uint32)
    assert np.unique(v).size == v.size, "a block is held by two nodes"
    assert (tree.allocator.refcounts()[v] >= 1).all(), "a tree block is free in the allocator"
    marks = np.frombuffer(in_tree, np.uint8)
    assert marks[v].all() and int(marks.sum()) == v.size, "in-tree marks disagree with the nodes"
    assert cached == cached_count, f"cached_blocks {cached_count} != {cached}"
    assert pinned == pinned_count, f"pinned_blocks {pinned_count} != {pinned}"
    tree.recency.check(leaves)
