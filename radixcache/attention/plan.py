"""StepPlan: where one forward's new tokens go in the pool and what each of them attends to.

A forward computes the new tokens of one or more sequences, packed in segment order into ``T``
query rows. Everything a backend needs to know about the step is built here once and every layer
of the forward reuses it. The host builds only what is O(segments + blocks): the segments' offsets
and lengths and a ``[S, max_blocks]`` block table, copied to the device in one transfer (pinned and
non-blocking on CUDA). Every per-position index (the pool rows of the new tokens, of a prefill's
context, of a decode's context) is computed from that table on the device with tensor ops
(``KVPool.rows``), so a step costs no Python work per cached token. No method here or in a backend
reads a device tensor back to the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from radixcache.errors import CacheError
from radixcache.kv.pool import KVPool


_NUMPY = {torch.long: np.int64, torch.int32: np.int32, torch.float32: np.float32}


def device_tensor(values: list, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """``values`` (a Python list of numbers) as a 1-D tensor on ``device``: built on the host
    (through numpy, several times faster than ``torch.tensor`` for long lists) and copied once
    (from pinned memory, non-blocking, on CUDA)."""
    if dtype in _NUMPY:
        host = torch.from_numpy(np.array(values, dtype=_NUMPY[dtype]).reshape(-1))
    else:
        host = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host if device.type == "cpu" else host.to(device)


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
    i-1's), ``num_tokens`` (query rows of the step); on the pool's device: ``block_table``
    (``[S, max_blocks]``: each segment's first ``ceil(kv_len / block_size)`` blocks, padded with
    the null block), ``kv_lens`` and ``q_starts`` (``[S]``), ``write_rows`` (pool rows of every
    new token, in packed order) and ``write_slots`` (their ``KVPool.slots``, flat); and
    ``backend_state``, the backend's own per-step planning (``backend.plan(step)``, run once here,
    before the forward). Raises ``CacheError`` for segments that are not packed in order, have no
    query token or more query tokens than K/V, or whose blocks cannot hold their K/V.
    """

    def __init__(self, pool: KVPool, segments: list[Segment], backend):
        if not segments:
            raise CacheError("a step needs at least one segment")
        bs = pool.block_size
        pages, tokens = [], 0
        for i, seg in enumerate(segments):
            if seg.q_start != tokens:
                raise CacheError(f"segment {i} starts at packed offset {seg.q_start}, expected "
                                 f"{tokens}: segments must be packed back to back in order")
            if seg.q_len < 1 or seg.kv_len < seg.q_len:
                raise CacheError(f"segment {i}: q_len {seg.q_len} must be >= 1 and <= kv_len "
                                 f"{seg.kv_len}")
            n = -(-seg.kv_len // bs)
            if len(seg.blocks) < n:
                raise CacheError(f"segment {i}: positions 0..{seg.kv_len} do not fit "
                                 f"{len(seg.blocks)} blocks of {bs}")
            pages.append(n)
            tokens += seg.q_len
        width = max(pages)
        host = [s.q_start for s in segments] + [s.kv_len for s in segments] + \
            [s.q_len for s in segments]
        null = [pool.null_block] * width
        for seg, n in zip(segments, pages):
            host.extend(seg.blocks[:n])
            host.extend(null[n:])
        packed = device_tensor(host, pool.device)
        s = len(segments)
        self.pool = pool
        self.segments = segments
        self.backend = backend
        self.num_tokens = tokens
        self.q_starts = packed[:s]
        self.kv_lens = packed[s:2 * s]
        self.block_table = packed[3 * s:].view(s, width)
        if tokens == s:  # every segment decodes one token
            self.write_rows = pool.rows(self.block_table, torch.arange(s, device=pool.device),
                                        self.kv_lens - 1)
        else:
            q_lens = packed[2 * s:3 * s]
            seq = torch.repeat_interleave(torch.arange(s, device=pool.device), q_lens,
                                          output_size=tokens)
            pos = torch.arange(tokens, device=pool.device) - self.q_starts[seq] + \
                (self.kv_lens - q_lens)[seq]
            self.write_rows = pool.rows(self.block_table, seq, pos)
        self.write_slots = pool.slots(self.write_rows).reshape(-1)
        self._written = None  # (layer, keys, values) of the last write
        self.backend_state = backend.plan(self)

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store the step's new ``keys`` (``[num_tokens, kv_heads, head_dim]``) and ``values``
        (``[num_tokens, kv_heads, head_dim_v]``) of ``layer``, packed order, into the pool. Until
        the next ``write`` they are also ``written(layer)``: a segment with nothing before it
        can attend over them as they are, without reading the pool."""
        self.pool.write(layer, self.write_rows, keys, values, slots=self.write_slots)
        self._written = (layer, keys, values)

    def written(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The new ``(keys, values)`` of ``layer`` as ``write`` was handed them (packed order, the
        compute dtype), when they are exactly what the pool now holds for them (a pool stored in
        the compute dtype) and ``layer`` was the last one written; else None."""
        written = self._written
        if written is None or written[0] != layer or self.pool.storage_dtype != written[1].dtype:
            return None
        return written[1], written[2]

    def attend(self, layer: int, query: torch.Tensor, scale: float, sliding_window: int | None = None,
               softcap: float | None = None) -> torch.Tensor:
        """``query [num_tokens, heads, head_dim]`` -> attention output ``[num_tokens, heads,
        head_dim_v]``, through the step's backend (after ``write`` of the same layer)."""
        return self.backend.attend(layer, query, self, scale, sliding_window=sliding_window,
                                   softcap=softcap)


def shared_blocks(segments: list[Segment], block_size: int) -> int:
    """Number of leading whole blocks that every segment's table has in common (all filled)."""
    first = segments[0].blocks
    n = min(s.kv_len for s in segments) // block_size
    for seg in segments[1:]:
        if seg.blocks[:n] == first[:n]:  # one C-level comparison in the common cases
            continue
        n = next(i for i, (a, b) in enumerate(zip(seg.blocks, first)) if a != b)
        if not n:
            break
    return n
