"""The radix tree over token ids (pure Python): ``RadixCache`` owns reference-counted blocks of a
``radixcache.blocks.BlockAllocator`` and evicts least recently used blocks first.

- ``radix_cache``: ``RadixCache``, the public face (validation, results, handles);
- ``body``: the tree's state and every structural change; ``insertion``: what insert / adopt do;
- ``nodes``: the struct-of-arrays node table and the ``Node`` handles callers hold;
- ``recency``: the eviction order (block-level LRU, retention as a second tier);
- ``changes``: content epochs and the insert log for schedulers that cache ``peek`` results;
- ``results``: ``Match``, ``Adopted``, ``CacheStats``; ``check``: ``RadixCache.check`` and ``leaks``;
- ``arguments``: the checks ``RadixCache`` runs on its arguments; ``event_log``: which KV event log
  the tree tells of its blocks (attached, muted through a reset).
"""

from radixcache.tree.nodes import Node
from radixcache.tree.radix_cache import LIVE_CACHES, Namespace, RadixCache
from radixcache.tree.results import Adopted, CacheStats, Match

__all__ = ["LIVE_CACHES", "Adopted", "CacheStats", "Match", "Namespace", "Node", "RadixCache"]
