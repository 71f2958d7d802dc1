"""Switch a model to radixcache's paged attention (delegating to its original one without a plan)."""

from __future__ import annotations

import importlib.util
import sys

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from radixcache.errors import CacheError

PREFIX = "radixcache_paged_"


def resolve_backend(name: str, device: torch.device, dtype: torch.dtype | None = None,
                    storage_dtype: torch.dtype | None = None):
    """The attention backend for ``name`` ("auto", "torch" or "flashinfer") on ``device``.

    "auto" picks FlashInfer on CUDA when it is installed and can serve the model's dtype (fp16 or
    bf16 compute, a pool of the same dtype or fp8), the torch reference otherwise.
    """
    if name not in ("auto", "torch", "flashinfer"):
        raise ValueError(f"attention must be 'auto', 'torch' or 'flashinfer', got {name!r}")
    has_flashinfer = importlib.util.find_spec("flashinfer") is not None
    half = (torch.float16, torch.bfloat16)
    servable = dtype in half and storage_dtype in (dtype, torch.float8_e4m3fn)
    if name == "flashinfer" or (name == "auto" and device.type == "cuda" and has_flashinfer
                                and servable):
        if device.type != "cuda":
            raise CacheError("attention='flashinfer' needs the model on a CUDA device")
        if not has_flashinfer:
            raise CacheError("attention='flashinfer' needs flashinfer-python: pip install 'radixcache[gpu]'")
        from radixcache.attention.flashinfer_backend import FlashInferBackend

        return FlashInferBackend(device)
    from radixcache.attention.torch_backend import TorchBackend

    return TorchBackend()


def install(model) -> None:
    """Make every attention layer of ``model`` serve ``radixcache_plan`` forwards (idempotent).

    The original implementation (sdpa, eager, ...) still serves every forward without a plan.
    """
    original = model.config._attn_implementation
    if original.startswith(PREFIX):
        return
    name = PREFIX + original
    if name not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(name, _make_attention(original))
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[original]
                                        if original in ALL_MASK_ATTENTION_FUNCTIONS
                                        else ALL_MASK_ATTENTION_FUNCTIONS["eager"])
    model.set_attn_implementation(name)


def _make_attention(original: str):
    def paged_attention(module, query, key, value, attention_mask, **kwargs):
        plan = kwargs.pop("radixcache_plan", None)
        if plan is None:
            return _original_function(original, module)(module, query, key, value, attention_mask,
                                                        **kwargs)
        layer = module.layer_idx
        plan.pool.write(layer, plan.write_rows, key[0].transpose(0, 1), value[0].transpose(0, 1))
        scale = kwargs.get("scaling")
        if scale is None:
            scale = query.shape[-1] ** -0.5
        out = plan.backend.attend(layer, query[0].transpose(0, 1), plan, scale,
                                  sliding_window=kwargs.get("sliding_window"),
                                  softcap=kwargs.get("softcap"))
        return out[None], None

    return paged_attention


def _original_function(original: str, module):
    if original != "eager" and original in ALL_ATTENTION_FUNCTIONS:
        return ALL_ATTENTION_FUNCTIONS[original]
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if eager is None:
        raise CacheError(f"cannot find the original '{original}' attention of {type(module).__name__}")
    return eager
