"""The records a CacheManager keeps: one Lease per running sequence, one Ledger of statistics."""

from __future__ import annotations

from dataclasses import dataclass, field

from radixcache.tree import Namespace, Node


@dataclass(eq=False)
class Lease:
    """One sequence's hold on the cache. Owned by the manager: callers read it, never write it.

    ``blocks[i]`` holds the K/V of positions ``i*bs .. i*bs+bs-1``; ``computed`` leading tokens
    have K/V there; ``committed`` leading whole blocks are in the tree; ``cached_tokens`` prompt
    tokens were served from the cache at admission (what the server reports as
    ``usage.prompt_tokens_details.cached_tokens``).
    """

    namespace: Namespace
    blocks: list
    node: Node | None
    computed: int = 0
    committed: int = 0
    cached_tokens: int = 0
    released: bool = False
    committed_tokens: tuple = ()  # the tokens of the committed blocks (checked on every commit)


@dataclass
class Ledger:
    """The statistics of every request the manager served (the one ledger; counters in tokens)."""

    requests: int = 0
    queried_tokens: int = 0
    hit_tokens: int = 0
    computed_prompt_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    fallbacks: int = 0
    fallback_reasons: dict = field(default_factory=dict)
