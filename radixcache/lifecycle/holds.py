"""A lease's holds on the cache, and how the manager's verbs move them (under the manager's lock).

A live lease holds one lock on the tree node its committed path ends at and one reference on each
block in ``lease.blocks``. Each function here keeps the manager's invariants 1 and 2
(``radixcache.lifecycle.manager``): a block's reference count is 1 if the tree holds it plus 1 per
lease holding it, and a lease's first ``committed`` blocks are the tree's path to its locked node,
with ``lease.tokens`` their tokens. They check no argument: the manager has, before calling.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from radixcache.blocks import BlockAllocator
from radixcache.lifecycle.lease import Lease
from radixcache.tree import Match, Namespace, RadixCache

__all__ = ["adopt", "hold_match", "keep_tail", "let_go", "share"]


def hold_match(tree: RadixCache, allocator: BlockAllocator, match: Match, namespace: Namespace,
               tokens: array) -> Lease:
    """A new lease on ``match`` (of ``tokens``, packed, in ``namespace``): its node locked, its
    whole blocks retained and committed, ``tokens[:match.length]`` computed and recorded."""
    tree.lock(match.node)
    allocator.retain(match.blocks)
    return Lease(namespace, list(match.blocks), match.node, match.length, len(match.blocks),
                 tokens=tokens[:match.length])


def adopt(tree: RadixCache, allocator: BlockAllocator, lease: Lease, new: array, full: int) -> int:
    """Put ``lease``'s blocks ``committed .. full-1`` (``new`` are their tokens, packed) into the
    tree below its node, at once; move its lock to the new end of its path, swap each block another
    request cached first for the tree's, and count them committed. Returns the index of the first
    block the tree adopted from the lease (``full`` when the tree had them all)."""
    done, bs = lease.committed, tree.block_size
    got = tree.adopt_below(lease.node, new, lease.blocks[done:full])
    lease.tokens.extend(new)
    if got.node != lease.node:
        tree.lock(got.node)
        tree.unlock(lease.node)
        lease.node = got.node
    first_new = done + got.cached // bs
    for i in range(done, first_new):
        mine, tree_block = lease.blocks[i], got.blocks[i - done]
        if mine != tree_block:  # another request cached this block first
            allocator.retain([tree_block])
            allocator.release([mine])
            lease.blocks[i] = tree_block
    lease.committed = full
    return first_new


def keep_tail(tree: RadixCache, lease: Lease, tokens: Sequence[int]) -> None:
    """Put ``lease``'s partial last block (its computed tokens after the committed whole blocks,
    read from ``tokens``) into the tree as the partial tail of its node; nothing when it has none.
    The lease keeps its reference (the tree retains the block if it adopts it)."""
    full = lease.committed * tree.block_size
    if lease.computed > full:
        tree.adopt_below(lease.node, tokens[full:lease.computed], (),
                         tail_block=lease.blocks[lease.committed])


def share(tree: RadixCache, allocator: BlockAllocator, lease: Lease, copy: list) -> Lease:
    """A new lease sharing ``lease``'s committed blocks (retained, its node locked once more), then
    ``copy`` (blocks the caller hands over, e.g. the copy of a partial last block), with the same
    computed and cached counts and a copy of its token record."""
    shared = lease.blocks[:lease.committed]
    allocator.retain(shared)
    tree.lock(lease.node)
    return Lease(lease.namespace, shared + copy, lease.node, lease.computed, lease.committed,
                 lease.cached_tokens, tokens=lease.tokens[:])


def let_go(tree: RadixCache, allocator: BlockAllocator, lease: Lease) -> None:
    """Drop ``lease``'s lock and every reference it holds, and mark it released."""
    tree.unlock(lease.node)
    allocator.release(lease.blocks)
    lease.node, lease.blocks, lease.released = None, [], True
