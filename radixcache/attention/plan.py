"""StepPlan: where one ragged forward's tokens come from and what each of them attends to."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixcache.kv.pool import KVPool


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
    """What every layer of one forward shares: the pool, the segments, ``write_rows`` (pool K rows
    of every new token, in packed order) and ``backend_state``, the backend's own per-step
    planning (``backend.plan(step)``, run once before the forward)."""

    def __init__(self, pool: KVPool, segments: list[Segment], backend):
        self.pool = pool
        self.segments = segments
        self.backend = backend
        self.write_rows = torch.cat([pool.rows_for(s.blocks, s.kv_len - s.q_len, s.kv_len)
                                     for s in segments])
        self.num_tokens = int(self.write_rows.numel())
        self.backend_state = backend.plan(self) if hasattr(backend, "plan") else None


def shared_blocks(segments: list[Segment], block_size: int) -> int:
    """Number of leading whole blocks that every segment's table has in common (all filled)."""
    first = segments[0].blocks
    limit = min(s.kv_len for s in segments) // block_size
    n = 0
    while n < limit and all(len(s.blocks) > n and s.blocks[n] == first[n] for s in segments):
        n += 1
    return n
