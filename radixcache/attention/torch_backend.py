"""The reference backend: gather each sequence's blocks and run SDPA with an end-aligned causal mask.

Runs on CPU or GPU. Supports GQA/MQA, sliding windows and logit soft-capping (Gemma 2).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixcache.attention.plan import StepPlan


def causal_mask(q_pos: torch.Tensor, kv_len: torch.Tensor | int, width: int,
                sliding_window: int | None) -> torch.Tensor:
    """Boolean ``[..., n, width]`` mask: key j is visible to a query at absolute position p when
    ``j <= p`` and ``j < kv_len`` (and ``p - j < sliding_window`` when set)."""
    keys = torch.arange(width, device=q_pos.device)
    q = q_pos[..., :, None]
    mask = keys <= q
    if isinstance(kv_len, torch.Tensor):
        mask = mask & (keys < kv_len[..., None, None])
    if sliding_window:
        mask = mask & (q - keys < sliding_window)
    return mask


def attend_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                 scale: float, softcap: float | None) -> torch.Tensor:
    """``q [B, H, n, d]``, ``k/v [B, Hkv, L, d]``, ``mask [B, 1, n, L]`` bool -> ``[B, H, n, d]``."""
    groups = q.shape[1] // k.shape[1]
    if softcap:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
        scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~mask, float("-inf"))
        return torch.matmul(torch.softmax(scores, dim=-1), v.float()).to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                          enable_gqa=groups > 1)


class TorchBackend:
    """Paged attention in plain torch: the reference every other backend is tested against."""

    name = "torch"

    def attend(self, layer: int, query: torch.Tensor, plan: StepPlan, scale: float,
               sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        """``query [T, H, d]`` (packed new tokens) -> attention output ``[T, H, d]``."""
        pool = plan.pool
        out = torch.empty_like(query)
        for seg, rows in plan.prefills:
            k, v = pool.read(layer, rows)
            q = query[seg.q_start:seg.q_start + seg.q_len]
            pos = torch.arange(seg.kv_len - seg.q_len, seg.kv_len, device=query.device)
            mask = causal_mask(pos, seg.kv_len, seg.kv_len, sliding_window)[None, None]
            o = attend_dense(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                             v.transpose(0, 1)[None], mask, scale, softcap)
            out[seg.q_start:seg.q_start + seg.q_len] = o[0].transpose(0, 1)
        if plan.decode_q.numel():
            s, width = plan.decode_rows.shape
            k, v = pool.read(layer, plan.decode_rows.reshape(-1))
            k = k.view(s, width, *k.shape[1:]).transpose(1, 2)
            v = v.view(s, width, *v.shape[1:]).transpose(1, 2)
            q = query[plan.decode_q][:, :, None]  # [S, H, 1, d]
            mask = causal_mask((plan.decode_lens - 1)[:, None], plan.decode_lens, width,
                               sliding_window)[:, None]
            o = attend_dense(q, k, v, mask, scale, softcap)
            out[plan.decode_q] = o[:, :, 0]
        return out
