"""The CacheManager's invariants, checked from the outside (the property tests run it every step)."""

from __future__ import annotations

from array import array


def path_tokens(node) -> array:
    """The tokens on the path from the namespace root down to ``node`` (a tree handle)."""
    keys = []
    while node is not None:
        keys.append(node.key)
        node = node.parent
    out = array("I")
    for key in reversed(keys):
        out.extend(key)
    return out


def check_manager(tree, allocator, leases, block_size: int) -> None:
    """Assert the manager's invariants over ``tree``, ``allocator`` and the live ``leases``: each
    lease's committed blocks are the tree's path to its locked node, its token record is that
    path's tokens, and its other blocks are not the tree's; its computed tokens fit its blocks;
    and every block's reference count is (1 if the tree holds it) + the leases holding it, summed
    over the pool. Also runs ``tree.check()``."""
    tree.check()
    held = 0
    for lease in leases:
        path = tree.path_blocks(lease.node)
        assert list(path) == lease.blocks[:lease.committed], \
            f"{lease}: committed blocks are not the tree's path to its locked node"
        assert lease.tokens == path_tokens(lease.node), \
            f"{lease}: its token record is not the tokens of its path"
        assert not any(tree.holds(b) for b in lease.blocks[lease.committed:]), \
            f"{lease}: holds a tree block off its locked path"
        assert lease.computed <= len(lease.blocks) * block_size
        held += len(lease.blocks)
    total = sum(allocator.refcount(b) for b in range(allocator.num_blocks))
    assert total == tree.cached_blocks + held, \
        f"reference counts sum to {total}, tree {tree.cached_blocks} + leases {held}"
