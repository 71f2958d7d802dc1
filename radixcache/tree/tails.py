"""Partial tails: a node's one block of fewer than ``block_size`` tokens, kept and dropped.

``keep_tail`` files a block as a node's tail (the end of a finished sequence, reused copy-on-write
by the next match), replacing the one there through ``TreeBody.drop_tail`` (which the body's own
structural changes also call when a new child or extension covers a tail).
Eviction (``radixcache.tree.eviction``) removes tails like any leaf. Both functions keep the
invariants ``radixcache.tree.body`` lists: the tree's reference, ``in_tree`` mark and the
``cached`` / ``tails`` counts move with the tail, and a tail is never covered by a child.
"""

from __future__ import annotations

from array import array
from radixcache.tree.body import TreeBody


def keep_tail(body: TreeBody, node: int, rest: bytes, block: array) -> int:
    """Make ``block`` (holding the tokens ``rest``) the tail of ``node`` unless the tail there or
    a whole-block child already covers them; a different or shorter tail is replaced.

    Returns the tail that now holds ``rest`` (the new one, or the one there that covers it),
    for the caller to ``touch``; -1 where a child covers it (only the child's first block holds
    those tokens, so refreshing the child would refresh blocks the insert never used)."""
    nodes = body.nodes
    old = nodes.tail[node]
    if old >= 0 and nodes.keys[old].startswith(rest):
        return old
    kids = nodes.kids[node]
    if kids is not None and any(nodes.keys[c].startswith(rest) for c in kids.values()):
        return -1
    if old >= 0:
        body.drop_tail(node)
    body.recency.discard(node)
    tail = nodes.tail[node] = nodes.new(node, rest, block.tobytes(), nodes.access[node])
    body.allocator.retain_checked(block)
    body.in_tree[block[0]] = 1
    body.cached += 1
    body.tails += 1
    return tail
