"""The checks a RadixCache runs on its arguments before it changes anything: each raises the
exception that names the problem (TypeError for a wrong type, ValueError for a bad value,
CacheError for a node that does not fit the tree's state) and otherwise returns the checked value
(or None)."""

from __future__ import annotations

import math

from radixcache.blocks import BlockAllocator
from radixcache.errors import CacheError
from radixcache.tree.nodes import Node

__all__ = ["check_deadline", "check_namespace", "check_num_blocks", "check_tree_args", "node_id"]


def check_tree_args(allocator, block_size, clock) -> None:
    """TypeError unless ``allocator`` is a BlockAllocator and ``clock`` is callable; ValueError
    unless ``block_size`` is a positive int (not a bool)."""
    if not isinstance(allocator, BlockAllocator):
        raise TypeError("allocator must be a BlockAllocator")
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if not callable(clock):
        raise TypeError("clock must be a callable returning seconds")


def check_namespace(namespace) -> tuple:
    """``namespace``, once it is known to be a hashable tuple (TypeError otherwise)."""
    if not isinstance(namespace, tuple):
        raise TypeError(f"namespace must be a tuple, got {type(namespace).__name__}")
    try:
        hash(namespace)
    except TypeError:
        raise TypeError("namespace must be hashable") from None
    return namespace


def node_id(tree, node, what: str) -> int:
    """The id of the node ``node`` names in ``tree`` (a RadixCache), for the verb ``what``:
    TypeError unless it is a ``Node``; CacheError when it belongs to another tree, was evicted, or
    is a partial tail (never locked or retained)."""
    if not isinstance(node, Node):
        raise TypeError(f"{what}: expected a node from match(), got {type(node).__name__}")
    if node.owner is not tree:
        raise CacheError(f"{what}: node belongs to another RadixCache")
    if not tree.node_table.is_live(node.id, node.gen):
        raise CacheError(f"{what}: node was evicted; lock the node a match returns right away")
    if tree.body.is_tail(node.id):
        raise CacheError(f"{what}: a partial tail is never locked or retained; copy its block instead")
    return node.id


def check_deadline(until) -> None:
    """TypeError unless ``until`` (of ``keep``) is an int or float (not a bool); ValueError for
    NaN."""
    if isinstance(until, bool) or not isinstance(until, (int, float)):
        raise TypeError(f"keep: until must be a number of seconds on the tree's clock, got {until!r}")
    if math.isnan(until):
        raise ValueError("keep: until is NaN")


def check_num_blocks(num_blocks) -> None:
    """ValueError unless ``num_blocks`` (of ``evict``) is a non-negative int (not a bool)."""
    if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 0:
        raise ValueError(f"num_blocks must be a non-negative int, got {num_blocks!r}")
