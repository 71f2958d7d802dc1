"""The checks a CacheManager runs on its arguments before it changes anything: each raises the
exception that names the problem (TypeError for a wrong type, ValueError for a bad number,
CacheError for a lease or tokens that do not fit the cache's state) and otherwise returns None."""

from __future__ import annotations

from collections.abc import Sequence

from radixcache.errors import CacheError
from radixcache.lifecycle.lease import Lease
from radixcache.tokens import token_array

__all__ = ["check_computed", "check_continues", "check_live", "check_publisher", "check_seconds",
           "check_store", "check_tokens_cover", "packed_prompt"]


def packed_prompt(tokens: Sequence[int]):
    """``tokens`` packed (``radixcache.tokens.token_array``: TypeError/ValueError for bad ids);
    ValueError for an empty prompt."""
    tokens = token_array(tokens)
    if not tokens:
        raise ValueError("empty prompt: a request needs at least one token")
    return tokens


def check_live(lease, live: dict, what: str) -> None:
    """TypeError unless ``lease`` is a Lease; CacheError unless it is live in ``live`` (a manager's
    live leases by ``id``): released, or another manager's. ``what`` names the calling verb."""
    if not isinstance(lease, Lease):
        raise TypeError(f"{what}: expected a Lease from admit(), got {type(lease).__name__}")
    if lease.released or live.get(id(lease)) is not lease:
        raise CacheError(f"{what}: the lease was released (or belongs to another manager)")


def check_computed(lease: Lease, tokens: Sequence[int], computed: int, block_size: int) -> None:
    """CacheError unless ``computed`` (of ``commit``) lies between ``lease.computed`` and what both
    ``tokens`` and the lease's blocks can hold."""
    most = min(len(tokens), len(lease.blocks) * block_size)
    if not lease.computed <= computed <= most:
        raise CacheError(f"commit: computed={computed} must lie in {lease.computed}.."
                         f"{most} (tokens and blocks)")


def check_tokens_cover(lease: Lease, tokens: Sequence[int]) -> None:
    """CacheError unless ``tokens`` (of ``release``) include the ``lease.computed`` computed."""
    if len(tokens) < lease.computed:
        raise CacheError(f"release: {len(tokens)} tokens, but {lease.computed} were computed")


def check_continues(lease: Lease, tokens: Sequence[int], block_size: int) -> None:
    """CacheError unless ``tokens`` start with the first and the last of ``lease``'s committed
    blocks (``lease.tokens``): reading two blocks, whatever the context, catches a commit of
    another sequence."""
    bs, done = block_size, lease.committed
    for lo in {0, (done - 1) * bs} if done else ():
        if token_array(tokens[lo:lo + bs]) != lease.tokens[lo:lo + bs]:
            raise CacheError("commit: the tokens differ from the ones committed before")


def check_seconds(seconds) -> None:
    """TypeError unless ``seconds`` (of ``keep``) is an int or float (not a bool); ValueError
    unless it is >= 0 (NaN is not)."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        raise TypeError(f"keep: seconds must be a number, got {seconds!r}")
    if not seconds >= 0:
        raise ValueError(f"keep: seconds must be >= 0, got {seconds!r}")


def check_store(store, pool, block_size: int) -> None:
    """ValueError unless ``store`` is None, or the manager has a ``pool`` to copy blocks with and
    ``store.block_size`` is its ``block_size``."""
    if store is not None and (pool is None or store.block_size != block_size):
        raise ValueError("a store needs the manager's pool and the same block size")


def check_publisher(publisher) -> None:
    """TypeError unless ``publisher`` is None or a KV event publisher (it has a ``log``)."""
    if publisher is not None and not hasattr(publisher, "log"):
        raise TypeError(f"use_events takes a KVEventPublisher or None, got "
                        f"{type(publisher).__name__}")
