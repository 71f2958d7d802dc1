"""The FlashInfer backend: paged attention straight over the pool's blocks (CUDA only).

Written against flashinfer-python 0.6.18.post1. One step (one ragged forward) is planned once and
run for every layer:

- a step with any multi-token segment (prefill chunks, possibly mixed with decodes) goes through
  ``BatchPrefillWithPagedKVCacheWrapper``: the packed query ``[T, H, d]`` is FlashInfer's ragged
  ``qo`` layout (``qo_indptr`` = cumulative ``q_len`` in segment order), masking is ``causal=True``,
  which FlashInfer aligns to the end of each sequence's KV exactly like the torch reference;
- a pure-decode step (every segment has ``q_len == 1``) goes through
  ``BatchDecodeWithPagedKVCacheWrapper`` when K and V share a head dim.

The pool's per-layer pair ``(keys[layer], values[layer])``, ``[num_blocks + 1, kv_heads,
block_size, head_dim]`` and ``[..., head_dim_v]``, is FlashInfer's ``(k_cache, v_cache)`` "HND" paged
KV cache (``paged_kv_cache``); a sequence's pages are its first ``ceil(kv_len / block_size)`` block
ids, and the last one holds ``kv_len - (pages - 1) * block_size`` tokens.

K and V of different head dims (MLA models: K ``qk_nope + qk_rope``, V ``v_head_dim``, e.g. 192
and 128): in flashinfer-python 0.6 the batch prefill wrappers (paged and ragged) take
``head_dim_qk`` and ``head_dim_vo`` (the FA2 paged kernel reads K and V with independent strides;
the FA3 paged kernel requires K and V to share page and token strides, which two tensors of
different head dims do not). The batch decode wrapper takes one ``head_dim`` (its kernels check
``head_dim_qk == head_dim_vo``), and the MLA wrappers (``BatchMLAPagedAttentionWrapper``,
``BatchDecodeMlaWithPagedKVCacheWrapper``) attend over the compressed latent with absorbed
weights, which is not what transformers computes. So such pools run every step, decodes too,
through ``BatchPrefillWithPagedKVCacheWrapper`` with ``head_dim_vo`` and the FA2 kernels
(``wrapper_plan``).

Planning happens in two halves because FlashInfer needs, at plan time, values that
``StepPlan`` does not know when it calls ``plan`` (before the forward): the query head count, the
softmax scale, the sliding window and the soft cap (all arguments of attention, not of the step).
``plan(step_plan)`` builds the page table once per step (int32 index arrays; the block ids go to
the device once); the first ``attend`` of a step then calls the wrapper's ``plan`` with those
arrays and the layer's attention configuration, and every later layer with the same
configuration only calls ``run``. A model whose layers all share one configuration (Llama, Qwen,
Mistral, ...) therefore plans exactly once per step; Gemma 2 (sliding and global layers) twice.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass

import torch

from radixcache.attention.plan import StepPlan, device_tensor
from radixcache.errors import CacheError

KV_LAYOUT = "HND"  # the pool's layout: [pages, kv_heads, page_size, head_dim]

WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's recommended float workspace (split-k scratch)
KERNEL_BACKENDS = ("fa2", "fa3", "auto")
COMPUTE_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class PageTable:
    """FlashInfer's paged-KV description of one step, as host lists (segment order).

    ``qo_indptr[i]:qo_indptr[i+1]`` are segment i's rows of the packed query; its pages are
    ``kv_indices[kv_indptr[i]:kv_indptr[i+1]]`` and its last page holds ``last_page_len[i]``
    (``1 .. block_size``) tokens. ``decode`` is True when every segment has exactly one query token.
    """

    qo_indptr: list
    kv_indptr: list
    kv_indices: list
    last_page_len: list
    decode: bool


def page_table(segments, block_size: int) -> PageTable:
    """The ``PageTable`` of ``segments`` (``radixcache.attention.Segment``) over blocks of ``block_size``.

    Raises ``CacheError`` when the segments are not packed back to back in order (FlashInfer's
    ragged query layout needs segment i's queries right after segment i-1's), when a segment has
    no query token or more query tokens than KV, or when its blocks cannot hold ``kv_len`` tokens.
    """
    if not segments:
        raise CacheError("a step needs at least one segment")
    qo_indptr, kv_indptr, kv_indices, last_page_len = [0], [0], [], []
    for i, seg in enumerate(segments):
        if seg.q_start != qo_indptr[-1]:
            raise CacheError(f"segment {i} starts at packed offset {seg.q_start}, expected "
                             f"{qo_indptr[-1]}: FlashInfer needs the segments packed in order")
        if seg.q_len < 1 or seg.kv_len < seg.q_len:
            raise CacheError(f"segment {i}: q_len {seg.q_len} must be >= 1 and <= kv_len {seg.kv_len}")
        pages = -(-seg.kv_len // block_size)
        if len(seg.blocks) < pages:
            raise CacheError(f"segment {i}: {len(seg.blocks)} blocks cannot hold {seg.kv_len} "
                             f"tokens of {block_size}")
        kv_indices.extend(int(b) for b in seg.blocks[:pages])
        kv_indptr.append(kv_indptr[-1] + pages)
        last_page_len.append(seg.kv_len - (pages - 1) * block_size)
        qo_indptr.append(qo_indptr[-1] + seg.q_len)
    return PageTable(qo_indptr, kv_indptr, kv_indices, last_page_len,
                     decode=all(s.q_len == 1 for s in segments))


@dataclass(eq=False)
class FlashInferStepState:
    """What ``FlashInferBackend.plan`` keeps for one step (stored as ``StepPlan.backend_state``).

    The int32 index arrays: ``qo_indptr``, ``kv_indptr`` and ``last_page_len`` on the host (the
    planner reads them on the CPU and copies them to the device itself, so passing them from the
    host saves three device-to-host syncs per plan) and ``kv_indices`` (the block ids, the one
    array that grows with context length) on the device. ``step`` identifies the step for the
    wrappers it has been planned into.
    """

    step: int
    table: PageTable
    num_tokens: int
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    last_page_len: torch.Tensor

    @property
    def decode(self) -> bool:
        """True when every segment has one query token (the decode wrapper serves the step when
        K and V also share a head dim)."""
        return self.table.decode


@dataclass(eq=False)
class _Slot:
    """One FlashInfer wrapper for one attention configuration, and the step it is planned for."""

    wrapper: object
    step: int = -1
    planned: object = None  # CUDA event recorded after the last plan (its host->device copies)


def plan_step(step_plan: StepPlan, device: torch.device, step: int) -> FlashInferStepState:
    """The ``FlashInferStepState`` of ``step_plan`` (its page table; the block ids on ``device``),
    identified as step number ``step``."""
    table = page_table(step_plan.segments, step_plan.pool.block_size)
    as_i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    return FlashInferStepState(
        step=step, table=table, num_tokens=table.qo_indptr[-1],
        qo_indptr=as_i32(table.qo_indptr), kv_indptr=as_i32(table.kv_indptr),
        kv_indices=device_tensor(table.kv_indices, device, torch.int32),
        last_page_len=as_i32(table.last_page_len))


def paged_kv_cache(pool, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer's ``(k_cache, v_cache)`` HND paged cache of ``layer`` (fp8 pools as e4m3)."""
    return pool.keys[layer], pool.values[layer]


def wrapper_plan(state: FlashInferStepState, config: tuple, pool) -> tuple[str, tuple, dict]:
    """Which wrapper serves a step (``"decode"`` or ``"prefill"``) and the arguments of its
    ``plan`` call, for ``config`` = (query heads, scale, window_left, soft cap, q dtype, kv dtype).

    Decode wrapper: a pure-decode step whose K and V share a head dim. Prefill wrapper (causal,
    aligned to the end of each sequence's K/V like the torch reference) for everything else, with
    ``head_dim_vo`` = the pool's V head dim.
    """
    heads, scale, window_left, cap, q_dtype, kv_dtype = config
    common = dict(pos_encoding_mode="NONE", window_left=window_left, logits_soft_cap=cap,
                  q_data_type=q_dtype, kv_data_type=kv_dtype, o_data_type=q_dtype, sm_scale=scale)
    if state.decode and pool.head_dim == pool.head_dim_v:
        return "decode", (state.kv_indptr, state.kv_indices, state.last_page_len, heads,
                          pool.num_kv_heads, pool.head_dim, pool.block_size), common
    return "prefill", (state.qo_indptr, state.kv_indptr, state.kv_indices, state.last_page_len,
                       heads, pool.num_kv_heads, pool.head_dim, pool.block_size), \
        dict(common, head_dim_vo=pool.head_dim_v, causal=True)


def _require_cuda(device: torch.device) -> None:
    if device.type != "cuda":
        raise CacheError(f"the FlashInfer backend needs a CUDA device, got {device}; "
                         "use attention='torch' on CPU")


class FlashInferBackend:
    """Paged attention with FlashInfer's batch prefill/decode wrappers (flashinfer-python 0.6.18).

    Same contract as ``TorchBackend``: ``attend(layer, query [T, H, d], step_plan, scale,
    sliding_window=None, softcap=None) -> [T, H, dv]``, called per layer after the step's new K/V
    were written into the pool; query i of a segment at absolute position ``p`` sees keys
    ``0 .. p`` of its sequence (and only the last ``sliding_window`` of them when set), with
    logits ``softcap * tanh(q.k * scale / softcap)`` when ``softcap`` is set.

    ``device``: the CUDA device of the model and pool. ``kernel_backend``: FlashInfer's kernel
    family, "fa2" (default: prefill and tensor-core decode then share one JIT-compiled module per
    configuration, so the first run compiles half as much), "fa3" (Hopper prefill kernels) or
    "auto" (FlashInfer's choice: FA3 for fp16/bf16 prefill on Hopper). One 128 MiB float
    workspace is allocated here and shared by every wrapper; wrappers are created lazily, one per
    (prefill or decode, attention configuration), and reused across steps.

    Supports fp16/bf16 models with a pool of the same dtype or an fp8 (e4m3) pool, whose per-layer
    K/V scales are passed to ``run`` as ``k_scale``/``v_scale``. Raises ``CacheError`` for anything
    else (e.g. float32 models: use the torch backend). Thread-safe: plan-and-run of one call holds a
    lock, so concurrent forwards re-plan instead of running on each other's plan.
    """

    name = "flashinfer"

    def __init__(self, device, *, kernel_backend: str = "fa2"):
        """Check the device (``CacheError`` unless CUDA) and flashinfer (``CacheError`` when it is
        not installed), allocate the shared workspace; no kernel is compiled or planned yet."""
        device = torch.device(device)
        _require_cuda(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if kernel_backend not in KERNEL_BACKENDS:
            raise ValueError(f"kernel_backend must be one of {KERNEL_BACKENDS}, got {kernel_backend!r}")
        try:
            import flashinfer
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise CacheError("attention='flashinfer' needs flashinfer-python: "
                             "pip install flashinfer-python (radixcache's [gpu] extra)") from e
        self._flashinfer = flashinfer
        self.device = device
        self.kernel_backend = kernel_backend
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.plan_calls = 0  # wrapper.plan calls so far (one per step per attention configuration)
        self._slots: dict = {}
        self._steps = itertools.count()
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ per step
    def plan(self, step_plan: StepPlan) -> FlashInferStepState:
        """Build the step's page table once (called by ``StepPlan``; the result is its ``backend_state``).

        The FlashInfer wrappers themselves are planned by the first ``attend`` of the step that
        needs them, because their plan takes the head count, scale, window and soft cap.
        """
        return plan_step(step_plan, self.device, next(self._steps))

    # ------------------------------------------------------------------ per layer
    def attend(self, layer: int, query: torch.Tensor, plan: StepPlan, scale: float,
               sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        """``query [T, H, head_dim]`` (packed new tokens, segment order) -> attention output
        ``[T, H, head_dim_v]``.

        Attends over ``paged_kv_cache(plan.pool, layer)`` through the step's page table; plans the
        wrapper for this (heads, scale, window, soft cap, dtype) on its first use in the step.
        """
        state = plan.backend_state
        if not isinstance(state, FlashInferStepState):
            state = plan.backend_state = self.plan(plan)
        pool = plan.pool
        if query.dim() != 3 or query.shape[0] != state.num_tokens:
            raise CacheError(f"query must be [{state.num_tokens}, heads, head_dim] for this step, "
                             f"got {tuple(query.shape)}")
        heads, head_dim = query.shape[1], query.shape[2]
        if head_dim != pool.head_dim or heads % pool.num_kv_heads:
            raise CacheError(f"query [{heads} heads x {head_dim}] does not fit the pool "
                             f"({pool.num_kv_heads} KV heads x {pool.head_dim})")
        if query.dtype not in COMPUTE_DTYPES or pool.dtype != query.dtype:
            raise CacheError(f"the FlashInfer backend runs fp16/bf16 models with a pool of the same "
                             f"compute dtype; got query {query.dtype}, pool {pool.dtype}: use "
                             "attention='torch'")
        kv = paged_kv_cache(pool, layer)
        if kv[0].dtype not in (query.dtype, torch.float8_e4m3fn):
            raise CacheError(f"the FlashInfer backend cannot read a {kv[0].dtype} pool: use attention='torch'")
        window_left = int(sliding_window) - 1 if sliding_window else -1  # FlashInfer's is inclusive
        cap = float(softcap) if softcap else 0.0
        config = (heads, float(scale), window_left, cap, query.dtype, kv[0].dtype)
        q = query.contiguous()
        with self._lock:
            wrapper = self._planned(state, config, pool)
            if pool.quantized:
                k_scale, v_scale = pool.host_scales(layer)  # the host mirror: no device sync
                return wrapper.run(q, kv, k_scale=k_scale, v_scale=v_scale)
            return wrapper.run(q, kv)

    def _planned(self, state: FlashInferStepState, config: tuple, pool):
        """The wrapper for ``config``, planned for ``state``'s step (planning it if it is not)."""
        kind, args, kwargs = wrapper_plan(state, config, pool)
        fi = self._flashinfer
        key = (kind, config, pool.head_dim, pool.head_dim_v)
        slot = self._slots.get(key)
        if slot is None:
            if kind == "decode":
                heads, kv_dtype = config[0], config[5]
                # Tensor cores pay off from 4 query heads per KV head (and for fp8 KV); they also
                # reuse the prefill kernels' JIT module.
                tensor_cores = heads // pool.num_kv_heads >= 4 or kv_dtype == torch.float8_e4m3fn
                wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
                    self.workspace, KV_LAYOUT, use_tensor_cores=tensor_cores, backend=self.kernel_backend)
            else:
                backend = self.kernel_backend if pool.head_dim == pool.head_dim_v else "fa2"
                wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, KV_LAYOUT, backend=backend)
            slot = self._slots[key] = _Slot(wrapper)
        if slot.step == state.step:
            return slot.wrapper
        if slot.planned is not None:
            # plan() stages its schedule in pinned host memory and copies it asynchronously: do not
            # overwrite that staging buffer before the previous plan's copy has run.
            slot.planned.synchronize()
        slot.wrapper.plan(*args, **kwargs)
        self.plan_calls += 1
        if self.device.type == "cuda":
            slot.planned = torch.cuda.Event()
            slot.planned.record()
        slot.step = state.step
        return slot.wrapper

    def __repr__(self) -> str:
        return f"FlashInferBackend(device={self.device}, kernel_backend={self.kernel_backend!r})"
