"""The baseline ``benchmarks/tree_ops.py`` times the radix tree against: the vLLM approach to prefix
caching, a dict from a block's chained digest to its block id over full blocks only (``HashChainIndex``),
with ``hashlib.sha256`` or ``xxhash.xxh3_128`` as the digest (``HASHES``).

``digest_i = H(digest_{i-1} || tokens of block i as uint32 bytes)``; insert hashes every full block
and adds the missing ones, match hashes until the first missing digest. It does no reference
counting, no LRU bookkeeping and no validation, so it is a lower bound on what a hash-chain index
costs."""

from __future__ import annotations

import hashlib
from array import array

import xxhash


def _sha256_digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


HASHES = {"sha256": (_sha256_digest, 32), "xxh3": (xxhash.xxh3_128_digest, 16)}


class HashChainIndex:
    """vLLM-style prefix index: full blocks keyed by a digest chained over the parent's digest.

    ``table`` maps ``H(parent_digest || block tokens as uint32 bytes)`` to the block id that holds
    that block's KV. No reference counts, no eviction: only the lookup structure is measured.
    """

    def __init__(self, block_size: int, digest, digest_size: int):
        self.block_size = block_size
        self.digest = digest
        self.root = bytes(digest_size)
        self.table: dict[bytes, int] = {}

    def insert(self, tokens, blocks) -> int:
        """Add every missing full block of ``tokens``; return how many leading tokens were indexed."""
        data = array("I", tokens).tobytes()
        step = 4 * self.block_size
        h, table, parent = self.digest, self.table, self.root
        cached = -1
        for i in range(len(tokens) // self.block_size):
            parent = h(parent + data[i * step:(i + 1) * step])
            if parent not in table:
                table[parent] = blocks[i]
                if cached < 0:
                    cached = i
        if cached < 0:
            cached = len(tokens) // self.block_size
        return cached * self.block_size

    def match(self, tokens) -> tuple[int, list[int]]:
        """Longest indexed prefix of full blocks: (tokens matched, block ids)."""
        data = array("I", tokens).tobytes()
        step = 4 * self.block_size
        h, table, parent = self.digest, self.table, self.root
        blocks = []
        for i in range(len(tokens) // self.block_size):
            parent = h(parent + data[i * step:(i + 1) * step])
            block = table.get(parent)
            if block is None:
                break
            blocks.append(block)
        return len(blocks) * self.block_size, blocks
