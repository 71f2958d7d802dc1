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
    attention; that is what the pool holds for them. Falcon caches K/V per query head (its new
    decoder architecture expands the KV groups before caching), or one head (multi-query).
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
    if getattr(config, "model_type", None) == "falcon":
        old_mqa = not config.new_decoder_architecture and config.multi_query
        kv_heads = 1 if old_mqa else heads
    else:
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return KVGeometry(int(layers), int(kv_heads), int(head_dim), int(head_dim))


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
        flat = tensor.detach().reshape(-1)
        if flat.numel() == 0 or flat.is_meta:
            continue
        step = max(1, flat.numel() // SAMPLE)
        samples.append(flat[::step][:SAMPLE].to(torch.float32))
    if samples:
        h.update(torch.cat([s.to(samples[0].device) for s in samples]).cpu().numpy().tobytes())
    return h.hexdigest()
