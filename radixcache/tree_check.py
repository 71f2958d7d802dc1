"""``RadixCache.check``: every structural invariant of the tree, with block checks vectorised.

Walks every live node once from the namespace roots and asserts (raising ``AssertionError`` naming
what is wrong) the invariants stated in ``radixcache.tree_body`` and ``radixcache.nodes``: node
shapes and child keys, partial tails (one block, fewer than block_size tokens, no children, never
locked, never covered by a child), path lock counts, recency never older than a child's; no block
held by two nodes, every tree block in use and marked as the tree's and nothing else marked; the
cached and pinned counts; recency tiers holding exactly the evictable leaves; every live id
reachable and every freed id free.
"""

from __future__ import annotations

import numpy as np


def _lock_ref_ok(store, i: int) -> bool:
    kids = store.kids[i] or {}
    return store.lock_ref[i] == store.own_locks[i] + sum(store.lock_ref[c] for c in kids.values())


def _check_tail(body, parent: int, t: int) -> None:
    store = body.store
    key = store.keys[t]
    assert store.tail[parent] == t and 0 < len(key) < body.bs4 and len(store.blocks[t]) == 4, \
        f"node {t}: bad partial tail"
    assert store.kids[t] is None and store.tail[t] < 0 and store.lock_ref[t] == 0 == store.own_locks[t], \
        f"node {t}: a tail has no children and is never locked"
    assert not any(store.keys[c].startswith(key) for c in (store.kids[parent] or {}).values()), \
        f"node {t}: a child covers the tail"


def check_tree(body, block_size: int) -> None:
    """Assert every invariant of the tree whose ``TreeBody`` is ``body``."""
    store, bs4 = body.store, body.bs4
    assert bs4 == 4 * block_size
    for ns, r in body.roots.items():
        assert store.parent[r] == -1 and store.keys[r] == b"", f"namespace root of {ns} is not a root"
        assert body.root_ns[r] == ns, f"root {r} maps to another namespace"
        assert store.kids[r] is None or store.kids[r], f"root {r} has an empty child table"
        assert _lock_ref_ok(store, r), "root lock count is not own locks + children's"
    assert len(body.root_ns) == len(body.roots), "root tables out of step"
    stack = [(r, c) for r in body.roots.values() for c in body.below(r)]
    leaves, visited, pinned, tails = set(), 0, 0, 0
    held = bytearray()
    while stack:
        p, i = stack.pop()
        visited += 1
        key, blocks, kids = store.keys[i], store.blocks[i], store.kids[i]
        assert key is not None, f"freed node {i} still linked"
        assert store.parent[i] == p, f"node {i}: parent {store.parent[i]}, linked under {p}"
        assert store.access[p] >= store.access[i], f"node {p}: older than child {i}"
        if body.is_tail(i):
            _check_tail(body, p, i)
            tails += 1
        else:
            assert len(key) == len(blocks) * block_size > 0, f"node {i}: key/blocks length mismatch"
            assert store.kids[p].get(key[:bs4]) == i, f"node {i}: wrong child key"
            assert kids is None or kids, f"node {i} has an empty child table"
            assert _lock_ref_ok(store, i), f"node {i}: path lock count is not own locks + children's"
        stack.extend((i, c) for c in body.below(i))
        held += blocks
        if store.lock_ref[i]:
            pinned += len(blocks) >> 2
        elif body.is_evictable_leaf(i):
            leaves.add(i)
    assert visited + len(body.roots) == store.live_count(), "live nodes unreachable from the roots"
    assert all(store.keys[i] is None for i in store.free_ids), "a free node id is still in use"
    v = np.frombuffer(held, np.uint32)
    assert np.unique(v).size == v.size, "a block is held by two nodes"
    assert (body.allocator.refcounts()[v] >= 1).all(), "a tree block is free in the allocator"
    marks = np.frombuffer(body.in_tree, np.uint8)
    assert marks[v].all() and int(marks.sum()) == v.size, "in-tree marks disagree with the nodes"
    assert v.size == body.cached, f"cached_blocks {body.cached} != {v.size}"
    assert pinned == body.pinned, f"pinned_blocks {body.pinned} != {pinned}"
    assert tails == body.tails, f"partial tails {body.tails} != {tails}"
    body.recency.check(leaves)
