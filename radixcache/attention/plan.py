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
    """Index tensors for one forward, built once and shared by every layer.

    ``write_rows``: pool K rows of every new token, in packed order. For the torch backend,
    ``prefills`` holds (segment, K rows of its whole context) of multi-token segments, and the
    single-token (decode) segments are gathered together: ``decode_q`` (their packed offsets),
    ``decode_lens`` (their KV lengths), ``shared_rows`` (K rows of the leading whole blocks that
    every decode segment has in common, e.g. a shared system prompt: read once, cascade style) and
    ``decode_rows`` (``[S, width]`` K rows of each one's positions after the shared part, padded
    with the null block).
    ``backend_state`` is for a backend's own per-step planning (e.g. FlashInfer wrappers).
    """

    def __init__(self, pool: KVPool, segments: list[Segment], backend):
        self.pool = pool
        self.segments = segments
        self.backend = backend
        device = pool.device
        self.write_rows = torch.cat([pool.rows_for(s.blocks, s.kv_len - s.q_len, s.kv_len)
                                     for s in segments])
        self.num_tokens = int(self.write_rows.numel())
        self.prefills = [(s, pool.rows_for(s.blocks, 0, s.kv_len)) for s in segments if s.q_len > 1]
        decodes = [s for s in segments if s.q_len == 1]
        self.decode_q = torch.tensor([s.q_start for s in decodes], dtype=torch.long, device=device)
        self.decode_lens = torch.tensor([s.kv_len for s in decodes], dtype=torch.long, device=device)
        shared = _shared_blocks(decodes, pool.block_size) if len(decodes) > 1 else 0
        self.shared_len = shared * pool.block_size
        self.shared_rows = pool.rows_for(decodes[0].blocks, 0, self.shared_len) if shared else \
            pool.null_rows(0)
        width = max((s.kv_len - self.shared_len for s in decodes), default=0)
        self.decode_rows = pool.null_rows(len(decodes) * width).view(len(decodes), width)
        for i, s in enumerate(decodes):
            self.decode_rows[i, :s.kv_len - self.shared_len] = pool.rows_for(
                s.blocks, self.shared_len, s.kv_len)
        self.backend_state = backend.plan(self) if hasattr(backend, "plan") else None


def _shared_blocks(segments: list[Segment], block_size: int) -> int:
    """Number of leading whole blocks that every segment's table has in common (all filled)."""
    first = segments[0].blocks
    limit = min(s.kv_len for s in segments) // block_size
    n = 0
    while n < limit and all(len(s.blocks) > n and s.blocks[n] == first[n] for s in segments):
        n += 1
    return n
