"""The reference backend: gather each sequence's context from the pool and run SDPA with an
end-aligned causal mask.

Runs on CPU or GPU. Supports GQA/MQA, sliding windows, logit soft-capping (Gemma 2) and K and V of
different head dims (MLA). A context is gathered block by block, heads first (``KVPool.read_chunks``:
every head of a block in one copy), straight into the ``[S, kv_heads, L, d]`` layout SDPA reads
fastest: the same copy a ``DynamicCache`` makes when it concatenates. A partly written block is
gathered whole and its unwritten slots inside the context are zeroed (stale bytes, possibly NaN,
never reach attention). All gather indices of a step are computed on the device from the plan's
block table, once per step (``TorchStepState``), and every layer reuses them; nothing reads a
device value back to the host. A prompt with nothing cached before it reads no pool at all: it
attends over the K/V the layer just computed with SDPA's causal kernel, as plain transformers
does (``StepPlan.written``; not for an fp8 pool, whose stored K/V differ). Decodes that share
whole blocks (a system prompt) read them once per layer and merge with their own tails by
log-sum-exp (cascade); on CPU both halves run on torch's fused flash kernel in the model's dtype
(``attend_with_lse``).

``TorchBackend(in_place=True)`` (``attention="torch-inplace"``): on CPU, decodes read their K/V
in place through the small C++ kernel of ``paged_cpu`` (no gather; no cascade, except in half
precision, where reading a shared prefix once still wins), with a pool stored in the compute dtype
(float32, bfloat16, float16; not fp8). "auto" picks it for half precision only: in float32 the
gather feeds SDPA exactly the tensors plain transformers' ``DynamicCache`` would, so greedy tokens
equal plain ``generate``'s bit for bit, while the kernel sums in another order (differences of 1e-7
in float32, of the last bit in bfloat16, that flip a near-tie). Prefills over a cached prefix stay
on gather + SDPA (a GEMM per head beats the kernel's per-query loop there).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixcache.attention import paged_cpu
from radixcache.attention.plan import StepPlan, device_tensor, shared_blocks
from radixcache.errors import CacheError


# torch's fused CPU flash attention, which also returns the log-sum-exp (None if this torch lacks it)
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


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
    """``q [B, H, n, d]``, ``k [B, Hkv, L, d]``, ``v [B, Hkv, L, dv]``, ``mask [B, 1, n, L]``
    (bool, additive float in q's dtype, or None: every key visible) -> ``[B, H, n, dv]``."""
    groups = q.shape[1] // k.shape[1]
    if softcap:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
        scores = torch.tanh(scores / softcap) * softcap
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return torch.matmul(torch.softmax(scores, dim=-1), v.float()).to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                          enable_gqa=groups > 1)


class Context:
    """How to gather positions ``start .. start + width - 1`` of sequences ``seq`` (rows of the
    step's block table, lengths ``lens``; ``start`` block-aligned and at most every length) as
    ``[S, kv_heads, width, dim]``, the layout attention reads: every block a sequence has written
    to, partly written ones too, in one gather of their per-head chunks, then the unwritten slots
    of its partly written block set to zero; positions past a sequence's end read zeros.
    ``equal_lengths`` (host-known: every length is ``start + width``) skips the zeroing, since
    then no unwritten slot lies inside the context."""

    def __init__(self, pool, table: torch.Tensor, seq: torch.Tensor, lens: torch.Tensor,
                 start: int, width: int, equal_lengths: bool):
        bs, heads = pool.block_size, pool.num_kv_heads
        device = table.device
        s = seq.shape[0]
        n = -(-width // bs)
        first = start // bs
        self.shape = (s, heads, n * bs)
        self.width = width
        own = table.index_select(0, seq)[:, first:first + n]
        written = torch.arange(first * bs, (first + n) * bs, bs, device=device) < lens[:, None]
        chunks = pool.chunks(torch.where(written, own, pool.null_block)).reshape(-1)
        self.zero = None
        if not equal_lengths:  # unwritten slots of a partly written block: zeros, not stale bytes
            landing = torch.full((1,), pool.null_block * heads, device=device)
            chunks = torch.cat([chunks, landing])
            offsets = torch.arange(bs, device=device)
            tail = (lens // bs * bs - start)[:, None] + offsets  # the partly written block
            per_head = torch.arange(s * heads, device=device).view(s, 1, heads) * (n * bs)
            unwritten = (offsets >= lens[:, None] % bs) & (lens[:, None] % bs > 0)
            self.zero = torch.where(unwritten[:, :, None], per_head + tail[:, :, None],
                                    (s * heads * n * bs + offsets)[None, :, None]).reshape(-1)
        self.chunks = chunks

    def read(self, pool, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys ``[S, kv_heads, width, head_dim]`` and values (``head_dim_v``) of ``layer``."""
        k, v = pool.read_chunks(layer, self.chunks, self.zero)
        s, heads, padded = self.shape
        used = s * heads * padded
        return (k[:used].view(s, heads, padded, k.shape[-1])[:, :, :self.width],
                v[:used].view(s, heads, padded, v.shape[-1])[:, :, :self.width])


class TorchStepState:
    """The torch backend's gather plans for one step (device tensors, from the plan's table).

    ``prefills``: (index in the step, segment) of every multi-token segment, and
    ``prefill_context(i)``, the ``Context`` of prefill i's whole K/V, built on first use (a
    prefill with nothing before it attends over the K/V it was handed, ``StepPlan.written``). The
    single-token (decode) segments are served together, by ``kernel`` in place where it is set
    (``in_place_decodes``: their segments as the kernel reads them), else gathered: ``decode_q`` (their packed offsets; None
    when every segment decodes, segment i at packed row i), ``decode_lens`` (their KV lengths;
    ``max_decode_len`` on the host, and ``same_lengths``: all of them equal), ``shared_len`` (tokens of the leading whole blocks every
    decode segment has in common, e.g. a shared system prompt, read once: cascade style), and
    ``context(start)``, the ``Context`` of every decode from ``start`` (0: the whole context;
    ``shared_len``: the own tails), built on first use. Masks are built on first use per sliding
    window and dtype and kept for the step's other layers.
    """

    def __init__(self, step: StepPlan, kernel=None):
        pool = self.pool = step.pool
        device = pool.device
        self.table = step.block_table
        self.kv_lens = step.kv_lens
        segments = step.segments
        self.prefills = [(i, s) for i, s in enumerate(segments) if s.q_len > 1]
        index = [i for i, s in enumerate(segments) if s.q_len == 1]
        decodes = [segments[i] for i in index]
        self.num_decodes = n = len(decodes)
        self.max_decode_len = max((s.kv_len for s in decodes), default=0)
        self.same_lengths = all(s.kv_len == self.max_decode_len for s in decodes)
        min_decode_len = min((s.kv_len for s in decodes), default=0)
        # whole blocks before every decode's last token (its own tail is never empty)
        shared = min(shared_blocks(decodes, pool.block_size), (min_decode_len - 1) // pool.block_size) \
            if n > 1 else 0
        self.shared_len = shared * pool.block_size
        if n == len(segments):  # a pure decode step: segment i is packed row i
            self.decode_seq = torch.arange(n, device=device)
            self.decode_q = None
        else:
            packed = device_tensor(index + [s.q_start for s in decodes], device)
            self.decode_seq, self.decode_q = packed[:n], packed[n:]
        self.decode_lens = step.kv_lens[self.decode_seq]
        # the in-place kernel and its decode segments (q_start, 1, kv_len, table row), or None; in
        # half precision a shared prefix read once (cascade) beats reading it per sequence in place
        self.kernel = self.in_place_decodes = None
        cascade = self.shared_len > 0 and pool.dtype != torch.float32
        if n and kernel is not None and not cascade and pool.storage_dtype == pool.dtype \
                and pool.dtype in IN_PLACE_DTYPES:
            self.kernel = kernel
            self.in_place_decodes = torch.tensor(
                [(segments[i].q_start, 1, segments[i].kv_len, i) for i in index], dtype=torch.long)
        self._contexts: dict = {}
        self._masks: dict = {}

    def prefill_context(self, index: int) -> Context:
        """The ``Context`` of prefill segment ``index``'s whole K/V, built on first use."""
        key = ("prefill", index)
        if key not in self._contexts:
            i, seg = self.prefills[index]
            one = torch.full((1,), i, device=self.table.device)
            self._contexts[key] = Context(self.pool, self.table, one, self.kv_lens[one], 0,
                                          seg.kv_len, equal_lengths=True)
        return self._contexts[key]

    def context(self, start: int) -> Context:
        """The decodes' ``Context`` from position ``start`` (0 or ``shared_len``) to their ends."""
        if start not in self._contexts:
            self._contexts[start] = Context(self.pool, self.table, self.decode_seq, self.decode_lens,
                                            start, self.max_decode_len - start, self.same_lengths)
        return self._contexts[start]

    def shared_chunks(self) -> torch.Tensor:
        """Chunks of the shared prefix (the first decode's first ``shared_len`` tokens), in the
        order that gathers them as ``[kv_heads, shared_len, dim]``."""
        if "shared" not in self._contexts:
            first = self.table[self.decode_seq[:1]]  # [1, max_blocks]
            blocks = first[0, :self.shared_len // self.pool.block_size]
            self._contexts["shared"] = self.pool.chunks(blocks).reshape(-1)
        return self._contexts["shared"]

    def prefill_mask(self, index: int, sliding_window: int | None, dtype) -> torch.Tensor:
        """``[1, 1, q_len, kv_len]`` mask of prefill segment ``index`` (additive in ``dtype``;
        bool for None)."""
        key = ("prefill", index, sliding_window, dtype)
        if key not in self._masks:
            _, seg = self.prefills[index]
            pos = torch.arange(seg.kv_len - seg.q_len, seg.kv_len, device=self.table.device)
            mask = causal_mask(pos, seg.kv_len, seg.kv_len, sliding_window)[None, None]
            self._masks[key] = _as(mask, dtype)
        return self._masks[key]

    def decode_mask(self, sliding_window: int | None, dtype, start: int = 0) -> torch.Tensor:
        """``[S, 1, 1, max_decode_len - start]`` mask of the decode segments over their context
        from position ``start`` (0, or ``shared_len`` for the cascade's own tails: a tail's padding
        past its sequence's end is hidden); additive in ``dtype``, bool for None."""
        key = ("decode", sliding_window, dtype, start)
        if key not in self._masks:
            lens = self.decode_lens - start
            mask = causal_mask((lens - 1)[:, None], lens, self.max_decode_len - start,
                               sliding_window)[:, None]
            self._masks[key] = _as(mask, dtype)
        return self._masks[key]


def _as(mask: torch.Tensor, dtype) -> torch.Tensor:
    """A boolean mask as is (``dtype`` None) or as an additive one (0 / -inf) in ``dtype``:
    SDPA converts a boolean mask on every call; every row here has a visible key."""
    if dtype is None:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


IN_PLACE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class TorchBackend:
    """Paged attention in plain torch: the reference every other backend is tested against.

    ``in_place=True``: decodes on a CPU pool read their K/V in place through ``paged_cpu``'s
    kernel (built here, at construction: a start-up cost once per machine, then cached), or
    ``CacheError`` where it cannot build or the device is not a CPU. Tokens may part from plain
    ``generate``'s in the last bits (see the module docstring)."""

    def __init__(self, in_place: bool = False, device="cpu"):
        self.kernel = None
        self.name = "torch-inplace" if in_place else "torch"
        if in_place:
            if torch.device(device).type != "cpu":
                raise CacheError("attention='torch-inplace' reads the pool in place on a CPU only")
            self.kernel = paged_cpu.kernel()
            if self.kernel is None:
                raise CacheError("attention='torch-inplace' needs the kernel of "
                                 f"radixcache.attention.paged_cpu, which cannot build here "
                                 f"({paged_cpu.unavailable_reason()})")

    def plan(self, step: StepPlan) -> TorchStepState:
        """Build the step's gather plans once; every layer reuses them."""
        kernel = self.kernel if step.pool.device.type == "cpu" else None
        return TorchStepState(step, kernel)

    def attend(self, layer: int, query: torch.Tensor, plan: StepPlan, scale: float,
               sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        """``query [T, H, head_dim]`` (packed new tokens) -> attention output ``[T, H, head_dim_v]``."""
        pool = plan.pool
        state = plan.backend_state
        if state.kernel is not None:  # every decode at once, in place; prefills fill their rows below
            out = state.kernel.paged_attention(query, pool.keys[layer], pool.values[layer], state.table,
                                               state.in_place_decodes, scale, sliding_window or 0,
                                               float(softcap or 0.0))
            if state.decode_q is None:
                return out
        elif state.decode_q is None:  # a pure decode step: no scatter into a packed output
            return self._decode(layer, query, pool, state, scale, sliding_window, softcap)
        else:
            out = query.new_empty(*query.shape[:2], pool.head_dim_v)
        mask_dtype = None if softcap else query.dtype
        written = plan.written(layer)
        for i, (_, seg) in enumerate(state.prefills):
            rows = slice(seg.q_start, seg.q_start + seg.q_len)
            q = query[rows].transpose(0, 1)[None]
            if written is not None and seg.kv_len == seg.q_len:
                o = _attend_fresh(q, written[0][rows], written[1][rows], scale, sliding_window, softcap,
                                  lambda: state.prefill_mask(i, sliding_window, mask_dtype))
            else:
                k, v = state.prefill_context(i).read(pool, layer)
                o = attend_dense(q, k, v, state.prefill_mask(i, sliding_window, mask_dtype), scale,
                                 softcap)
            out[rows] = o[0].transpose(0, 1)
        if state.num_decodes and state.kernel is None:
            out[state.decode_q] = self._decode(layer, query[state.decode_q], pool, state, scale,
                                               sliding_window, softcap)
        return out

    def _decode(self, layer, q, pool, state, scale, sliding_window, softcap) -> torch.Tensor:
        """The decode queries ``q [S, H, d]`` (cascade over a shared prefix when it applies)."""
        window_cuts = bool(sliding_window) and sliding_window < state.max_decode_len
        if state.shared_len and not softcap and not window_cuts:
            return self._cascade_decode(layer, q, pool, state, scale)
        k, v = state.context(0).read(pool, layer)  # [S, Hkv, L, d]
        if state.same_lengths and not window_cuts:
            mask = None  # every sequence sees its whole context, and none is padded
        else:
            mask = state.decode_mask(sliding_window, None if softcap else q.dtype)
        return attend_dense(q[:, :, None], k, v, mask, scale, softcap)[:, :, 0]

    @staticmethod
    def _cascade_decode(layer, q, pool, state, scale) -> torch.Tensor:
        """Decode queries against the shared prefix (read once for all of them) and against each
        one's own tail, merged by log-sum-exp: the K/V of a shared system prompt is read once per
        layer instead of once per sequence."""
        s, heads, dim = q.shape
        kv_heads, dim_v = pool.num_kv_heads, pool.head_dim_v
        groups = heads // kv_heads
        # shared part: all S*groups queries of a KV head as one sequence of queries
        kp, vp = pool.read_chunks(layer, state.shared_chunks(), None)
        kp = kp.view(1, kv_heads, -1, kp.shape[-1])  # [1, Hkv, Lp, d]
        vp = vp.view(1, kv_heads, -1, dim_v)
        qg = q.view(s, kv_heads, groups, dim).permute(1, 0, 2, 3).reshape(1, kv_heads, s * groups, dim)
        out_p, lse_p = attend_with_lse(qg, kp, vp, None, scale)
        out_p = out_p.view(kv_heads, s, groups, dim_v).permute(1, 0, 2, 3).reshape(s, heads, dim_v)
        lse_p = lse_p.view(kv_heads, s, groups).permute(1, 0, 2).reshape(s, heads)
        # own tails (each at least one token: shared_len stops before every decode's last token)
        context = state.context(state.shared_len)
        k, v = context.read(pool, layer)  # [S, Hkv, W, d]
        out_s, lse_s = attend_with_lse(q.view(s, kv_heads, groups, dim), k, v,
                                       state.decode_mask(None, q.dtype, state.shared_len), scale)
        out_s, lse_s = out_s.reshape(s, heads, dim_v).float(), lse_s.reshape(s, heads)
        share = torch.sigmoid(lse_p - lse_s)[..., None]  # the prefix's share of the softmax mass
        return torch.lerp(out_s, out_p.float(), share).to(q.dtype)


def _attend_fresh(q, keys, values, scale, sliding_window, softcap, mask):
    """A prompt with nothing before it (``q [1, H, n, d]``) over its own new ``keys`` and
    ``values`` (``[n, kv_heads, d]``, as computed): what plain transformers computes, causal
    without a mask when no window cuts it (SDPA's fused causal kernel), else with ``mask()``."""
    k, v = keys.transpose(0, 1)[None], values.transpose(0, 1)[None]
    if softcap or (sliding_window and sliding_window < q.shape[2]):
        return attend_dense(q, k, v, mask(), scale, softcap)
    groups = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=groups > 1)


def attend_with_lse(q, k, v, mask, scale):
    """``softmax(q k^T * scale) v`` and its log-sum-exp (float32): ``q [B, H, n, d]``, ``k [B, H,
    L, d]``, ``v [B, H, L, dv]``, ``mask`` None or additive (0 / -inf) in q's dtype, broadcastable
    to ``[B, H, n, L]``, leaving every row at least one key. On CPU with ``dv == d``: torch's fused
    flash kernel in the inputs' own dtype (float32 accumulation, output in q's dtype), with no
    float32 copy of K and V; elsewhere the float32 reference ``_softmax_attend``."""
    if q.device.type == "cpu" and k.shape[-1] == v.shape[-1] and _FLASH_CPU is not None:
        return _FLASH_CPU(q, k, v, attn_mask=mask, scale=scale)
    valid = None if mask is None else mask == 0
    return _softmax_attend(q.float(), k.float(), v.float(), valid, scale)



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
