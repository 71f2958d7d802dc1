"""Small KV pools with known contents for the store tests."""

from __future__ import annotations

import torch

from radixcache.integrations.redis_store import RedisStore, pool_format
from radixcache.kv.pool import KVPool

LAYERS, BLOCKS, BS, HEADS, DIM = 2, 16, 4, 1, 8
NS = ("model-fingerprint", None)  # the manager's namespace: (model identity, tenant salt)
FAST = dict(timeout=0.3, connect_timeout=0.3, backoff=(0.05, 0.2))


def make_pool(block_size: int = BS, kv_dtype=None) -> KVPool:
    return KVPool(LAYERS, BLOCKS, block_size, HEADS, DIM, dtype=torch.float32, device="cpu",
                  kv_dtype=kv_dtype)


def fill(pool: KVPool, blocks, seed: int = 0) -> None:
    """Write distinct random K/V into each of ``blocks``."""
    g = torch.Generator().manual_seed(seed)
    for block in blocks:
        rows = pool.rows_for([block], 0, pool.block_size)
        for layer in range(pool.num_layers):
            shape = (pool.block_size, pool.num_kv_heads, pool.head_dim)
            pool.write(layer, rows, torch.randn(shape, generator=g), torch.randn(shape, generator=g))


def contents(pool: KVPool, block: int) -> list[torch.Tensor]:
    """Every layer's K and V of ``block`` (for equality checks)."""
    rows = pool.rows_for([block], 0, pool.block_size)
    return [t for layer in range(pool.num_layers) for t in pool.read(layer, rows)]


def same_block(a: KVPool, block_a: int, b: KVPool, block_b: int) -> bool:
    return all(torch.equal(x, y) for x, y in zip(contents(a, block_a), contents(b, block_b)))


def open_store(url: str, pool: KVPool, model: str = "tiny-model", **options) -> RedisStore:
    """A ``RedisStore`` of ``pool``'s format with short timeouts and backoff (options override)."""
    return RedisStore(url, pool_format(pool, model), **{**FAST, **options})


def tokens(n_blocks: int, block_size: int = BS, start: int = 100) -> list[int]:
    return list(range(start, start + n_blocks * block_size))
