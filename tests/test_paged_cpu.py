"""The in-place CPU paged attention (``radixcache.attention.paged_cpu``) against the gather + SDPA
path and a naive per-query reference, and the torch backend's choice between them."""

import logging
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixcache.attention import paged_cpu
from radixcache.attention.plan import Segment, StepPlan
from radixcache.attention.torch_backend import TorchBackend
from radixcache.errors import CacheError
from radixcache.kv.pool import KVPool

from test_torch_backend import naive

KERNEL = paged_cpu.kernel()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason=f"no in-place kernel here: {paged_cpu.unavailable_reason()}")


def scattered_step(seed, decodes, prefills, bs, kv_heads, heads, dim, dim_v, dtype, shared_blocks=0):
    """A pool whose blocks are handed out in a random order; decode segments (``decodes``: own
    tokens after ``shared_blocks`` shared whole blocks) and prefills ``(q_len, kv_len)``; every slot
    past a segment's K/V in its last block holds NaN (stale bytes of a reused block)."""
    g = torch.Generator().manual_seed(seed)
    lengths = [shared_blocks * bs + own for own in decodes] + [kv for _, kv in prefills]
    blocks_needed = shared_blocks + sum(math.ceil(n / bs) for n in lengths)
    pool = KVPool(1, blocks_needed + 2, bs, kv_heads, dim, dtype=dtype, device="cpu", head_dim_v=dim_v)
    order = torch.randperm(blocks_needed + 2, generator=g).tolist()
    shared, order = tuple(order[:shared_blocks]), order[shared_blocks:]
    segments, start = [], 0
    for own in decodes:
        n = math.ceil(own / bs)
        blocks, order = shared + tuple(order[:n]), order[n:]
        segments.append(Segment(start, 1, shared_blocks * bs + own, blocks))
        start += 1
    for q_len, kv_len in prefills:
        n = math.ceil(kv_len / bs)
        blocks, order = tuple(order[:n]), order[n:]
        segments.append(Segment(start, q_len, kv_len, blocks))
        start += q_len
    for seg in segments:
        rows = pool.rows_for(seg.blocks, 0, seg.kv_len)
        pool.write(0, rows, torch.randn(len(rows), kv_heads, dim, generator=g).to(dtype),
                   torch.randn(len(rows), kv_heads, dim_v, generator=g).to(dtype))
        end = math.ceil(seg.kv_len / bs) * bs
        if end > seg.kv_len:
            stale = pool.rows_for(seg.blocks, seg.kv_len, end)
            pool.write(0, stale, torch.full((len(stale), kv_heads, dim), float("nan"), dtype=dtype),
                       torch.full((len(stale), kv_heads, dim_v), float("nan"), dtype=dtype))
    query = torch.randn(start, heads, dim, generator=g).to(dtype)
    return pool, segments, query


def run_kernel(pool, segments, query, scale, window=0, softcap=0.0):
    plan = StepPlan(pool, segments, TorchBackend(in_place=False))
    rows = torch.tensor([(s.q_start, s.q_len, s.kv_len, i) for i, s in enumerate(segments)], dtype=torch.long)
    return KERNEL.paged_attention(query, pool.keys[0], pool.values[0], plan.block_table, rows, scale, window,
                                  softcap)


@needs_kernel
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**6), decodes=st.lists(st.integers(1, 40), max_size=5),
       prefills=st.lists(st.tuples(st.integers(1, 20), st.integers(0, 30)), max_size=2),
       bs=st.sampled_from([1, 5, 16, 37]), groups=st.sampled_from([1, 3]), kv_heads=st.sampled_from([1, 2]),
       dims=st.sampled_from([(8, 8), (64, 64), (48, 48), (24, 16), (20, 20), (32, 48)]), window=st.sampled_from([0, 3, 64]),
       softcap=st.sampled_from([0.0, 5.0]))
def test_the_kernel_matches_a_naive_reference_in_float32(seed, decodes, prefills, bs, groups, kv_heads, dims,
                                                        window, softcap):
    """Decodes and multi-token segments over a cached prefix, any block size (runs of 16 keys and
    what is left of a block, from any first key), GQA, K and V of different head dims (MLA), head
    dims off the vector width, windows, soft-caps; NaN in every unwritten slot never reaches a row."""
    prefills = [(q, q + past) for q, past in prefills]
    if not decodes and not prefills:
        decodes = [3]
    dim, dim_v = dims
    pool, segments, query = scattered_step(seed, decodes, prefills, bs, kv_heads, kv_heads * groups, dim, dim_v,
                                           torch.float32)
    out = run_kernel(pool, segments, query, 0.3, window, softcap)
    for seg in segments:
        keys, values = pool.read(0, pool.rows_for(seg.blocks, 0, seg.kv_len))
        for i in range(seg.q_len):
            want = naive(query[seg.q_start + i], keys, values, seg.kv_len - seg.q_len + i, 0.3,
                         sliding_window=window or None, softcap=softcap or None)
            got = out[seg.q_start + i]
            assert torch.isfinite(got).all() and torch.allclose(got, want, atol=2e-5), (seg, i)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_pools_match_the_gather_path(dtype):
    """In bfloat16 and float16 the kernel reads the pool's own dtype, accumulates in float32 and
    agrees with gather + SDPA to the output dtype's rounding."""
    pool, segments, query = scattered_step(5, [7, 33, 16, 1], [], 16, 2, 6, 64, 64, dtype)
    want = StepPlan(pool, segments, TorchBackend(in_place=False)).attend(0, query, 0.125)
    got = run_kernel(pool, segments, query, 0.125)
    assert got.dtype == dtype
    assert torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@needs_kernel
def test_the_backend_decodes_in_place_and_keeps_gathering_for_prefills(monkeypatch):
    """On CPU the default backend serves every decode of a step with one kernel call and the
    prefills over a cached prefix with gather + SDPA; the result is the gather path's."""
    pool, segments, query = scattered_step(9, [5, 20], [(6, 30), (4, 4)], 4, 2, 4, 8, 8, torch.float32)
    backend = TorchBackend(in_place=True)
    assert backend.kernel is KERNEL
    plan = StepPlan(pool, segments, backend)
    calls = []
    real = KERNEL.paged_attention

    class Spy:
        def paged_attention(self, *args):
            calls.append(args[4].tolist())
            return real(*args)

    plan.backend_state.kernel = Spy()
    got = backend.attend(0, query, plan, 0.35)
    assert calls == [[[0, 1, 5, 0], [1, 1, 20, 1]]]  # the decodes only, in one call
    want = StepPlan(pool, segments, TorchBackend(in_place=False)).attend(0, query, 0.35)
    assert torch.allclose(got, want, atol=2e-5)


@needs_kernel
def test_only_torch_inplace_decodes_in_place():
    """The torch backend gathers (SDPA over exactly what a DynamicCache holds: plain generate's
    tokens bit for bit), and so does a float32 wrap by default; attention="torch-inplace" reads the
    pool in place, and so does a half-precision wrap by default."""
    import radixcache
    from tiny_models import tiny_model

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        pool, segments, _ = scattered_step(3, [5, 9], [], 4, 2, 4, 8, 8, dtype)
        assert StepPlan(pool, segments, TorchBackend()).backend_state.kernel is None
        assert StepPlan(pool, segments, TorchBackend(in_place=True)).backend_state.kernel is KERNEL
    lm = radixcache.wrap(tiny_model("llama"), attention="torch-inplace", max_cache_tokens=1024)
    assert lm.backend.name == "torch-inplace" and lm.backend.kernel is KERNEL and "torch-inplace" in repr(lm)
    assert radixcache.wrap(tiny_model("llama"), max_cache_tokens=1024).backend.kernel is None
    half = radixcache.wrap(tiny_model("llama").to(torch.bfloat16), max_cache_tokens=1024)
    assert half.backend.name == "torch-inplace" and half.backend.kernel is KERNEL


@needs_kernel
def test_a_shared_prefix_in_half_precision_keeps_the_cascade():
    """Decodes sharing whole blocks: in bfloat16 the cascade (the prefix read once) is faster than
    reading it per sequence, so the step gathers; in float32 (when asked) it decodes in place."""
    for dtype, in_place in ((torch.bfloat16, False), (torch.float32, True)):
        pool, segments, _ = scattered_step(2, [5, 9, 3], [], 4, 2, 4, 8, 8, dtype, shared_blocks=3)
        state = StepPlan(pool, segments, TorchBackend(in_place=True)).backend_state
        assert state.shared_len == 12 and (state.kernel is not None) == in_place


def test_an_fp8_pool_is_gathered_and_dequantized():
    pool = KVPool(1, 8, 4, 2, 8, dtype=torch.bfloat16, device="cpu", kv_dtype="fp8")
    state = StepPlan(pool, [Segment(0, 1, 5, (0, 1))], TorchBackend(in_place=True)).backend_state
    assert state.kernel is None


def test_without_the_kernel_torch_inplace_is_refused_saying_why_once(monkeypatch, caplog):
    import radixcache
    from tiny_models import tiny_model

    monkeypatch.setattr(paged_cpu, "_BUILT", {})
    monkeypatch.setattr(paged_cpu, "_build", lambda: (None, "no C++ compiler"))
    with caplog.at_level(logging.WARNING, logger="radixcache"):
        for _ in range(2):
            with pytest.raises(CacheError, match=r"cannot build here \(no C\+\+ compiler\)"):
                TorchBackend(in_place=True)
    assert caplog.text.count("no C++ compiler") == 1 and "gathers each context" in caplog.text
    assert paged_cpu.unavailable_reason() == "no C++ compiler"
    with pytest.raises(CacheError, match="cannot build here"):
        radixcache.wrap(tiny_model("llama"), attention="torch-inplace", max_cache_tokens=1024)
    assert TorchBackend().kernel is None  # the default never needed it


def test_torch_inplace_is_for_a_cpu_only(monkeypatch):
    monkeypatch.setattr(paged_cpu, "kernel", lambda: pytest.fail("built for a CUDA backend"))
    with pytest.raises(CacheError, match="on a CPU only"):
        TorchBackend(in_place=True, device="cuda")


@needs_kernel
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_torch_inplace_generates_what_the_gather_path_does_to_rounding(family):
    """lm.generate and the engine through attention="torch-inplace" (float32): the decode logits
    agree with the default backend's to float32 rounding, and the pool's invariants hold."""
    import radixcache
    from tiny_models import tiny_model

    model = tiny_model(family)
    inplace = radixcache.wrap(model, attention="torch-inplace", max_cache_tokens=2048)
    gather = radixcache.wrap(model, max_cache_tokens=2048)
    calls = []

    class Counting:
        def paged_attention(self, *args):
            calls.append(args[4].shape[0])
            return KERNEL.paged_attention(*args)

    inplace.backend.kernel = Counting()
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(3, 200, (2, 40), generator=g)
    args = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True)
    a, b = inplace.generate(ids, **args), gather.generate(ids, **args)
    for x, y in zip(a.logits, b.logits):
        assert torch.allclose(x, y, atol=1e-4, rtol=1e-4)
    prompts = [ids[0].tolist(), ids[1, :17].tolist()]
    engine = inplace.generate_batch(prompts, max_new_tokens=5, do_sample=False, eos_token_id=None)
    assert [len(r[0]) for r in engine] == [5, 5]
    assert calls and max(calls) == 2  # both rows' decodes in one call per layer
    inplace.manager.check()
