"""Exceptions raised by radixcache. Every error the library raises on purpose derives from CacheError."""


class CacheError(Exception):
    """A misuse of the cache or a broken invariant; the cache state is left as it was."""


class OutOfBlocks(CacheError):
    """Fewer free KV blocks than requested, even after evicting every evictable leaf."""
