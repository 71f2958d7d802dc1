"""What ``wrap()`` sets up around a model besides the cache: the pool's default size, the shared
store, and which models it cannot serve at all (decided before any pool is allocated).

The KV pool itself: how it is made and sized (``pool_maker``, ``pool_blocks``), what ``stats()``
adds about it (``pool_stats``), and the warning when fp8 K/V writes were clamped to the calibrated
range (``Fp8ClampWarning``).
"""

from __future__ import annotations

import logging
import os
from typing import Callable

import torch

from radixcache.integrations.hf.identity import KVGeometry
from radixcache.kv.geometry import kv_bytes_per_token
from radixcache.kv.pool import KVPool


SUPPORTED_LAYER_TYPES = {"full_attention", "sliding_attention"}
CPU_MEMORY_SHARE = 0.25  # default pool size: this share of available RAM ...
GPU_MEMORY_SHARE = 0.5  # ... or of free GPU memory


def default_cache_tokens(bytes_per_token: int, device: torch.device) -> int:
    """Tokens that fit in the documented default share of memory on ``device``."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return max(1, int(free * GPU_MEMORY_SHARE // bytes_per_token))
    try:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) * 1024 for line in f
                             if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    return max(1, int(available * CPU_MEMORY_SHARE // bytes_per_token))


ALIBI_MODEL_TYPES = {"bloom", "mpt"}  # transformers' modelling adds an ALiBi bias, always


def model_family(model) -> str:
    """The model's family as its class names it: ``MambaForCausalLM`` -> "Mamba"."""
    name = type(model).__name__
    for suffix in ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration", "Model"):
        if name.endswith(suffix) and len(name) > len(suffix):
            return name[:-len(suffix)]
    return name


def unsupported_reason(model) -> str | None:
    """Why radixcache cannot serve ``model`` at all (None when it can), naming the model:
    encoder-decoders, layers that keep no paged K/V (Mamba and other state-space or recurrent
    layers, linear attention, convolutions; hybrids that mix them with attention) and an ALiBi
    position bias (Bloom, MPT, Falcon with ``alibi``), which the backends do not add. Decided from
    the config alone, before any pool exists; such a model gets no pool and plain transformers."""
    config = model.config
    family = model_family(model)
    if getattr(config, "is_encoder_decoder", False):
        return f"encoder-decoder models are not supported ({family})"
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layer_types = getattr(text, "layer_types", None) or []
    other = sorted(set(layer_types) - SUPPORTED_LAYER_TYPES)
    if other:
        return f"non-attention layers ({family}: layers of type {', '.join(other)} keep no paged K/V)"
    if not getattr(text, "num_attention_heads", None):
        return f"non-attention layers ({family}: the config has no attention heads)"
    if getattr(text, "model_type", None) in ALIBI_MODEL_TYPES or getattr(text, "alibi", False) is True:
        return f"ALiBi position bias ({family})"
    return None


def open_store(store, pool, model_id: str):
    """The ``BlockStore`` for ``wrap(store=...)``: None, a Redis URL (a ``RedisStore`` of the pool's
    block format for ``model_id``), or a ready ``BlockStore`` (its block size must match)."""
    if store is None:
        return None
    if isinstance(store, str):
        from radixcache.integrations.redis_store import RedisStore, pool_format

        return RedisStore(store, pool_format(pool, model=model_id))
    from radixcache.store import BlockStore

    if not isinstance(store, BlockStore):
        raise TypeError(f"store must be a redis:// URL or a radixcache.store.BlockStore, got "
                        f"{type(store).__name__}")
    return store


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
    the last ``warn_new`` (``seen`` counts those already warned about)."""

    def __init__(self):
        self.seen = 0

    def warn_new(self, pool: KVPool | None) -> None:
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
