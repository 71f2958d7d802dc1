"""Model identity (what roots every namespace) and KV geometry of a transformers model.

``model_identity(model)`` is a blake2b digest of what determines the model's K/V: its architecture
config (without paths, versions or the attention implementation), its parameter dtype, and a
strided sample of every tensor of its state dict (names, shapes, dtypes and ``SAMPLE`` evenly
spaced values each). The same weights give the same id in any process on any machine; two
checkpoints differ in practically every sampled value. It costs one gather of the samples and one
device-to-host copy. A change the sample cannot see (an in-place adapter swap, a few edited
entries) is the caller's to declare: ``wrap(model, model_id=...)`` names the weights explicitly,
and ``CachedLM.invalidate()`` drops every cached block after the weights changed.
"""

from __future__ import annotations

import hashlib
import json
from typing import NamedTuple

import torch

SAMPLE = 1024  # values per tensor in the digest
DIGEST_BYTES = 16
VOLATILE_CONFIG_KEYS = {"transformers_version", "torch_dtype", "dtype"}


class KVGeometry(NamedTuple):
    """What one token's K/V is in every attention layer of a model: ``layers``, ``kv_heads`` and the
    head dims of K (``head_dim``) and V (``head_dim_v``), as the attention layers attend over them."""

    layers: int
    kv_heads: int
    head_dim: int
    head_dim_v: int


def kv_geometry(config) -> KVGeometry:
    """The ``KVGeometry`` of a transformers config (text part for multimodal configs).

    MLA models (a ``kv_lora_rank``: DeepSeek-V2/V3, Kimi K2) expand their compressed latent into
    per-head K (``qk_nope_head_dim + qk_rope_head_dim``) and V (``v_head_dim``) right before
    attention; that is what the pool holds for them. Falcon's config names its cached heads
    ``num_key_value_heads`` (its KV groups, or 1 for the original multi-query layout) since
    transformers 5.25. This is the estimate from the config alone; the wrapper sizes its pool by
    ``cached_kv_geometry`` (what the model's own forward shows).
    ``ValueError`` for a config without attention heads (Mamba, RWKV: there is no K/V to page).
    """
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = config.num_hidden_layers
    heads = getattr(config, "num_attention_heads", None)
    if not heads:
        raise ValueError(f"{type(config).__name__} has no attention heads: no K/V to page")
    if getattr(config, "kv_lora_rank", None) is not None:
        return KVGeometry(int(layers), int(heads),
                          int(config.qk_nope_head_dim + config.qk_rope_head_dim), int(config.v_head_dim))
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return KVGeometry(int(layers), int(kv_heads), int(head_dim), int(head_dim))


def cached_kv_geometry(model) -> KVGeometry:
    """The ``KVGeometry`` a paged pool must hold for ``model``, read off a two-token forward of its
    own (after ``attention.install(model)``): the key and value shapes its attention hook is handed
    (``recording_kv_shapes``, one call per layer), or, for a model that computes attention itself (dense, e.g. Falcon),
    those its ``DynamicCache`` layers hold. Not guessed from the config: transformers 5.25 changed
    what Falcon's new decoder architecture caches (its KV groups, not every query head) and made
    MLA models cache their latent, which they expand before attention (the hook sees per-head K/V).
    ``kv_geometry(model.config)`` when the forward fails or shows no K/V (the self-test then names
    the failure); ``ValueError`` when layers differ in shape (one pool holds one geometry)."""
    from transformers import DynamicCache

    from radixcache.integrations.hf.attention import recording_kv_shapes
    from radixcache.integrations.hf.cache import hooked

    cache = DynamicCache(config=model.config)
    ids = torch.zeros((1, 2), dtype=torch.long, device=next(model.parameters()).device)
    try:
        with recording_kv_shapes() as seen, torch.no_grad():
            model(input_ids=ids, cache=cache, use_cache=True)
        if not hooked(model):
            seen = [(k.shape[1], k.shape[-1], v.shape[-1]) for k, v in
                    ((layer.keys, layer.values) for layer in cache.layers)]
    except Exception:  # noqa: BLE001 - the self-test runs the same forward and names the error
        return kv_geometry(model.config)
    shapes = {tuple(int(n) for n in shape) for shape in seen}
    if not shapes:
        return kv_geometry(model.config)
    if len(shapes) > 1:
        raise ValueError(f"the layers of {type(model).__name__} cache K/V of different shapes "
                         f"(heads, head_dim, head_dim_v) {sorted(shapes)}: one pool cannot hold them")
    (heads, head_dim, head_dim_v), = shapes
    return KVGeometry(len(seen), heads, head_dim, head_dim_v)


def _config_json(config) -> str:
    def clean(d):
        return {str(k): clean(v) if isinstance(v, dict) else v for k, v in d.items()
                if not str(k).startswith("_") and k not in VOLATILE_CONFIG_KEYS}
    return json.dumps(clean(config.to_dict()), sort_keys=True, default=str)


def model_identity(model) -> str:
    """The deterministic id of ``model``'s weights (see the module docstring), as hex."""
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    h.update(type(model).__name__.encode())
    h.update(_config_json(model.config).encode())
    h.update(str(next(model.parameters()).dtype).encode())
    samples = []
    for name, tensor in model.state_dict().items():
        h.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
        for part in _plain_parts(tensor):
            flat = part.detach().reshape(-1)
            if flat.numel() == 0 or flat.is_meta:
                continue
            step = max(1, flat.numel() // SAMPLE)
            samples.append(flat[::step][:SAMPLE].to(torch.float32))
    if samples:
        h.update(torch.cat([s.to(samples[0].device) for s in samples]).cpu().numpy().tobytes())
    return h.hexdigest()


def _plain_parts(tensor) -> list:
    """The plain tensors ``tensor`` consists of: itself, or the inner tensors of a tensor subclass
    (torchao's quantized weights: int8 data and scales), depth first."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if not is_traceable_wrapper_subclass(tensor):
        return [tensor]
    names, _ = tensor.__tensor_flatten__()
    return [plain for name in names for plain in _plain_parts(getattr(tensor, name))]
