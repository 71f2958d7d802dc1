"""StepPlan: where one forward's new tokens go in the pool and what each of them attends to.

A forward computes the new tokens of one or more sequences, packed in segment order into ``T``
query rows. Everything a backend needs to know about the step is built here once, from Python
lists, and copied to the device once per array (pinned and non-blocking on CUDA); every layer of
the forward then reuses it. No method here or in a backend reads a device tensor back to the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixcache.errors import CacheError
from radixcache.kv.pool import KVPool


def device_tensor(values: list, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """``values`` (a Python list) as a 1-D tensor on ``device``: built on the host and copied once
    (from pinned memory, non-blocking, on CUDA)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host if device.type == "cpu" else host.to(device)


def k_rows(blocks, start: int, end: int, block_size: int) -> list[int]:
    """K rows (see ``KVPool``) of positions ``start .. end-1`` of a sequence whose block table is
    ``blocks``, as a Python list. Raises ``CacheError`` when the blocks do not cover ``end``."""
    if end > len(blocks) * block_size or not 0 <= start <= end:
        raise CacheError(f"positions {start}..{end} do not fit {len(blocks)} blocks of {block_size}")
    rows: list[int] = []
    stride = 2 * block_size
    pos = start
    while pos < end:
        index, offset = divmod(pos, block_size)
        stop = min(end - pos, block_size - offset)
        base = blocks[index] * stride + offset
        rows.extend(range(base, base + stop))
        pos += stop
    return rows


@dataclass(frozen=True)
class Segment:
    """One sequence's share of a step: ``q_len`` new tokens at packed offset ``q_start``; after the
    step the sequence has ``kv_len`` tokens of K/V in ``blocks``. Query i sits at absolute position
    ``kv_len - q_len + i`` and sees keys ``0 .. kv_len - q_len + i`` (causal, aligned to the end)."""

    q_start: int
    q_len: int
    kv_len: int
    blocks: tuple


class StepPlan:
    """What every layer of one forward shares.

    ``pool``, ``segments`` (packed back to back in order: segment i's queries follow segment
    i-1's), ``num_tokens`` (query rows of the step), ``write_rows`` (pool K rows of every new
    token, in packed order, on the pool's device) and ``backend_state``, the backend's own
    per-step planning (``backend.plan(step)``, run once here, before the forward).
    """

    def __init__(self, pool: KVPool, segments: list[Segment], backend):
        if not segments:
            raise CacheError("a step needs at least one segment")
        bs = pool.block_size
        rows: list[int] = []
        for i, seg in enumerate(segments):
            if seg.q_start != len(rows):
                raise CacheError(f"segment {i} starts at packed offset {seg.q_start}, expected "
                                 f"{len(rows)}: segments must be packed back to back in order")
            if seg.q_len < 1 or seg.kv_len < seg.q_len:
                raise CacheError(f"segment {i}: q_len {seg.q_len} must be >= 1 and <= kv_len "
                                 f"{seg.kv_len}")
            rows.extend(k_rows(seg.blocks, seg.kv_len - seg.q_len, seg.kv_len, bs))
        self.pool = pool
        self.segments = segments
        self.backend = backend
        self.num_tokens = len(rows)
        self.write_rows = device_tensor(rows, pool.device)
        self.backend_state = backend.plan(self)

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store the step's new ``keys``/``values`` (``[num_tokens, kv_heads, head_dim]``, packed
        order) of ``layer`` into the pool."""
        self.pool.write(layer, self.write_rows, keys, values)

    def attend(self, layer: int, query: torch.Tensor, scale: float, sliding_window: int | None = None,
               softcap: float | None = None) -> torch.Tensor:
        """``query [num_tokens, heads, head_dim]`` -> attention output of the same shape, through
        the step's backend (after ``write`` of the same layer)."""
        return self.backend.attend(layer, query, self, scale, sliding_window=sliding_window,
                                   softcap=softcap)


def shared_blocks(segments: list[Segment], block_size: int) -> int:
    """Number of leading whole blocks that every segment's table has in common (all filled)."""
    first = segments[0].blocks
    limit = min(s.kv_len for s in segments) // block_size
    n = 0
    while n < limit and all(len(s.blocks) > n and s.blocks[n] == first[n] for s in segments):
        n += 1
    return n
