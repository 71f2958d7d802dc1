"""Loading a prompt's blocks from the shared store into the tree, through the manager's lifecycle.

After the local match of ``tokens[:-1]`` ends at block ``start``, the store is asked (without the
manager's lock: this waits on the network) for blocks ``start, start+1, ...`` in chain order, as
many as it holds in a row and the pool could free. Then, as any request would: ``admit`` a prefix
ending at the last fetched block, ``grow`` to it, fill the lease's own fresh blocks with the
fetched K/V (``pool.import_block``, again without the lock: nobody else holds those blocks),
``commit`` them without offering them back to the store, ``release``. The blocks stay in the tree
as evictable entries, so the ``admit`` that follows matches them. Every failure is a shorter load,
never an exception: a store that is down or slow returns fewer blocks, a pool that filled up in
the meantime or evicted the local prefix loads nothing, a block the pool cannot hold exactly (fp8
that would clip) ends the load there.
"""

from __future__ import annotations

from collections.abc import Sequence

from radixcache.errors import OutOfBlocks
from radixcache.tokens import token_array
from radixcache.tree import Namespace


def prefetch_from_store(manager, tokens: Sequence[int], namespace: Namespace = ()) -> int:
    """Load into ``manager``'s tree the store's blocks that follow the local match of
    ``tokens[:-1]`` (see the module docstring); returns how many tokens were loaded."""
    store = manager.store
    if store is None:
        return 0
    tokens = token_array(tokens)
    bs = manager.block_size
    usable = (len(tokens) - 1) // bs if tokens else 0
    with manager.mutex:
        start = manager.tree.peek(tokens[:usable * bs], namespace) // bs
        limit = min(usable - start, manager.freeable_blocks())
    if limit <= 0:
        return 0
    got = store.fetch(namespace, tokens[:usable * bs], start, limit)
    if not got:
        return 0
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
    try:
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
