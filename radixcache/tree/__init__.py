"""The radix tree over token ids (pure Python): ``RadixCache`` owns reference-counted blocks of a
``radixcache.blocks.BlockAllocator`` and evicts least recently used blocks first.

- ``radix_cache``: ``RadixCache``, the public face, each method with the checks of its arguments,
  and what it returns (``Match``, ``Adopted``, ``CacheStats``);
- ``body``: the nodes (a struct of arrays, and the ``Node`` handles callers hold), the tree's state
  and every structural change (insertions, partial tails, the change log for schedulers that cache
  ``peek`` results) and the invariant check;
- ``eviction``: the eviction order (block-level LRU, retention as a second tier) and the eviction;
- ``events``: which KV event log the tree tells of its blocks (attached, muted through a reset).
"""

from radixcache.tree.body import Node
from radixcache.tree.radix_cache import LIVE_CACHES, Adopted, CacheStats, Match, Namespace, RadixCache

__all__ = ["LIVE_CACHES", "Adopted", "CacheStats", "Match", "Namespace", "Node", "RadixCache"]
