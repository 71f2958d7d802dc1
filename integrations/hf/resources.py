"""What ``wrap()`` sets up around a model besides the cache: the pool's default size, the shared
store, and which models it cannot serve at all (decided before any pool is allocated)."""

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
