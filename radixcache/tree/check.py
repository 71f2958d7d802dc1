"""``RadixCache.check``: every structural invariant of the tree, with block checks vectorised.

Walks every live node once from the namespace roots and asserts (raising ``AssertionError`` naming
what is wrong) the invariants stated in ``radixcache.tree.body`` and ``radixcache.tree.nodes``: node
shapes and child keys, partial tails (one block, fewer than block_size tokens, no children, never
locked, never covered by a child), path lock counts, recency never older than a child's; no block
held by two nodes, every tree block in use and marked as the tree's and nothing else marked; the
cached and pinned counts; recency tiers holding exactly the evictable leaves; every live id
reachable and every freed id free.
"""

from __future__ import annotations

import numpy as np


def _lock_ref_ok(nodes, i: int) -> bool:
    kids = nodes.kids[i] or {}
    return nodes.lock_ref[i] == nodes.own_locks[i] + sum(nodes.lock_ref[c] for c in kids.values())


def _check_tail(body, parent: int, t: int) -> None:
    nodes = body.nodes
    key = nodes.keys[t]
    assert nodes.tail[parent] == t and 0 < len(key) < body.bs4 and len(nodes.blocks[t]) == 4, \
        f"node {t}: bad partial tail"
    assert nodes.kids[t] is None and nodes.tail[t] < 0 and nodes.lock_ref[t] == 0 == nodes.own_locks[t], \
        f"node {t}: a tail has no children and is never locked"
    assert not any(nodes.keys[c].startswith(key) for c in (nodes.kids[parent] or {}).values()), \
        f"node {t}: a child covers the tail"


def check_tree(body, block_size: int) -> None:
    """Assert every invariant of the tree whose ``TreeBody`` is ``body``."""
    nodes, bs4 = body.nodes, body.bs4
    assert bs4 == 4 * block_size
    for ns, r in body.roots.items():
        assert nodes.parent[r] == -1 and nodes.keys[r] == b"", f"namespace root of {ns} is not a root"
        assert body.root_ns[r] == ns, f"root {r} maps to another namespace"
        assert nodes.kids[r] is None or nodes.kids[r], f"root {r} has an empty child table"
        assert _lock_ref_ok(nodes, r), "root lock count is not own locks + children's"
    assert len(body.root_ns) == len(body.roots), "root tables out of step"
    stack = [(r, c) for r in body.roots.values() for c in body.below(r)]
    leaves, visited, pinned, tails = set(), 0, 0, 0
    held = bytearray()
    while stack:
        p, i = stack.pop()
        visited += 1
        key, blocks, kids = nodes.keys[i], nodes.blocks[i], nodes.kids[i]
        assert key is not None, f"freed node {i} still linked"
        assert nodes.parent[i] == p, f"node {i}: parent {nodes.parent[i]}, linked under {p}"
        assert nodes.access[p] >= nodes.access[i], f"node {p}: older than child {i}"
        if body.is_tail(i):
            _check_tail(body, p, i)
            tails += 1
        else:
            assert len(key) == len(blocks) * block_size > 0, f"node {i}: key/blocks length mismatch"
            assert nodes.kids[p].get(key[:bs4]) == i, f"node {i}: wrong child key"
            assert kids is None or kids, f"node {i} has an empty child table"
            assert _lock_ref_ok(nodes, i), f"node {i}: path lock count is not own locks + children's"
        stack.extend((i, c) for c in body.below(i))
        held += blocks
        if nodes.lock_ref[i]:
            pinned += len(blocks) >> 2
        elif body.is_evictable_leaf(i):
            leaves.add(i)
    assert visited + len(body.roots) == nodes.live_count(), "live nodes unreachable from the roots"
    assert all(nodes.keys[i] is None for i in nodes.free_ids), "a free node id is still in use"
    v = np.frombuffer(held, np.uint32)
    assert np.unique(v).size == v.size, "a block is held by two nodes"
    assert (body.allocator.refcounts()[v] >= 1).all(), "a tree block is free in the allocator"
    marks = np.frombuffer(body.in_tree, np.uint8)
    assert marks[v].all() and int(marks.sum()) == v.size, "in-tree marks disagree with the nodes"
    assert v.size == body.cached, f"cached_blocks {body.cached} != {v.size}"
    assert pinned == body.pinned, f"pinned_blocks {body.pinned} != {pinned}"
    assert tails == body.tails, f"partial tails {body.tails} != {tails}"
    body.recency.check(leaves)


def held_outside(body, allocator) -> list[str]:
    """``RadixCache.leaks``: pinned blocks or locked roots, and (up to 11) blocks whose reference
    count is not exactly the tree's own mark: what some caller still holds."""
    problems = []
    nodes = body.nodes
    if body.pinned or any(nodes.lock_ref[r] for r in body.root_ns):
        problems.append(f"{body.pinned} pinned blocks / locked roots remain")
    counts = allocator.refcounts()
    marks = np.frombuffer(body.in_tree, np.uint8)
    for b in np.flatnonzero(counts != marks)[:11].tolist():
        problems.append(f"block {b}: refcount {counts[b]}, tree holds {marks[b]}")
    return problems
