"""Loading a prompt's blocks from the shared store into the tree, through the manager's lifecycle.

Two halves, so that the network and the tree can live on different threads:

- ``fetch_from_store`` (any thread; it waits on the network): after the local match of
  ``tokens[:-1]`` ends at block ``start`` (read under the manager's lock, which changes nothing),
  the store is asked, without the lock, for blocks ``start, start+1, ...`` in chain order, as many
  as it holds in a row and the pool could free. The result is a ``Fetched`` (or None).
- ``load_fetched`` (the thread that owns the manager's changes): as any request would, ``admit`` a
  prefix ending at the last fetched block, ``grow`` to it, fill the lease's own fresh blocks with
  the fetched K/V (``pool.import_block``, without the lock: nobody else holds those blocks), ``commit`` them without offering them back to the store,
  ``release``. The blocks stay in the tree as evictable entries, so the ``admit`` that follows
  matches them.

Every failure is a shorter load, never an exception: a store that is down or slow returns fewer
blocks, a pool that filled up in the meantime or evicted the local prefix loads nothing, a block the
pool cannot hold exactly (fp8 that would clip) ends the load there. ``CacheManager.prefetch`` is
both halves on one thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from radixcache.errors import OutOfBlocks
from radixcache.tokens import token_array
from radixcache.tree import Namespace


class Fetched(NamedTuple):
    """Blocks ``start .. start+len(blocks)-1`` of ``tokens`` in ``namespace``, read from the store
    (each a payload ``pool.import_block`` takes), not yet in the tree."""

    tokens: object
    namespace: Namespace
    start: int
    blocks: list


def fetch_from_store(manager, tokens: Sequence[int], namespace: Namespace = ()) -> Fetched | None:
    """The store's blocks that follow the local match of ``tokens[:-1]`` (see the module
    docstring), or None when there is nothing to load. Changes nothing."""
    store = manager.store
    if store is None:
        return None
    tokens = token_array(tokens)
    bs = manager.block_size
    usable = (len(tokens) - 1) // bs if tokens else 0
    with manager.mutex:
        start = manager.tree.peek(tokens[:usable * bs], namespace) // bs
        # free blocks and evictable ones (offers in flight may hold a few more: load re-checks)
        limit = min(usable - start, manager.allocator.num_free + manager.tree.evictable_blocks)
    if limit <= 0:
        return None
    got = store.fetch(namespace, tokens[:usable * bs], start, limit)
    return Fetched(tokens, namespace, start, got) if got else None


def load_fetched(manager, fetched: Fetched | None) -> int:
    """Put ``fetched`` into ``manager``'s tree (see the module docstring); returns how many tokens
    were loaded (0 for None)."""
    if fetched is None:
        return 0
    tokens, namespace, start, got = fetched
    bs = manager.block_size
    end = start + len(got)
    with manager.mutex:
        lease = manager.admit(tokens[:end * bs + 1], namespace, count=False)
        first = lease.committed
        if first < start:  # evicted since the look-up: what was fetched no longer follows it
            manager.release(lease)
            return 0
        try:
            manager.grow(lease, end * bs)
        except OutOfBlocks:  # the pool filled up meanwhile
            manager.release(lease)
            return 0
    loaded = first
    try:  # without the lock: nobody else holds the lease's fresh blocks
        for j in range(first, end):
            manager.pool.import_block(lease.blocks[j], got[j - start])
            loaded = j + 1
    except ValueError:
        pass  # a block this pool cannot hold exactly: stop there
    finally:
        with manager.mutex:
            try:
                if loaded > first:
                    manager.commit(lease, tokens, loaded * bs, offer=False)
            finally:
                manager.release(lease)
    return (loaded - first) * bs
