"""What RadixCache calls return: ``Match`` (match), ``Adopted`` (adopt) and ``CacheStats``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from radixcache.tree.nodes import Node


class Match(NamedTuple):
    """Result of ``RadixCache.match``.

    ``length`` tokens (a multiple of block_size) are cached in ``blocks`` (in order); ``node`` is the
    deepest matched node (the namespace root when nothing matched), ready to ``lock``.

    After those tokens, the next ``tail_length`` tokens of the query (``0 <= tail_length <
    block_size``) are cached in positions ``0 .. tail_length-1`` of block ``tail_block`` (a partial
    tail kept at a leaf, or the first block of a child that diverges inside it). The tree keeps its
    reference: a caller that wants those tokens retains the block at once, copies it into a block
    of its own (copy on write) and never writes into ``tail_block``.
    """

    length: int
    blocks: tuple
    node: Node
    tail_length: int = 0
    tail_block: int | None = None


class Adopted(NamedTuple):
    """Result of ``RadixCache.adopt``: ``cached`` leading tokens were in the tree already; ``node``
    ends at the last whole block of the tokens (ready to ``lock``); ``blocks`` are the tree's block
    ids for every whole block of the tokens."""

    cached: int
    node: Node
    blocks: tuple


@dataclass
class CacheStats:
    """Token-level counters: hit rate = hit_tokens / queried_tokens (comparable to vLLM/SGLang)."""

    queried_tokens: int = 0
    hit_tokens: int = 0
    inserted_tokens: int = 0
    evicted_blocks: int = 0

    @property
    def hit_rate(self) -> float:
        """Fraction of queried tokens that were served from the cache (0.0 before any query)."""
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0
