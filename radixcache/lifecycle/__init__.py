"""The one request lifecycle (pure Python): ``CacheManager`` admits, grows, commits, finishes and
releases every sequence over one tree and allocator, under one lock, into one ledger.

- ``manager``: ``CacheManager``; ``lease``: ``Lease`` (one sequence's hold), ``Ledger`` and the
  store's and publisher's last counters;
- ``holds``: how a lease's lock and block references move (held, adopted, shared, let go);
- ``supply``: ``BlockSupply``, blocks for leases (free, evicted, copies of partial blocks);
- ``arguments``: the checks the manager runs on its arguments before changing anything;
- ``offers``: blocks offered to a shared store, copied once the manager's lock is free;
- ``prefetch``: the store's blocks loaded into the tree through the same lifecycle;
- ``check``: the manager's invariants (``CacheManager.check``).
"""

from radixcache.lifecycle.lease import Lease, Ledger
from radixcache.lifecycle.manager import CacheManager

__all__ = ["CacheManager", "Lease", "Ledger"]
