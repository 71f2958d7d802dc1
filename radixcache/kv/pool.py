"""KVPool: per-layer paged K/V storage, ``[num_blocks + 1, 2, block_size, kv_heads, head_dim]``.

The layout is FlashInfer's "NHD" paged layout with K and V interleaved per block. Block
``num_blocks`` is an extra all-zero *null block* that padding columns point at; it is never handed
out by the allocator. Positions are addressed by *K rows*: the row of (block b, offset o) in the
layer tensor viewed as ``[-1, kv_heads, head_dim]`` is ``b * 2 * block_size + o``; its V row is
``block_size`` further.

fp8 storage (e4m3) keeps one scale per layer for K and one for V, calibrated on the first K/V
written to that layer (its absolute maximum, with ``FP8_HEADROOM`` to spare) and fixed from then on,
since the blocks already written were quantized with it. The scales live on the device (``scales``,
read by the torch backend without a sync) and in a host mirror (``host_scales``, passed to FlashInfer
as floats); calibrating a layer costs one device-to-host read, once. Later K/V beyond a layer's range
are clamped to it; ``clamped_writes()`` counts the writes where that happened.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from radixcache.sizing import kv_bytes_per_token
from radixcache.store import BlockKV

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_HEADROOM = 4.0  # calibration puts the first write's amax at FP8_MAX / FP8_HEADROOM


def resolve_kv_dtype(kv_dtype, model_dtype: torch.dtype) -> torch.dtype:
    """Map ``kv_dtype`` (None, a torch dtype, or one of "fp8", "bf16", "fp16", "fp32") to a torch dtype."""
    if kv_dtype is None:
        return model_dtype
    if isinstance(kv_dtype, torch.dtype):
        return kv_dtype
    names = {"fp8": torch.float8_e4m3fn, "float8_e4m3fn": torch.float8_e4m3fn,
             "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
             "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32}
    if kv_dtype not in names:
        raise ValueError(f"kv_dtype must be None, a torch dtype or one of {sorted(names)}, got {kv_dtype!r}")
    return names[kv_dtype]


class KVPool:
    """Paged K/V tensors for every layer of one model, addressed by block id and offset.

    ``write`` and ``read`` take K rows (see ``rows_for``) and convert to and from the storage dtype,
    so callers always see the compute dtype.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, *, dtype: torch.dtype, device, kv_dtype=None):
        for name, value in [("num_layers", num_layers), ("num_blocks", num_blocks),
                            ("block_size", block_size), ("num_kv_heads", num_kv_heads),
                            ("head_dim", head_dim)]:
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.storage_dtype = resolve_kv_dtype(kv_dtype, dtype)
        self.quantized = self.storage_dtype == torch.float8_e4m3fn
        self.null_block = num_blocks
        shape = (num_blocks + 1, 2, block_size, num_kv_heads, head_dim)
        # torch.empty: on CPU the OS maps untouched pages lazily, so unused blocks cost no RAM until
        # written; on CUDA the whole pool is allocated at once. Only the null block is read without
        # being written, so only it must hold finite values.
        self.layers = [torch.empty(shape, dtype=self.storage_dtype, device=self.device)
                       for _ in range(num_layers)]
        for layer in self.layers:
            layer[self.null_block].zero_()
        self._flat = [t.view(-1, num_kv_heads, head_dim) for t in self.layers]
        if self.quantized:
            self._flat = [t.view(torch.uint8) for t in self._flat]
        self.scales = torch.zeros(num_layers, 2, dtype=torch.float32, device=self.device)  # 0: not set
        self._host_scales: list = [None] * num_layers  # (k, v) floats once the layer is calibrated
        self._clamped = torch.zeros(num_layers, 2, dtype=torch.int64, device=self.device)

    @property
    def bytes_per_token(self) -> int:
        """Bytes of K and V for one token across all layers, in storage dtype."""
        elem = torch.empty((), dtype=self.storage_dtype).element_size()
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, elem)

    @property
    def total_bytes(self) -> int:
        """Bytes the pool reserves (including the null block)."""
        return self.bytes_per_token * self.block_size * (self.num_blocks + 1)

    def rows_for(self, blocks: Sequence[int], start: int, end: int) -> torch.Tensor:
        """K rows of sequence positions ``start .. end-1`` of a sequence whose block table is ``blocks``."""
        bs = self.block_size
        if end > len(blocks) * bs or start < 0 or start > end:
            raise ValueError(f"positions {start}..{end} do not fit {len(blocks)} blocks of {bs}")
        pos = torch.arange(start, end, device=self.device)
        table = torch.as_tensor(list(blocks), dtype=torch.long, device=self.device)
        return table[pos // bs] * (2 * bs) + pos % bs

    def null_rows(self, n: int) -> torch.Tensor:
        """``n`` K rows that all point at the zero null block (for padding columns)."""
        return torch.full((n,), self.null_block * 2 * self.block_size, dtype=torch.long,
                          device=self.device)

    def write(self, layer: int, k_rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store ``keys``/``values`` (``[N, kv_heads, head_dim]``) at the positions ``k_rows`` (``[N]``)."""
        flat = self._flat[layer]
        if self.quantized:
            if not keys.numel():
                return
            if self._host_scales[layer] is None:
                self._calibrate(layer, keys, values)
            keys = self._quantize(layer, 0, keys)
            values = self._quantize(layer, 1, values)
        else:
            keys = keys.to(self.storage_dtype)
            values = values.to(self.storage_dtype)
        flat.index_copy_(0, k_rows, keys)
        flat.index_copy_(0, k_rows + self.block_size, values)

    def read(self, layer: int, k_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values (``[N, kv_heads, head_dim]``, compute dtype) at the positions ``k_rows``."""
        flat = self._flat[layer]
        keys = flat.index_select(0, k_rows)
        values = flat.index_select(0, k_rows + self.block_size)
        if self.quantized:
            return self._dequantize(layer, 0, keys), self._dequantize(layer, 1, values)
        if self.storage_dtype != self.dtype:
            return keys.to(self.dtype), values.to(self.dtype)
        return keys, values

    def host_scales(self, layer: int) -> tuple[float, float]:
        """The fp8 (K, V) scales of ``layer`` as host floats (0.0 before the layer is calibrated)."""
        return self._host_scales[layer] or (0.0, 0.0)

    def calibrated_layers(self) -> int:
        """How many layers have fp8 scales calibrated on real K/V (0 for unquantized pools)."""
        return sum(s is not None for s in self._host_scales) if self.quantized else 0

    def reset_calibration(self) -> None:
        """Forget every fp8 scale and clamp count: the next write to each layer calibrates it again.
        Only valid while no block holds K/V that must be read back (e.g. after a self-test)."""
        self.scales.zero_()
        self._host_scales = [None] * self.num_layers
        self._clamped.zero_()

    def clamped_writes(self) -> int:
        """Writes (per layer, K and V counted apart) whose values exceeded the fp8 range and were
        clamped; 0 for unquantized pools. Reads a device value: call it between steps, not per layer."""
        return int(self._clamped.sum()) if self.quantized else 0

    def copy_block(self, src: int, dst: int) -> None:
        """Copy every layer's K/V of block ``src`` into block ``dst`` (copy on write)."""
        for layer in self.layers:
            layer[dst].copy_(layer[src])

    def export_block(self, block: int) -> BlockKV:
        """A host copy of ``block``'s K/V for every layer, in storage dtype (``radixcache.store.BlockKV``).

        The copy is taken now (one device-to-host transfer on GPU, stream-ordered after the forward
        that wrote the block): later writes to ``block``, or its reuse for other tokens, never
        change it. fp8 pools attach the scales the bytes were written with.
        """
        self._check_block(block)
        raw = torch.stack([layer[block].view(torch.uint8) for layer in self.layers]).cpu()
        scales = tuple(x for layer in range(self.num_layers) for x in self.host_scales(layer)) \
            if self.quantized else ()
        return BlockKV(raw.reshape(-1).numpy(), self._dtype_name, self._block_shape, scales)

    def export_blocks(self, blocks: Sequence[int]) -> list[BlockKV]:
        """``export_block`` of every block of ``blocks`` at once: one gather per layer on the
        device and one device-to-host copy for all of them (the copies share one host buffer)."""
        for block in blocks:
            self._check_block(block)
        if not blocks:
            return []
        index = torch.tensor(list(blocks), dtype=torch.long, device=self.device)
        raw = torch.stack([layer.index_select(0, index).view(torch.uint8) for layer in self.layers],
                          dim=1).cpu()
        scales = tuple(x for layer in range(self.num_layers) for x in self.host_scales(layer)) \
            if self.quantized else ()
        return [BlockKV(raw[j].reshape(-1).numpy(), self._dtype_name, self._block_shape, scales)
                for j in range(len(blocks))]

    def import_block(self, block: int, kv: BlockKV) -> None:
        """Write ``kv`` (as ``export_block`` returns it, from any pool of this shape and dtype) into ``block``.

        fp8: a layer whose scales are not set yet adopts the value's (K and V, as a first write would
        calibrate both); per K/V of a set layer, an equal scale copies the bytes, another one
        rescales them, and a rescale that would clip is refused. ``ValueError``
        (nothing written) on another dtype or shape, a payload of the wrong size, bad scales or a
        refused rescale.
        """
        self._check_block(block)
        if kv.dtype != self._dtype_name or tuple(kv.shape) != self._block_shape:
            raise ValueError(f"block K/V is {kv.dtype}{tuple(kv.shape)}, this pool holds "
                             f"{self._dtype_name}{self._block_shape}")
        src = np.frombuffer(kv.data, dtype=np.uint8)
        per_layer = self.bytes_per_token * self.block_size // self.num_layers
        if src.size != per_layer * self.num_layers:
            raise ValueError(f"block K/V is {src.size} bytes, expected {per_layer * self.num_layers}")
        adopt = []
        if self.quantized:
            src, adopt = self._rescaled(src, kv.scales)
        elif kv.scales:
            raise ValueError(f"{self._dtype_name} K/V carries no scales, got {len(kv.scales)}")
        if self.device.type == "cpu":
            for i, layer in enumerate(self.layers):
                layer[block].view(torch.uint8).numpy().reshape(-1)[:] = src[i * per_layer:(i + 1) * per_layer]
        else:
            staged = torch.from_numpy(src.copy()).to(self.device)  # copy: src may be read-only
            for i, layer in enumerate(self.layers):
                layer[block].view(torch.uint8).view(-1).copy_(staged[i * per_layer:(i + 1) * per_layer])
        for layer, pair in adopt:
            self._set_scales(layer, pair)

    def _rescaled(self, src: np.ndarray, scales) -> tuple[np.ndarray, list]:
        """fp8 bytes re-expressed in this pool's scales, and the (layer, (K, V) scales) to adopt."""
        if len(scales) != 2 * self.num_layers:
            raise ValueError(f"fp8 K/V needs {2 * self.num_layers} scales, got {len(scales)}")
        q = src.reshape(self.num_layers, 2, -1)
        out, adopt = None, []
        for layer in range(self.num_layers):
            pair = tuple(float(scales[2 * layer + j]) for j in range(2))
            for theirs in pair:
                if not (math.isfinite(theirs) and theirs > 0):
                    raise ValueError(f"fp8 scale {theirs!r} of layer {layer} is not a positive number")
            current = self._host_scales[layer]
            if current is None:
                adopt.append((layer, pair))
                continue
            for j, (theirs, ours) in enumerate(zip(pair, current)):
                if theirs == ours:
                    continue
                x = torch.from_numpy(q[layer, j].copy()).view(torch.float8_e4m3fn).float() * theirs
                if float(x.abs().max()) > FP8_MAX * ours:
                    raise ValueError(f"fp8 K/V of layer {layer} does not fit this pool's scale "
                                     f"{ours:.3g} (written with {theirs:.3g}): refusing to clip")
                if out is None:
                    out = q.copy()
                out[layer, j] = (x / ours).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        return (src if out is None else out.reshape(-1)), adopt

    def _check_block(self, block: int) -> None:
        if isinstance(block, bool) or not isinstance(block, int) or not 0 <= block < self.num_blocks:
            raise ValueError(f"block must be an int in 0..{self.num_blocks - 1}, got {block!r}")

    @property
    def _dtype_name(self) -> str:
        return str(self.storage_dtype).removeprefix("torch.")

    @property
    def _block_shape(self) -> tuple:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    def _quantize(self, layer: int, kv: int, x: torch.Tensor) -> torch.Tensor:
        scaled = x.float() / self.scales[layer, kv]
        self._clamped[layer, kv] += scaled.abs().amax() > FP8_MAX
        return scaled.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)

    def _calibrate(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Set the K and V scales of ``layer`` from its first real write (one host read)."""
        amax = torch.stack([keys.detach().abs().amax(), values.detach().abs().amax()]).float().tolist()
        self._set_scales(layer, [max(a * FP8_HEADROOM / FP8_MAX, 1e-8) for a in amax])

    def _set_scales(self, layer: int, pair) -> None:
        """The device scales of ``layer`` and their host mirror, equal to the last bit (float32)."""
        exact = torch.tensor(list(pair), dtype=torch.float32)
        self._host_scales[layer] = tuple(exact.tolist())
        self.scales[layer].copy_(exact)

    def _dequantize(self, layer: int, kv: int, q: torch.Tensor) -> torch.Tensor:
        return (q.view(torch.float8_e4m3fn).to(torch.float32) * self.scales[layer, kv]).to(self.dtype)

    def __repr__(self) -> str:
        return (f"KVPool(layers={self.num_layers}, blocks={self.num_blocks}x{self.block_size}, "
                f"kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, dtype={self.storage_dtype})")
