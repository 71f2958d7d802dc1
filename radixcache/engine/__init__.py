"""Continuous batching over shared KV blocks (see ``Engine``)."""

from radixcache.engine.core import Engine, RunStats

__all__ = ["Engine", "RunStats"]
