"""A block's payload (``radixcache.store.BlockKV`` bytes) into a pool's tensors: fp8 rescaling and
the copy. Every layer's payload is its K bytes (``[block_size, kv_heads, head_dim]``, token-major
whatever the pool's own layout) then its V bytes (``[block_size, kv_heads, head_dim_v]``), in
storage dtype."""

from __future__ import annotations

import math

import numpy as np
import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def fp8_in_scales(src: np.ndarray, scales, current: list, k_elems: int) -> tuple[np.ndarray, list]:
    """fp8 ``src`` bytes (every layer's K then V, ``k_elems`` K bytes per layer) written with
    ``scales`` (layer 0 K, layer 0 V, layer 1 K, ...), re-expressed in the pool's ``current`` scales
    (per layer a (K, V) pair, or None when the layer is not calibrated yet); returns the bytes and
    the (layer, (K, V) scales) the pool must adopt for its uncalibrated layers. ``ValueError`` for
    a wrong number of scales, one that is not a positive number, or a rescale that would clip."""
    layers = len(current)
    if len(scales) != 2 * layers:
        raise ValueError(f"fp8 K/V needs {2 * layers} scales, got {len(scales)}")
    q = src.reshape(layers, -1)
    out, adopt = None, []
    for layer in range(layers):
        pair = tuple(float(scales[2 * layer + j]) for j in range(2))
        for theirs in pair:
            if not (math.isfinite(theirs) and theirs > 0):
                raise ValueError(f"fp8 scale {theirs!r} of layer {layer} is not a positive number")
        if current[layer] is None:
            adopt.append((layer, pair))
            continue
        for j, (theirs, ours) in enumerate(zip(pair, current[layer])):
            if theirs == ours:
                continue
            part = slice(0, k_elems) if j == 0 else slice(k_elems, None)
            x = torch.from_numpy(q[layer, part].copy()).view(torch.float8_e4m3fn).float() * theirs
            if float(x.abs().max()) > FP8_MAX * ours:
                raise ValueError(f"fp8 K/V of layer {layer} does not fit this pool's scale "
                                 f"{ours:.3g} (written with {theirs:.3g}): refusing to clip")
            if out is None:
                out = q.copy()
            out[layer, part] = (x / ours).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    return (src if out is None else out.reshape(-1)), adopt


def write_payload(keys: list, values: list, block: int, src: np.ndarray) -> None:
    """Copy one block's payload ``src`` into ``block`` of the per-layer ``keys`` / ``values``
    tensors (``[blocks, kv_heads, block_size, dim]``, the pool's layout; one host-to-device
    transfer off the CPU)."""
    k_bytes = keys[0][block].numel() * keys[0].element_size()
    per_layer = k_bytes + values[0][block].numel() * values[0].element_size()
    staged = torch.from_numpy(src.copy())  # copy: src may be read-only
    if keys[0].device.type != "cpu":
        staged = staged.to(keys[0].device)
    for i, (k, v) in enumerate(zip(keys, values)):
        base = i * per_layer
        for tensor, part in ((k, staged[base:base + k_bytes]), (v, staged[base + k_bytes:base + per_layer])):
            into = tensor[block].view(torch.uint8)  # [kv_heads, block_size, dim bytes]
            into.copy_(part.view(into.shape[1], into.shape[0], into.shape[2]).transpose(0, 1))
