"""KVPool: per-layer paged K/V storage, K ``[num_blocks + 1, kv_heads, block_size, head_dim]`` and
V ``[num_blocks + 1, kv_heads, block_size, head_dim_v]`` (FlashInfer's "HND" paged layout as a
``(k_cache, v_cache)`` pair: heads first within a block, so a sequence's context gathers straight
into the ``[S, kv_heads, L, d]`` layout attention reads, one ``block_size x d`` chunk at a time).

K and V may have different head dims (MLA models: K is ``qk_nope + qk_rope``, V ``v_head_dim``).
Block ``num_blocks`` is an extra all-zero *null block* that padding columns point at; it is never
handed out by the allocator. Positions are addressed by *rows*: the row of (block b, offset o) is
``b * block_size + o``; ``rows`` computes them from a block table with tensor ops, on the pool's
device. Within a layer's tensor viewed as ``[-1, dim]``, head h of row r is *slot*
``(r // block_size * kv_heads + h) * block_size + r % block_size`` (``slots``), and head h of
block b is *chunk* ``b * kv_heads + h`` of the tensor viewed as ``[-1, block_size, dim]``
(``chunks``).

fp8 storage (e4m3) keeps one scale per layer for K and one for V (``radixcache.kv.fp8_scales``:
calibrated on the first K/V written to the layer, or adopted from an imported block, then fixed; on
the device as ``scales`` and in a host mirror, ``host_scales``). Its lock orders a first write's
calibration against an import adopting scales and an export reading them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from radixcache.kv.fp8_scales import FP8_HEADROOM, LayerScales
from radixcache.kv.geometry import kv_bytes_per_token
from radixcache.kv.payload import FP8_MAX, fp8_in_scales, write_payload
from radixcache.store import BlockKV

__all__ = ["FP8_HEADROOM", "FP8_MAX", "KVPool", "resolve_kv_dtype"]


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

    ``write`` and ``read`` take rows (see ``rows``) and convert to and from the storage dtype, so
    callers always see the compute dtype. ``keys[layer]`` / ``values[layer]`` are the layer's
    storage tensors (storage dtype; fp8 pools hold ``float8_e4m3fn``).
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, *, dtype: torch.dtype, device, kv_dtype=None,
                 head_dim_v: int | None = None):
        head_dim_v = head_dim if head_dim_v is None else head_dim_v
        for name, value in [("num_layers", num_layers), ("num_blocks", num_blocks),
                            ("block_size", block_size), ("num_kv_heads", num_kv_heads),
                            ("head_dim", head_dim), ("head_dim_v", head_dim_v)]:
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.head_dim_v = head_dim_v
        self.dtype = dtype
        self.device = torch.device(device)
        self.storage_dtype = resolve_kv_dtype(kv_dtype, dtype)
        self.quantized = self.storage_dtype == torch.float8_e4m3fn
        self.null_block = num_blocks
        self.null_row = num_blocks * block_size
        # torch.empty: on CPU the OS maps untouched pages lazily, so unused blocks cost no RAM until
        # written; on CUDA the whole pool is allocated at once. Only the null block is read without
        # being written (``rows`` sends every unwritten position there), so only it must be finite.
        self.keys, self.values = [], []
        for _ in range(num_layers):
            for tensors, dim in ((self.keys, head_dim), (self.values, head_dim_v)):
                t = torch.empty(num_blocks + 1, num_kv_heads, block_size, dim,
                                dtype=self.storage_dtype, device=self.device)
                t[self.null_block].zero_()
                tensors.append(t)
        flat = lambda t: t.view(-1, t.shape[-1])  # noqa: E731  [slots, dim]
        as_bytes = (lambda t: t.view(torch.uint8)) if self.quantized else (lambda t: t)  # noqa: E731
        self._flat = [(as_bytes(flat(k)), as_bytes(flat(v))) for k, v in zip(self.keys, self.values)]
        chunked = lambda t: as_bytes(t).view(-1, *t.shape[2:])  # noqa: E731  [chunks, bs, dim]
        self._chunked = [(chunked(k), chunked(v)) for k, v in zip(self.keys, self.values)]
        self._head_ids = torch.arange(num_kv_heads, device=self.device)
        self._head_slots = self._head_ids * block_size
        self.fp8 = LayerScales(num_layers, self.device)
        self.scales = self.fp8.device_scales  # [layers, 2] float32, 0.0: not set

    @property
    def bytes_per_token(self) -> int:
        """Bytes of K and V for one token across all layers, in storage dtype."""
        elem = torch.empty((), dtype=self.storage_dtype).element_size()
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, self.head_dim_v,
                                  elem)

    @property
    def total_bytes(self) -> int:
        """Bytes the pool reserves (including the null block)."""
        return self.bytes_per_token * self.block_size * (self.num_blocks + 1)

    def rows(self, table: torch.Tensor, sequences: torch.Tensor, positions: torch.Tensor,
             lengths: torch.Tensor | None = None) -> torch.Tensor:
        """Rows of ``positions`` in the sequences ``sequences`` (indices of rows of ``table``), on
        the device, with tensor ops only; ``sequences`` and ``positions`` broadcast together.

        ``table``: ``[S, max_blocks]`` block ids (long), each sequence's blocks padded with
        ``null_block``; every position must lie inside its row of the table (the caller checks).
        With ``lengths`` (``[S]``), a position at or past its sequence's length gets the null
        block's first row (zeros) instead of an unwritten row of a partly filled block.
        """
        bs = self.block_size
        width = table.shape[-1]
        rows = table.reshape(-1)[sequences * width + positions // bs] * bs + positions % bs
        if lengths is None:
            return rows
        return torch.where(positions < lengths[sequences], rows, self.null_row)

    def rows_for(self, blocks: Sequence[int], start: int, end: int) -> torch.Tensor:
        """Rows of sequence positions ``start .. end-1`` of a sequence whose block table is ``blocks``."""
        bs = self.block_size
        if end > len(blocks) * bs or start < 0 or start > end:
            raise ValueError(f"positions {start}..{end} do not fit {len(blocks)} blocks of {bs}")
        table = torch.as_tensor(list(blocks), dtype=torch.long, device=self.device)[None]
        pos = torch.arange(start, end, device=self.device)
        return self.rows(table, torch.zeros_like(pos), pos)

    def slots(self, rows: torch.Tensor) -> torch.Tensor:
        """``[..., kv_heads]`` slots (see the module docstring) of every head of ``rows``."""
        bs = self.block_size  # (b * heads + h) * bs + o == row + b * (heads - 1) * bs + h * bs
        return (rows + rows // bs * ((self.num_kv_heads - 1) * bs))[..., None] + self._head_slots

    def chunks(self, blocks: torch.Tensor) -> torch.Tensor:
        """``[..., kv_heads, n]`` chunks (see the module docstring) of ``blocks`` (``[..., n]``):
        gathered in this order, they lay out ``[..., kv_heads, n * block_size, dim]``."""
        return (blocks * self.num_kv_heads)[..., None, :] + self._head_ids[:, None]

    def write(self, layer: int, rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, *,
              slots: torch.Tensor | None = None) -> None:
        """Store ``keys`` (``[N, kv_heads, head_dim]``) and ``values`` (``[N, kv_heads,
        head_dim_v]``) at ``rows`` (``[N]``); ``slots``: ``slots(rows).reshape(-1)``, when the
        caller has it already (a step writes every layer at the same rows)."""
        flat_k, flat_v = self._flat[layer]
        if self.quantized:
            if not keys.numel():
                return
            self.fp8.ensure(layer, keys, values)  # fixed from here on, whoever set them
            keys = self.fp8.quantize(layer, 0, keys)
            values = self.fp8.quantize(layer, 1, values)
        else:
            keys = keys.to(self.storage_dtype)
            values = values.to(self.storage_dtype)
        if slots is None:
            slots = self.slots(rows).reshape(-1)
        flat_k.index_copy_(0, slots, keys.reshape(slots.shape[0], -1))
        flat_v.index_copy_(0, slots, values.reshape(slots.shape[0], -1))

    def read(self, layer: int, rows: torch.Tensor, *,
             slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys ``[N, kv_heads, head_dim]`` and values ``[N, kv_heads, head_dim_v]`` (compute
        dtype) at ``rows``; ``slots`` as in ``write``."""
        flat_k, flat_v = self._flat[layer]
        if slots is None:
            slots = self.slots(rows).reshape(-1)
        keys = flat_k.index_select(0, slots).view(*rows.shape, self.num_kv_heads, -1)
        values = flat_v.index_select(0, slots).view(*rows.shape, self.num_kv_heads, -1)
        if self.quantized:
            return (self.fp8.dequantize(layer, 0, keys, self.dtype),
                    self.fp8.dequantize(layer, 1, values, self.dtype))
        if self.storage_dtype != self.dtype:
            return keys.to(self.dtype), values.to(self.dtype)
        return keys, values

    def read_chunks(self, layer: int, chunks: torch.Tensor,
                    zero_slots: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys ``[N * block_size, head_dim]`` and values (``head_dim_v``; compute dtype) of the
        ``chunks`` (``[N]``, chunk by chunk, in one gather each: much cheaper than slot by slot),
        with the slots ``zero_slots`` of the result (None: none) set to zero: a caller that gathers
        a partly written block whole zeroes its unwritten slots, whose bytes are stale."""
        out = []
        for j, (source, flat) in enumerate(zip(self._chunked[layer], self._flat[layer])):
            gathered = source.index_select(0, chunks).view(-1, flat.shape[1])
            if zero_slots is not None:
                gathered.index_fill_(0, zero_slots, 0)
            if self.quantized:
                gathered = self.fp8.dequantize(layer, j, gathered, self.dtype)
            elif self.storage_dtype != self.dtype:
                gathered = gathered.to(self.dtype)
            out.append(gathered)
        return out[0], out[1]

    def host_scales(self, layer: int) -> tuple[float, float]:
        """The fp8 (K, V) scales of ``layer`` as host floats (0.0 before the layer is calibrated)."""
        return self.fp8.host(layer)

    def calibrated_layers(self) -> int:
        """How many layers have fp8 scales calibrated on real K/V (0 for unquantized pools)."""
        return self.fp8.calibrated_layers() if self.quantized else 0

    def reset_calibration(self) -> None:
        """Forget every fp8 scale and clamp count: the next write to each layer calibrates it again.
        Only valid while no block holds K/V that must be read back (e.g. after a self-test)."""
        self.fp8.reset()

    def clamped_writes(self) -> int:
        """Writes (per layer, K and V counted apart) whose values exceeded the fp8 range and were
        clamped; 0 for unquantized pools. Reads a device value: call it between steps, not per layer."""
        return self.fp8.clamped_writes() if self.quantized else 0

    def copy_block(self, src: int, dst: int) -> None:
        """Copy every layer's K/V of block ``src`` into block ``dst`` (copy on write)."""
        for tensor in (*self.keys, *self.values):
            tensor[dst].copy_(tensor[src])

    def export_block(self, block: int) -> BlockKV:
        """A host copy of ``block``'s K/V for every layer, in storage dtype (``radixcache.store.BlockKV``).

        The copy is taken now (one device-to-host transfer on GPU, stream-ordered after the forward
        that wrote the block): later writes to ``block``, or its reuse for other tokens, never
        change it. fp8 pools attach the scales the bytes were written with.
        """
        return self.export_blocks([block])[0]

    def export_blocks(self, blocks: Sequence[int]) -> list[BlockKV]:
        """``export_block`` of each of ``blocks``, in order, with one gather per layer and tensor
        and one device-to-host transfer for all of them."""
        for block in blocks:
            self._validate_block(block)
        if not blocks:
            return []
        index = torch.as_tensor(list(blocks), dtype=torch.long, device=self.device)
        per_layer = [torch.cat([t.index_select(0, index).view(torch.uint8).transpose(1, 2)  # to NHD
                                .reshape(len(blocks), -1) for t in pair], dim=1)
                     for pair in zip(self.keys, self.values)]
        raw = torch.stack(per_layer, dim=1).cpu().numpy()  # [blocks, layers, K bytes + V bytes]
        with self.fp8.lock:
            scales = tuple(x for layer in range(self.num_layers) for x in self.host_scales(layer)) \
                if self.quantized else ()
        return [BlockKV(raw[i].reshape(-1), self._dtype_name, self._block_shape, scales)
                for i in range(len(blocks))]

    def import_block(self, block: int, kv: BlockKV) -> None:
        """Write ``kv`` (as ``export_block`` returns it, from any pool of this shape and dtype) into ``block``.

        fp8: a layer whose scales are not set yet adopts the value's (K and V, as a first write would
        calibrate both); per K/V of a set layer, an equal scale copies the bytes, another one
        rescales them, and a rescale that would clip is refused. ``ValueError``
        (nothing written) on another dtype or shape, a payload of the wrong size, bad scales or a
        refused rescale. Safe to call from another thread while forwards write the pool.
        """
        self._validate_block(block)
        if kv.dtype != self._dtype_name or tuple(kv.shape) != self._block_shape:
            raise ValueError(f"block K/V is {kv.dtype}{tuple(kv.shape)}, this pool holds "
                             f"{self._dtype_name}{self._block_shape}")
        src = np.frombuffer(kv.data, dtype=np.uint8)
        per_layer = self.bytes_per_token * self.block_size // self.num_layers
        if src.size != per_layer * self.num_layers:
            raise ValueError(f"block K/V is {src.size} bytes, expected {per_layer * self.num_layers}")
        if not self.quantized and kv.scales:
            raise ValueError(f"{self._dtype_name} K/V carries no scales, got {len(kv.scales)}")
        with self.fp8.lock:  # decide on the scales, write, adopt: nothing calibrates between
            adopt = []
            if self.quantized:
                k_elems = self.block_size * self.num_kv_heads * self.head_dim
                src, adopt = fp8_in_scales(src, kv.scales, self.fp8.current(), k_elems)
            write_payload(self.keys, self.values, block, src)
            for layer, pair in adopt:
                self.fp8.adopt(layer, pair)

    def _validate_block(self, block: int) -> None:
        if isinstance(block, bool) or not isinstance(block, int) or not 0 <= block < self.num_blocks:
            raise ValueError(f"block must be an int in 0..{self.num_blocks - 1}, got {block!r}")

    @property
    def _dtype_name(self) -> str:
        return str(self.storage_dtype).removeprefix("torch.")

    @property
    def _block_shape(self) -> tuple:
        """The payload's shape: ``(layers, 2, block_size, kv_heads, head_dim)`` (K then V per
        layer); with K and V of different head dims, ``(..., head_dim, head_dim_v)``."""
        dims = (self.head_dim,) if self.head_dim == self.head_dim_v else (self.head_dim, self.head_dim_v)
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, *dims)

    def __repr__(self) -> str:
        dims = self.head_dim if self.head_dim == self.head_dim_v else f"{self.head_dim}/{self.head_dim_v}"
        return (f"KVPool(layers={self.num_layers}, blocks={self.num_blocks}x{self.block_size}, "
                f"kv_heads={self.num_kv_heads}, head_dim={dims}, dtype={self.storage_dtype})")
