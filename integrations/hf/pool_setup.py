"""The KV pool of a wrapped model: how it is made and sized, what ``stats()`` adds about it, and
the warning when fp8 K/V writes were clamped to the calibrated range."""

from __future__ import annotations

import logging
from typing import Callable

import torch

from radixcache.integrations.hf.identity import KVGeometry
from radixcache.integrations.hf.resources import default_cache_tokens
from radixcache.kv.geometry import kv_bytes_per_token
from radixcache.kv.pool import KVPool

logger = logging.getLogger("radixcache")


def pool_maker(geometry: KVGeometry, block_size: int, dtype, device,
               kv_dtype) -> Callable[[int], KVPool]:
    """A function ``num_blocks -> KVPool`` for a model of ``geometry``: blocks of ``block_size``
    tokens on ``device``, for a model of ``dtype``, stored as ``kv_dtype`` (None: ``dtype``)."""

    def make_pool(num_blocks: int) -> KVPool:
        return KVPool(geometry.layers, num_blocks, block_size, geometry.kv_heads,
                      geometry.head_dim, dtype=dtype, device=device,
                      kv_dtype=kv_dtype, head_dim_v=geometry.head_dim_v)

    return make_pool


def pool_blocks(geometry: KVGeometry, block_size: int, max_cache_tokens: int | None, storage,
                device) -> int:
    """Blocks of the pool (at least 1): ``max_cache_tokens // block_size``; without
    ``max_cache_tokens``, the tokens of the default share of memory on ``device``
    (``default_cache_tokens``) at the bytes per token of ``geometry`` stored as ``storage``."""
    if max_cache_tokens is None:
        element = torch.empty((), dtype=storage).element_size()
        max_cache_tokens = default_cache_tokens(kv_bytes_per_token(*geometry, element), device)
    return max(1, max_cache_tokens // block_size)


def pool_stats(pool: KVPool | None) -> dict:
    """The keys ``CachedLM.stats()`` adds to the manager's: ``kv_bytes_per_token``,
    ``kv_pool_bytes`` and ``fp8_clamped_writes``; with no pool (a model ``wrap()`` ruled out)
    these are 0, and so are ``free_tokens`` and ``capacity_tokens``."""
    if pool is None:  # a model wrap() ruled out: no pool, every call is plain generate
        return dict(free_tokens=0, capacity_tokens=0, kv_bytes_per_token=0, kv_pool_bytes=0,
                    fp8_clamped_writes=0)
    return dict(kv_bytes_per_token=pool.bytes_per_token, kv_pool_bytes=pool.total_bytes,
                fp8_clamped_writes=pool.clamped_writes())


class Fp8ClampWarning:
    """Warns on the ``radixcache`` logger when an fp8 pool clamped more K/V writes than it had at
    the last ``check`` (``seen`` counts those already warned about)."""

    def __init__(self):
        self.seen = 0

    def check(self, pool: KVPool | None) -> None:
        """Warn about the writes ``pool`` clamped since the last call (nothing for no pool or a
        pool that is not quantized)."""
        if pool is None or not pool.quantized:
            return
        clamped = pool.clamped_writes()
        if clamped > self.seen:
            logger.warning("radixcache: %d fp8 K/V writes exceeded the range calibrated on the "
                           "first K/V and were clamped; use kv_dtype='bf16' if outputs drift",
                           clamped - self.seen)
            self.seen = clamped
