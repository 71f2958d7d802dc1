"""The reference backend: gather each sequence's blocks and run SDPA with an end-aligned causal mask.

Runs on CPU or GPU. Supports GQA/MQA, sliding windows and logit soft-capping (Gemma 2). All index
arrays of a step are built once from Python lists (``TorchStepState``) and every layer reuses them;
nothing reads a device value back to the host.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixcache.attention.plan import StepPlan, device_tensor, k_rows, shared_blocks


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


class TorchStepState:
    """The torch backend's gather indices for one step (host lists copied once each).

    ``prefills``: (segment, K rows of its whole context) of every multi-token segment. The
    single-token (decode) segments are served together: ``decode_q`` (their packed offsets),
    ``decode_lens`` (their KV lengths; ``max_decode_len`` on the host), ``shared_rows`` (K rows of
    the leading whole blocks every decode segment has in common, e.g. a shared system prompt, read
    once: cascade style) and ``decode_rows`` (``[S, width]`` K rows of each one's positions after
    the shared part, padded with the null block). Masks are built on first use per sliding window
    and kept for the step's other layers.
    """

    def __init__(self, step: StepPlan):
        pool = step.pool
        device = pool.device
        bs = pool.block_size
        prefill_segments = [s for s in step.segments if s.q_len > 1]
        rows: list[int] = []
        spans = []
        for s in prefill_segments:
            spans.append((len(rows), s.kv_len))
            rows.extend(k_rows(s.blocks, 0, s.kv_len, bs))
        flat = device_tensor(rows, device)
        self.prefills = [(s, flat[start:start + n]) for s, (start, n) in zip(prefill_segments, spans)]
        decodes = [s for s in step.segments if s.q_len == 1]
        self.num_decodes = len(decodes)
        self.max_decode_len = max((s.kv_len for s in decodes), default=0)
        shared = shared_blocks(decodes, bs) if len(decodes) > 1 else 0
        self.shared_len = shared * bs
        width = max((s.kv_len - self.shared_len for s in decodes), default=0)
        null = pool.null_block * 2 * bs
        table: list[int] = k_rows(decodes[0].blocks, 0, self.shared_len, bs) if shared else []
        for s in decodes:
            own = k_rows(s.blocks, self.shared_len, s.kv_len, bs)
            table.extend(own)
            table.extend([null] * (width - len(own)))
        packed = device_tensor([s.q_start for s in decodes] + [s.kv_len for s in decodes] + table,
                               device)
        n = len(decodes)
        self.decode_q = packed[:n]
        self.decode_lens = packed[n:2 * n]
        self.shared_rows = packed[2 * n:2 * n + self.shared_len]
        self.decode_rows = packed[2 * n + self.shared_len:].view(n, width)
        self._masks: dict = {}

    def prefill_mask(self, index: int, sliding_window: int | None) -> torch.Tensor:
        """``[1, 1, q_len, kv_len]`` mask of prefill segment ``index``."""
        key = ("prefill", index, sliding_window)
        if key not in self._masks:
            seg, rows = self.prefills[index]
            pos = torch.arange(seg.kv_len - seg.q_len, seg.kv_len, device=rows.device)
            self._masks[key] = causal_mask(pos, seg.kv_len, seg.kv_len, sliding_window)[None, None]
        return self._masks[key]

    def decode_mask(self, sliding_window: int | None) -> torch.Tensor:
        """``[S, 1, 1, shared + width]`` mask of the decode segments over their gathered context."""
        key = ("decode", sliding_window)
        if key not in self._masks:
            width = self.shared_len + self.decode_rows.shape[1]
            self._masks[key] = causal_mask((self.decode_lens - 1)[:, None], self.decode_lens, width,
                                           sliding_window)[:, None]
        return self._masks[key]


class TorchBackend:
    """Paged attention in plain torch: the reference every other backend is tested against."""

    name = "torch"

    def plan(self, step: StepPlan) -> TorchStepState:
        """Build the step's gather indices once; every layer reuses them."""
        return TorchStepState(step)

    def attend(self, layer: int, query: torch.Tensor, plan: StepPlan, scale: float,
               sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        """``query [T, H, d]`` (packed new tokens) -> attention output ``[T, H, d]``."""
        pool = plan.pool
        state = plan.backend_state
        out = torch.empty_like(query)
        for i, (seg, rows) in enumerate(state.prefills):
            k, v = pool.read(layer, rows)
            q = query[seg.q_start:seg.q_start + seg.q_len]
            o = attend_dense(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                             v.transpose(0, 1)[None], state.prefill_mask(i, sliding_window), scale,
                             softcap)
            out[seg.q_start:seg.q_start + seg.q_len] = o[0].transpose(0, 1)
        if state.num_decodes:
            q = query[state.decode_q]
            window_cuts = bool(sliding_window) and sliding_window < state.max_decode_len
            if state.shared_len and not softcap and not window_cuts:
                out[state.decode_q] = self._cascade_decode(layer, q, pool, state, scale)
            else:
                out[state.decode_q] = self._dense_decode(layer, q, pool, state, scale,
                                                         sliding_window, softcap)
        return out

    @staticmethod
    def _dense_decode(layer, q, pool, state, scale, sliding_window, softcap) -> torch.Tensor:
        """Every decode query against its whole context, gathered per sequence."""
        s, width = state.decode_rows.shape
        rows = state.decode_rows
        if state.shared_len:
            rows = torch.cat([state.shared_rows.expand(s, -1), rows], dim=1)
            width += state.shared_len
        k, v = pool.read(layer, rows.reshape(-1))
        k = k.view(s, width, *k.shape[1:]).transpose(1, 2)
        v = v.view(s, width, *v.shape[1:]).transpose(1, 2)
        return attend_dense(q[:, :, None], k, v, state.decode_mask(sliding_window), scale,
                            softcap)[:, :, 0]

    @staticmethod
    def _cascade_decode(layer, q, pool, state, scale) -> torch.Tensor:
        """Decode queries against the shared prefix (read once for all of them) and against each
        one's own tail, merged by log-sum-exp: the K/V of a shared system prompt is read once per
        layer instead of once per sequence."""
        s, heads, dim = q.shape
        kv_heads = pool.num_kv_heads
        groups = heads // kv_heads
        # shared part: all S*groups queries of a KV head in one matmul
        kp, vp = pool.read(layer, state.shared_rows)  # [Lp, Hkv, d]
        qg = q.float().view(s, kv_heads, groups, dim).permute(1, 0, 2, 3).reshape(kv_heads, -1, dim)
        out_p, lse_p = _softmax_attend(qg, kp.float().transpose(0, 1), vp.float().transpose(0, 1),
                                       None, scale)
        out_p = out_p.view(kv_heads, s, groups, dim).permute(1, 0, 2, 3).reshape(s, heads, dim)
        lse_p = lse_p.view(kv_heads, s, groups).permute(1, 0, 2).reshape(s, heads)
        # own tails
        width = state.decode_rows.shape[1]
        k, v = pool.read(layer, state.decode_rows.reshape(-1))
        k = k.float().view(s, width, kv_heads, dim).transpose(1, 2)  # [S, Hkv, W, d]
        v = v.float().view(s, width, kv_heads, dim).transpose(1, 2)
        valid = torch.arange(width, device=q.device) < (state.decode_lens - state.shared_len)[:, None]
        qs = q.float().view(s, kv_heads, groups, dim)
        out_s, lse_s = _softmax_attend(qs, k, v, valid[:, None, None, :], scale)
        out_s, lse_s = out_s.reshape(s, heads, dim), lse_s.reshape(s, heads)
        lse = torch.logaddexp(lse_p, lse_s)
        merged = out_p * torch.exp(lse_p - lse)[..., None] + out_s * torch.exp(lse_s - lse)[..., None]
        return merged.to(q.dtype)


def _softmax_attend(q, k, v, valid, scale):
    """``softmax(q k^T * scale) v`` and its log-sum-exp, with ``valid`` (bool, broadcastable to the
    scores) masking keys; rows with no valid key give output 0 and lse -inf."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if valid is not None:
        scores = scores.masked_fill(~valid, float("-inf"))
    peak = scores.amax(dim=-1, keepdim=True)
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    weights = torch.exp(scores - peak)
    total = weights.sum(dim=-1, keepdim=True)
    out = torch.matmul(weights, v) / total.clamp_min(1e-30)
    lse = torch.where(total > 0, peak + torch.log(total.clamp_min(1e-30)),
                      torch.full_like(total, float("-inf")))
    return out, lse[..., 0]
