"""Which attention backend serves a model: ``resolve_backend``."""

from __future__ import annotations

import importlib.util

import torch

from radixcache.errors import CacheError

NAMES = ("auto", "torch", "torch-inplace", "flashinfer")


def check_name(name) -> None:
    """``ValueError`` naming the choices unless ``name`` is one of ``NAMES``."""
    if name not in NAMES:
        raise ValueError(f"attention must be one of {', '.join(map(repr, NAMES))}, got {name!r}")


def resolve_backend(name: str, device: torch.device, dtype: torch.dtype | None = None,
                    storage_dtype: torch.dtype | None = None):
    """The attention backend for ``name`` ("auto", "torch", "torch-inplace" or "flashinfer") on
    ``device``; "torch-inplace" is the torch backend with decodes reading the pool in place on CPU
    (``TorchBackend(in_place=True)``).

    "auto" picks FlashInfer on CUDA when it is installed and can serve the model's dtype (fp16 or
    bf16 compute, a pool of the same dtype or fp8); on a CPU, "torch-inplace" for a half-precision
    model with a pool of its own dtype where the kernel builds (otherwise the reason is logged once),
    since its decodes are faster and half precision already rounds reused K/V differently from one
    forward over the whole prompt; the torch reference otherwise, float32 included, where the gather
    keeps greedy tokens equal to plain ``generate``'s bit for bit. Raises ``ValueError`` for an
    unknown name and ``CacheError`` when "flashinfer" or "torch-inplace" cannot run here.
    """
    check_name(name)
    device = torch.device(device)
    has_flashinfer = importlib.util.find_spec("flashinfer") is not None
    half = (torch.float16, torch.bfloat16)
    servable = dtype in half and storage_dtype in (dtype, torch.float8_e4m3fn)
    if name == "flashinfer" or (name == "auto" and device.type == "cuda" and has_flashinfer
                                and servable):
        if device.type != "cuda":
            raise CacheError("attention='flashinfer' needs the model on a CUDA device")
        if not has_flashinfer:
            raise CacheError("attention='flashinfer' needs flashinfer-python: pip install flashinfer-python (radixcache's [gpu] extra)")
        from radixcache.attention.flashinfer_backend import FlashInferBackend

        return FlashInferBackend(device)
    from radixcache.attention import paged_cpu
    from radixcache.attention.torch_backend import TorchBackend

    in_place = name == "torch-inplace" or (name == "auto" and device.type == "cpu" and dtype in half
                                           and storage_dtype == dtype and paged_cpu.kernel() is not None)
    return TorchBackend(in_place=in_place, device=device)
