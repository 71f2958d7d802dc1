"""The insertion behind ``RadixCache.insert`` / ``adopt`` / ``adopt_below``: the arguments checked,
the walk, the blocks adopted, the partial tail kept and the recency of what was used refreshed.

Every argument is checked before the tree changes (a walk's splits change nothing observable), and
an insert refreshes, with one tick, the deepest node it used: the end of its whole blocks, or the
partial tail it keeps (or finds there covering its tokens); never a child that only covers the tail.
"""

from __future__ import annotations

from array import array

from radixcache.blocks import as_block_ids, has_duplicates
from radixcache.errors import CacheError
from radixcache.tree.tails import keep_tail
from radixcache.tokens import token_bytes


def insert_args(body, tokens, blocks, tail_block, what: str) -> tuple:
    """(packed tokens, block ids, tail id or None, whole blocks) of an insert, checked:
    ``ValueError``/``TypeError`` naming ``what`` for tokens and ids that do not fit together."""
    bs4 = body.bs4
    q = token_bytes(tokens)
    nblocks = len(q) // bs4
    ids = as_block_ids(blocks, what)
    tail = None if tail_block is None else as_block_ids((tail_block,), what)
    if len(ids) != nblocks:
        raise ValueError(f"{what}: {len(q) >> 2} tokens cover {nblocks} whole blocks of "
                         f"{bs4 // 4}, got {len(ids)} block ids")
    if tail is not None and len(q) == nblocks * bs4:
        raise ValueError(f"{what}: a tail_block needs a partial last block, but {len(q) >> 2} "
                         f"tokens are whole blocks of {bs4 // 4}")
    return q, ids, tail, nblocks


def insert_below(body, allocator, stats, changes, start: int, args: tuple, depth: int,
                 extend: bool) -> tuple[int, int, bytearray]:
    """Insert ``args`` (from ``insert_args``) below node ``start``, which ends ``depth`` bytes of
    tokens deep (a namespace root: 0). With ``extend`` a caller-locked leaf may grow in place
    (``TreeBody.can_extend``). Returns (bytes already cached below ``start``, the node ending at
    the last whole block, the tree's packed block ids of every whole block)."""
    q, ids, tail, nblocks = args
    bs4 = body.bs4
    whole = q if len(q) == nblocks * bs4 else q[:nblocks * bs4]
    node, pos, path = body.walk(whole, start, True)
    adopted = ids[pos // bs4:]
    # Where the caller passes the tree's own blocks for the cached part (as match returned them),
    # those are valid by construction; otherwise every id is checked.
    own_prefix = ids[:pos // bs4].tobytes() == path
    checked = adopted if own_prefix else ids
    if tail is not None:
        checked = checked + tail
    if checked and not (own_prefix and allocator.adoptable(checked, body.in_tree)):
        _raise_unadoptable(body, allocator, checked, adopted, tail)
    if adopted:
        changes.inserted((depth + pos) // bs4, whole[pos:pos + bs4])
        if extend and pos == 0 and body.can_extend(node, whole):
            body.extend(node, whole, adopted)
        else:
            node = body.add_child(node, whole[pos:], adopted)
        stats.inserted_tokens += len(adopted) * (bs4 // 4)
        path += adopted
    used = node
    if tail is not None:
        kept = keep_tail(body, node, q[nblocks * bs4:], tail)
        changes.changed()
        if kept >= 0:
            used = kept
    if body.nodes.parent[used] >= 0:
        body.touch(used)
    return pos, node, path


def _raise_unadoptable(body, allocator, checked: array, adopted: array, tail: array | None) -> None:
    """Raise the error that names why ``checked`` (the blocks an insert adopts, or every block it
    was given, plus the tail) cannot be adopted."""
    if has_duplicates(checked):
        raise CacheError("insert: the same block id appears twice")
    allocator.check_held(checked, "insert")
    if tail is not None and body.in_tree[tail[0]]:
        raise CacheError(f"insert: tail block {tail[0]} already belongs to the tree")
    owned = body.marked(adopted)
    if owned:
        raise CacheError(f"insert: blocks {owned[:8]} already belong to the tree at other positions")
