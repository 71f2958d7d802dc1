"""The one request lifecycle (pure Python): ``CacheManager`` admits, grows, commits, finishes and
releases every sequence over one tree and allocator, under one lock, into one ledger.

- ``manager``: ``CacheManager``, each verb with the checks of its arguments, and its invariants
  (``CacheManager.check``);
- ``lease``: ``Lease`` (one sequence's hold) and how its lock and block references move (held,
  adopted, shared, left as a tail, let go), the ``Ledger`` and the store's and publisher's last
  counters;
- ``supply``: ``BlockSupply``, blocks for leases (free, evicted, copies of partial blocks);
- ``offers``: blocks offered to a shared store, copied once the manager's lock is free;
- ``prefetch``: the store's blocks read (``fetch``) and loaded into the tree (``load``) through
  the same lifecycle.
"""

from radixcache.lifecycle.lease import Lease, Ledger
from radixcache.lifecycle.manager import CacheManager

__all__ = ["CacheManager", "Lease", "Ledger"]
