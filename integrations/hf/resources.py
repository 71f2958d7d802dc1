"""What ``wrap()`` sets up around a model besides the cache: the pool's default size, the shared
store, and which models it cannot serve at all."""

from __future__ import annotations

import os

import torch

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


def unsupported_reason(model) -> str | None:
    """Why radixcache cannot serve ``model`` at all (None when it can): encoder-decoders and layer
    types that keep no paged K/V (recurrent, linear attention) fall back to plain transformers."""
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        return "encoder-decoder models are not supported"
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layer_types = getattr(text, "layer_types", None) or []
    other = sorted(set(layer_types) - SUPPORTED_LAYER_TYPES)
    if other:
        return f"layers of type {other} keep no paged K/V"
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
