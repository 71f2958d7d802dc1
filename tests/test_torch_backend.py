"""The torch paged-attention backend's gather path against a naive per-query reference (end-aligned
causal mask); the in-place kernel has its own tests (test_paged_cpu.py)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixcache.attention.plan import Segment, StepPlan
from radixcache.attention.torch_backend import TorchBackend, TorchStepState
from radixcache.kv.pool import KVPool


def naive(q, keys, values, positions, scale, sliding_window=None, softcap=None):
    """One query row at a time: q [H, d] at absolute position p sees keys 0..p -> [H, dv]."""
    heads, kv_heads = q.shape[0], keys.shape[1]
    out = q.new_empty(heads, values.shape[-1])
    for h in range(heads):
        kh = h // (heads // kv_heads)
        lo = 0 if not sliding_window else max(0, positions - sliding_window + 1)
        s = (keys[lo:positions + 1, kh] @ q[h]) * scale
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        out[h] = torch.softmax(s, 0) @ values[lo:positions + 1, kh]
    return out


def build(seed, shared_blocks, tails, prefills, bs=4, kv_heads=2, heads=4, dim=8, kv_dtype=None):
    """A pool with random contents and a plan: decode segments sharing ``shared_blocks`` blocks,
    each with its own tail, plus multi-token prefill segments."""
    g = torch.Generator().manual_seed(seed)
    pool = KVPool(1, 96, bs, kv_heads, dim, dtype=torch.float32, device="cpu", kv_dtype=kv_dtype)
    data = torch.randn(97, 2, bs, kv_heads, dim, generator=g)
    rows = pool.rows_for(list(range(96)), 0, 96 * bs)
    flat = data[:96].permute(0, 2, 1, 3, 4)  # [block, offset, kv, h, d]
    pool.write(0, rows, flat[:, :, 0].reshape(-1, kv_heads, dim), flat[:, :, 1].reshape(-1, kv_heads, dim))
    next_block = iter(range(shared_blocks, 96))
    segments, start = [], 0
    for tail in tails:
        kv_len = shared_blocks * bs + tail
        own = [next(next_block) for _ in range(math.ceil(tail / bs))]
        segments.append(Segment(start, 1, kv_len, tuple(range(shared_blocks)) + tuple(own)))
        start += 1
    for q_len, kv_len in prefills:
        blocks = tuple(next(next_block) for _ in range(math.ceil(kv_len / bs)))
        segments.append(Segment(start, q_len, kv_len, blocks))
        start += q_len
    query = torch.randn(start, heads, dim, generator=g)
    return pool, segments, query


def check(pool, segments, query, scale=0.35, **kw):
    plan = StepPlan(pool, segments, TorchBackend(in_place=False))
    out = TorchBackend(in_place=False).attend(0, query, plan, scale, **kw)
    for seg in segments:
        keys, values = pool.read(0, pool.rows_for(seg.blocks, 0, seg.kv_len))
        for i in range(seg.q_len):
            want = naive(query[seg.q_start + i], keys, values, seg.kv_len - seg.q_len + i, scale, **kw)
            assert torch.allclose(out[seg.q_start + i], want, atol=2e-5), (seg, i)
    return plan


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), shared=st.integers(0, 5),
       tails=st.lists(st.integers(1, 9), min_size=1, max_size=5),
       prefills=st.lists(st.tuples(st.integers(2, 6), st.integers(6, 20)), max_size=2),
       window=st.sampled_from([None, 3, 64]), softcap=st.sampled_from([None, 5.0]))
def test_backend_matches_naive_reference(seed, shared, tails, prefills, window, softcap):
    """Mixed prefill/decode steps, with and without a shared prefix, sliding window, soft-capping."""
    prefills = [(min(q, kv), kv) for q, kv in prefills]
    pool, segments, query = build(seed, shared, tails, prefills)
    check(pool, segments, query, sliding_window=window, softcap=softcap)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10**6), tails=st.lists(st.integers(1, 9), max_size=3),
       prefills=st.lists(st.tuples(st.integers(2, 20), st.booleans()), min_size=1, max_size=3),
       window=st.sampled_from([None, 3, 64]), softcap=st.sampled_from([None, 5.0]))
def test_a_prompt_with_nothing_before_it_attends_over_what_it_wrote(seed, tails, prefills, window,
                                                                     softcap):
    """A step whose K/V went in through ``StepPlan.write``: a prefill with nothing cached before
    it (fresh) reads the K/V it was handed instead of the pool, one over a cached prefix reads the
    pool; both equal the reference over what the pool holds after the write."""
    shapes = [(n, n if fresh else n + 5) for n, fresh in prefills]
    pool, segments, _ = build(seed, 0, tails, shapes)
    g = torch.Generator().manual_seed(seed + 1)
    tokens = segments[-1].q_start + segments[-1].q_len
    query = torch.randn(tokens, 4, 8, generator=g)
    plan = StepPlan(pool, segments, TorchBackend(in_place=False))
    plan.write(0, torch.randn(tokens, 2, 8, generator=g), torch.randn(tokens, 2, 8, generator=g))
    with pytest.MonkeyPatch.context() as monkeypatch:
        gathered = spy_prefill_gathers(monkeypatch)
        out = TorchBackend(in_place=False).attend(0, query, plan, 0.35, sliding_window=window, softcap=softcap)
    for index, (_, seg) in enumerate(plan.backend_state.prefills):
        assert (index in gathered) == (seg.kv_len > seg.q_len), seg  # only a cached prefix is read
    for seg in segments:
        keys, values = pool.read(0, pool.rows_for(seg.blocks, 0, seg.kv_len))
        for i in range(seg.q_len):
            want = naive(query[seg.q_start + i], keys, values, seg.kv_len - seg.q_len + i, 0.35,
                         sliding_window=window, softcap=softcap)
            assert torch.allclose(out[seg.q_start + i], want, atol=2e-5), (seg, i)


def spy_prefill_gathers(monkeypatch) -> list:
    """The prefill indices whose context the torch backend gathers from the pool, from now on."""
    gathered = []
    real = TorchStepState.prefill_context

    def spy(state, index):
        gathered.append(index)
        return real(state, index)

    monkeypatch.setattr(TorchStepState, "prefill_context", spy)
    return gathered


def test_an_fp8_pool_attends_over_what_it_stored_not_what_it_was_handed(monkeypatch):
    """In an fp8 pool the stored K/V differ from the computed ones: a fresh prompt reads the pool,
    as its later turns will."""
    pool, segments, _ = build(3, 0, [], [(6, 6)], kv_dtype="fp8")
    plan = StepPlan(pool, segments, TorchBackend(in_place=False))
    plan.write(0, torch.randn(6, 2, 8), torch.randn(6, 2, 8))
    assert plan.written(0) is None
    gathered = spy_prefill_gathers(monkeypatch)
    TorchBackend(in_place=False).attend(0, torch.randn(6, 4, 8), plan, 0.35)
    assert gathered == [0]


def poison_unwritten(pool, segments):
    """NaN into every slot of the segments' last blocks past their K/V (a reused block's stale
    bytes can be anything): attending over one of them would make the output NaN."""
    for seg in segments:
        end = math.ceil(seg.kv_len / pool.block_size) * pool.block_size
        if end > seg.kv_len:
            rows = pool.rows_for(seg.blocks, seg.kv_len, end)
            nan = torch.full((len(rows), pool.num_kv_heads, pool.head_dim), float("nan"))
            pool.write(0, rows, nan, nan)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10**6), shared=st.integers(0, 3),
       tails=st.lists(st.integers(1, 9), min_size=1, max_size=4),
       prefills=st.lists(st.tuples(st.integers(2, 6), st.integers(6, 20)), max_size=2),
       window=st.sampled_from([None, 3]))
def test_unwritten_slots_are_never_attended(seed, shared, tails, prefills, window):
    """Decodes of one length or several, over a shared prefix or not, and prefills: a partly
    written block's unwritten slots never reach attention, whatever they hold."""
    prefills = [(min(q, kv), kv) for q, kv in prefills]
    pool, segments, query = build(seed, shared, tails, prefills)
    poison_unwritten(pool, segments)
    check(pool, segments, query, sliding_window=window)


def test_shared_prefix_takes_the_cascade_path():
    """Several decodes over one shared prefix: the plan reads the prefix once (cascade)."""
    pool, segments, query = build(1, 4, [3, 5, 1, 8], [])
    plan = check(pool, segments, query)
    state = plan.backend_state
    assert state.shared_len == 16 and state.context(16).shape == (4, pool.num_kv_heads, 8) and state.context(16).width == 8


@pytest.mark.parametrize("fused", [True, False])
@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10**6), shared=st.integers(1, 4),
       tails=st.lists(st.integers(1, 9), min_size=2, max_size=5))
def test_cascade_decode_matches_the_reference_with_either_kernel(fused, seed, shared, tails):
    """The cascade's two partial attentions run on torch's fused CPU flash kernel (which returns
    the log-sum-exp) or, where it cannot (CUDA, K and V of different head dims), on the float32
    reference; both merge to what a naive per-query softmax gives."""
    import radixcache.attention.torch_backend as backend

    pool, segments, query = build(seed, shared, tails, [])
    saved = backend._FLASH_CPU
    backend._FLASH_CPU = saved if fused else None
    try:
        plan = check(pool, segments, query)
    finally:
        backend._FLASH_CPU = saved
    assert plan.backend_state.shared_len > 0


def test_a_decode_whose_whole_context_is_shared_still_attends_its_last_token():
    """A decode ending exactly at a block boundary inside what the others share: the cascade's
    shared part stops a block earlier, so every decode keeps a non-empty own tail (a fused kernel
    gives an empty row log-sum-exp 0, not -inf, which would weigh zeros into the merge)."""
    pool, segments, query = build(4, 3, [5, 7], [])
    bs = pool.block_size
    segments = [Segment(0, 1, 2 * bs, segments[0].blocks[:2])] + [Segment(1, 1, s.kv_len, s.blocks) for s in segments[1:]]
    plan = check(pool, segments, query[:2])
    assert plan.backend_state.shared_len == bs


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
def test_low_precision_pools_stay_close(kv_dtype):
    """bf16 and fp8 pools dequantize to the compute dtype; attention stays close to fp32."""
    pool32, segments, query = build(2, 3, [2, 6], [(4, 12)])
    pool_lp, _, _ = build(2, 3, [2, 6], [(4, 12)], kv_dtype=kv_dtype)
    plan32 = StepPlan(pool32, segments, TorchBackend(in_place=False))
    plan_lp = StepPlan(pool_lp, segments, TorchBackend(in_place=False))
    a = TorchBackend(in_place=False).attend(0, query, plan32, 0.35)
    b = TorchBackend(in_place=False).attend(0, query, plan_lp, 0.35)
    tol = 0.03 if kv_dtype == "bf16" else 0.25
    assert (a - b).abs().max() < tol


def test_attend_reads_nothing_back_to_the_host(monkeypatch):
    """Per layer, the backend makes no host sync: no .item()/.tolist()/int()/float()/bool() of a
    tensor (on CUDA each would stall the stream once per layer)."""
    pool, segments, query = build(3, 4, [3, 5, 1, 8], [(4, 12), (2, 9)])
    plan = StepPlan(pool, segments, TorchBackend(in_place=False))

    def sync(*args, **kwargs):
        raise AssertionError("host sync inside attend")

    for name in ("item", "tolist", "__int__", "__float__", "__bool__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, sync)
    for window, softcap in ((None, None), (3, None), (None, 5.0)):
        TorchBackend(in_place=False).attend(0, query, plan, 0.35, sliding_window=window, softcap=softcap)


def test_a_step_sends_no_per_position_list_to_the_device(monkeypatch):
    """Issue 18: planning a step builds on the host only what is O(segments + blocks); every
    per-position index (rows of the new tokens, of each context) is computed on the device. Four
    decodes over 1,000 tokens each and a 600-token prefill chunk over 1,000: the host lists the
    plan and the backend copy to the device hold far fewer values than the 4,600 positions."""
    import radixcache.attention.plan as plan_module
    import radixcache.attention.torch_backend as backend_module

    copied = []
    real = plan_module.device_tensor

    def counting(values, *args, **kwargs):
        copied.append(len(values))
        return real(values, *args, **kwargs)

    monkeypatch.setattr(plan_module, "device_tensor", counting)
    monkeypatch.setattr(backend_module, "device_tensor", counting)
    bs = 16
    pool = KVPool(1, 400, bs, 2, 8, dtype=torch.float32, device="cpu")
    blocks = iter(range(400))
    segments, start = [], 0
    for q_len, kv_len in [(1, 1000)] * 4 + [(600, 1000)]:
        segments.append(Segment(start, q_len, kv_len, tuple(next(blocks) for _ in range(-(-kv_len // bs)))))
        start += q_len
    plan = StepPlan(pool, segments, TorchBackend(in_place=False))
    TorchBackend(in_place=False).attend(0, torch.randn(start, 4, 8), plan, 0.35)
    assert 0 < sum(copied) <= 5 * 3 + 5 * 63 + 10  # offsets and lengths, the block table
    want = torch.cat([pool.rows_for(s.blocks, s.kv_len - s.q_len, s.kv_len) for s in segments])
    assert torch.equal(plan.write_rows, want)
    assert torch.equal(plan.write_slots, pool.slots(want).reshape(-1))
