"""Exceptions raised by radixcache.

Misuse of cache state (free or foreign blocks, unlocking what is not locked, running out of blocks)
raises a ``CacheError``; arguments of the wrong type or value raise ``TypeError`` / ``ValueError``.
"""


class CacheError(Exception):
    """A misuse of the cache or a broken invariant; the cache state is left as it was."""


class OutOfBlocks(CacheError):
    """Fewer free KV blocks than requested, even after evicting every evictable leaf."""


class InvalidRequest(ValueError):
    """A request an engine cannot serve as it is; ``field`` names the part at fault ("prompt",
    "stop_token_ids", "constraint", "request_id"), for front ends that report it (the server's
    ``param``)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field
