"""The shared KV tier's contract: what a cache manager calls on a store of whole blocks.

Pure Python (no torch, no redis): the manager sees a store and a pool only through these
protocols. Keys and values that leave the process are defined in ``radixcache.store.keys`` and
``radixcache.store.values``; the Redis implementation is ``radixcache.integrations.redis_store``.

Block ``i`` of a token sequence is ``tokens[i*bs:(i+1)*bs]`` *given* ``tokens[:i*bs]`` before it
(a block's K/V depends on every token before it), exactly as in the radix tree.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol, runtime_checkable

STORE_COUNTERS = ("store_hit_tokens", "store_miss_blocks", "store_written_blocks",
                  "store_dropped_blocks", "store_bytes_read", "store_bytes_written", "store_errors",
                  "store_bad_values", "store_present_blocks", "store_unauthenticated_blocks")
"""Counters every store reports (all ints, monotone, readable after ``close``):

- ``store_hit_tokens``: tokens of verified blocks ``fetch`` handed back;
- ``store_miss_blocks``: blocks asked of ``fetch`` and not handed back (absent, bad, store down,
  timed out);
- ``store_written_blocks`` / ``store_bytes_written``: values the store confirmed it stored;
- ``store_dropped_blocks``: blocks offered and not stored (queue full, store down, write refused,
  not confirmed by the time ``close`` returned);
- ``store_bytes_read``: value bytes received from the store;
- ``store_errors``: failed store operations (connection, timeout, refused command);
- ``store_bad_values``: values that failed verification (each one a miss; its key is deleted);
- ``store_present_blocks``: offered blocks the store already held (not sent again);
- ``store_unauthenticated_blocks``: values without a valid MAC under the store's secret (forged,
  written without the secret, or changed since; each one a miss, also counted in
  ``store_bad_values``; its key is deleted). Always 0 for a store without a secret.
"""


class BlockKV(NamedTuple):
    """One block's K/V for every layer, as bytes that can leave the process.

    ``data``: a bytes-like object (``len(memoryview(data)) == prod(shape) * itemsize(dtype)``),
    C order over ``shape`` = ``(layers, 2, block_size, kv_heads, head_dim)`` (K then V), in the storage
    dtype named by ``dtype`` ("float32", "bfloat16", "float16", "float8_e4m3fn").
    ``scales``: for fp8 storage, the ``2 * layers`` float32 dequantization scales the bytes were
    written with (layer 0 K, layer 0 V, layer 1 K, ...); ``()`` otherwise.
    """

    data: object
    dtype: str
    shape: tuple
    scales: tuple = ()


@runtime_checkable
class BlockSource(Protocol):
    """A KV pool that can copy one block out (``radixcache.kv.pool.KVPool`` is one)."""

    def export_block(self, block: int) -> BlockKV:
        """A snapshot of ``block``'s K/V: later writes to the block never change it."""


@runtime_checkable
class BlockSink(Protocol):
    """A KV pool that can take one block in (``radixcache.kv.pool.KVPool`` is one)."""

    def import_block(self, block: int, kv: BlockKV) -> None:
        """Write ``kv`` into ``block``; ``ValueError`` (block unchanged) when it cannot hold it exactly."""


@runtime_checkable
class BlockStore(Protocol):
    """A store of whole blocks shared across processes, keyed by (namespace, every token up to the block).

    A store is bound to one block format (model identity, KV dtype, block size, K/V shape) when it is
    made; ``namespace`` is the manager's namespace tuple (tenant salt and whatever else separates
    trees) and enters every key. Every method is thread-safe; none raises because the store failed
    (down, slow, full, corrupt): failures are misses or drops, counted in ``stats()``.
    """

    block_size: int

    def fetch(self, namespace: tuple, tokens: Sequence[int], start: int, limit: int) -> list[BlockKV]:
        """Verified K/V of blocks ``start, start+1, ...`` of ``tokens``, at most ``limit`` of them.

        In chain order, stopping at the first block the store does not hold or that fails
        verification (so ``result[j]`` is block ``start + j``). Blocks past ``len(tokens) // bs``
        are never asked for. Waits on the network for a bounded time; call it without holding a
        lock that other requests need. ``TypeError``/``ValueError`` only for bad arguments.
        """

    def offer(self, namespace: tuple, tokens: Sequence[int], start: int, blocks: Sequence[int],
              pool: BlockSource) -> int:
        """Queue blocks ``start .. start+len(blocks)-1`` of ``tokens`` for writing; returns how many.

        ``blocks[j]`` is the pool block holding block ``start + j``; ``len(tokens)`` must cover
        them. The accepted ones are snapshotted (``pool.export_blocks`` where the pool has it, else
        ``export_block`` each) before this returns, so the caller may free or reuse the blocks at
        once; call it while holding a reference to them (a computed block is never written again
        while referenced, so no other lock is needed: ``CacheManager`` calls it outside its lock,
        with the blocks' tree node locked).
        Never waits on the network; blocks that do not fit the write queue (or arrive while the
        store is down) are dropped and counted.
        """

    def stats(self) -> dict:
        """The ``STORE_COUNTERS`` as a dict of ints."""

    def close(self, timeout: float = 10.0) -> dict:
        """Stop accepting writes, wait up to ``timeout`` s for queued ones, return the final ``stats()``.

        Blocks not confirmed written by then count as dropped. Idempotent; ``stats()`` stays readable.
        """


__all__ = ["STORE_COUNTERS", "BlockKV", "BlockSink", "BlockSource", "BlockStore"]
