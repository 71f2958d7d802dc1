"""Exceptions raised by radixcache.

Misuse of cache state (free or foreign blocks, unlocking what is not locked, running out of blocks)
raises a ``CacheError``; arguments of the wrong type or value raise ``TypeError`` / ``ValueError``.
"""


class CacheError(Exception):
    """A misuse of the cache or a broken invariant; the cache state is left as it was."""


class OutOfBlocks(CacheError):
    """Fewer free KV blocks than requested, even after evicting every evictable leaf."""
