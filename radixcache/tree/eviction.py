"""Eviction: dropping the tree's least recently used blocks, a leaf's deepest blocks first.

``evict_lru`` is the only way a whole block leaves the tree (the KV event log hears of it here); it
takes leaves in the order ``radixcache.tree.recency`` keeps (retained leaves after every other,
until their deadline), truncates a leaf when fewer of its blocks are needed, and unlinks a leaf
it empties (``remove_leaf``), which may make its parent an evictable leaf in turn. Both keep the
invariants ``radixcache.tree.body`` lists.
"""

from __future__ import annotations

from array import array

from radixcache.tree.body import TreeBody


def remove_leaf(body: TreeBody, i: int) -> None:
    """Unlink leaf ``i`` (its blocks already released); a parent left on a retained path inherits
    the retention, and becomes evictable if it is a leaf now."""
    nodes = body.nodes
    parent = nodes.parent[i]
    if nodes.tail[parent] == i:
        nodes.tail[parent] = -1
    else:
        siblings = nodes.kids[parent]
        del siblings[nodes.keys[i][:body.bs4]]
        if not siblings:
            nodes.kids[parent] = None
    until = nodes.until[i]
    nodes.free(i)
    if nodes.parent[parent] < 0:
        body.drop_idle_root(parent)
        return
    if until > nodes.until[parent]:
        nodes.until[parent] = until
    if body.is_evictable_leaf(parent):
        body.recency.add(parent)


def evict_lru(body: TreeBody, num_blocks: int, now) -> int:
    """Drop the tree's reference on up to ``num_blocks`` blocks in eviction order (see
    ``radixcache.tree.recency``), a leaf's deepest blocks first; returns how many were dropped.
    ``now`` is called for the time only when some leaf is retained."""
    nodes, recency, bs4 = body.nodes, body.recency, body.bs4
    if recency.deadlines:
        recency.expire(now())
    dropped = 0
    gone = bytearray()
    while dropped < num_blocks:
        i = recency.pop()
        if i is None:
            break
        blocks = nodes.blocks[i]
        keep = max(0, (len(blocks) >> 2) - (num_blocks - dropped))
        gone += blocks[4 * keep:]
        dropped += (len(blocks) >> 2) - keep
        if keep:
            nodes.blocks[i] = blocks[:4 * keep]
            nodes.keys[i] = nodes.keys[i][:keep * bs4]
            recency.add(i)
        else:
            if len(nodes.keys[i]) < bs4:
                body.tails -= 1
            remove_leaf(body, i)
    if gone:
        ids = array("I", gone)
        body.allocator.release(ids)
        body.mark(ids, 0)
        body.cached -= dropped
        if body.events is not None:
            body.events.removed(body, bytes(gone))  # tails among them were never announced
    return dropped
