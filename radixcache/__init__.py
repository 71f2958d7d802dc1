"""radixcache: never compute the same prefix twice.

The core (``BlockAllocator``, ``RadixCache``) is pure Python; importing this package does not import
torch or transformers. ``radixcache.wrap`` (the Hugging Face wrapper) is loaded on first use.
"""

from radixcache.blocks import BlockAllocator
from radixcache.errors import CacheError, OutOfBlocks
from radixcache.tree import Adopted, CacheStats, Match, RadixCache

__all__ = ["Adopted", "BlockAllocator", "CacheError", "CacheStats", "Match", "OutOfBlocks", "RadixCache", "wrap"]
__version__ = "0.1.0"


def __getattr__(name):
    if name == "wrap":
        from radixcache.integrations.hf import wrap

        return wrap
    raise AttributeError(f"module 'radixcache' has no attribute {name!r}")
