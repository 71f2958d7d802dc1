"""Which attention backend ``resolve_backend`` picks, and the FlashInfer page table (CPU only)."""

import importlib.util
import logging

import pytest
import torch

from radixcache import CacheError
from radixcache.attention import Segment, paged_cpu, resolve_backend
from radixcache.attention.flashinfer_backend import FlashInferBackend, page_table
from radixcache.attention.torch_backend import TorchBackend

CPU = torch.device("cpu")


def without_flashinfer(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name == "flashinfer" else real(name, *a, **k))


def test_auto_on_cpu_is_torch_in_float32_and_without_a_dtype():
    for dtype in (None, torch.float32):
        backend = resolve_backend("auto", CPU, dtype, dtype)
        assert isinstance(backend, TorchBackend) and backend.name == "torch" and backend.kernel is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_auto_on_cpu_reads_a_half_precision_pool_in_place(dtype):
    if paged_cpu.kernel() is None:
        pytest.skip(f"no in-place kernel here: {paged_cpu.unavailable_reason()}")
    backend = resolve_backend("auto", CPU, dtype, dtype)
    assert backend.name == "torch-inplace" and backend.kernel is not None
    # an fp8 pool is dequantized by the gather: the kernel reads the compute dtype only
    assert resolve_backend("auto", CPU, dtype, torch.float8_e4m3fn).name == "torch"


def test_auto_on_cpu_without_a_compiler_gathers_and_says_why_once(monkeypatch, tmp_path, caplog):
    """A machine where the kernel cannot build (here: a C++ compiler that does not exist) serves a
    bf16 model through the gather, the reason logged once; "torch-inplace" is refused saying it."""
    monkeypatch.setattr(paged_cpu, "_BUILT", {})
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    with caplog.at_level(logging.WARNING, logger="radixcache"):
        for _ in range(2):
            assert resolve_backend("auto", CPU, torch.bfloat16, torch.bfloat16).name == "torch"
    assert caplog.text.count("in-place CPU paged attention is not available") == 1
    reason = paged_cpu.unavailable_reason()
    assert reason and "gathers each context" in caplog.text
    with pytest.raises(CacheError, match="cannot build here"):
        resolve_backend("torch-inplace", CPU, torch.bfloat16, torch.bfloat16)


def test_torch_on_cpu_is_torch():
    assert isinstance(resolve_backend("torch", CPU), TorchBackend)


def test_flashinfer_on_cpu_raises():
    with pytest.raises(CacheError, match="CUDA"):
        resolve_backend("flashinfer", CPU)


def test_auto_on_cuda_without_flashinfer_is_torch(monkeypatch):
    without_flashinfer(monkeypatch)
    assert isinstance(resolve_backend("auto", torch.device("cuda")), TorchBackend)


def test_flashinfer_on_cuda_without_flashinfer_raises(monkeypatch):
    without_flashinfer(monkeypatch)
    with pytest.raises(CacheError, match="flashinfer-python"):
        resolve_backend("flashinfer", torch.device("cuda"))


@pytest.mark.parametrize("name", ["", "FlashInfer", "flash", "sdpa", "eager", None, 1])
def test_bad_names_raise_value_error(name):
    with pytest.raises(ValueError, match="attention must be"):
        resolve_backend(name, CPU)


def test_flashinfer_backend_refuses_cpu():
    with pytest.raises(CacheError, match="CUDA"):
        FlashInferBackend(CPU)


# ---------------------------------------------------------------- FlashInfer page table (pure)
def test_page_table_of_a_mixed_step():
    segs = [Segment(0, 37, 37, (5, 9, 2, 7)),  # fresh prefill; one spare block
            Segment(37, 20, 68, (1, 3, 4, 6, 8)),  # suffix over a cached prefix
            Segment(57, 1, 48, (1, 3, 4, 11)),  # decode sharing that prefix; last page full
            Segment(58, 1, 1, (12,))]
    t = page_table(segs, 16)
    assert t.qo_indptr == [0, 37, 57, 58, 59]
    assert t.kv_indptr == [0, 3, 8, 11, 12]
    assert t.kv_indices == [5, 9, 2, 1, 3, 4, 6, 8, 1, 3, 4, 12]
    assert t.last_page_len == [5, 4, 16, 1]
    assert not t.decode


def test_page_table_of_a_decode_step():
    t = page_table([Segment(0, 1, 17, (3, 4, 5)), Segment(1, 1, 16, (6,))], 16)
    assert t.decode and t.kv_indices == [3, 4, 6] and t.last_page_len == [1, 16]


@pytest.mark.parametrize("segs, match", [
    ([], "at least one"),
    ([Segment(0, 2, 2, (0,)), Segment(3, 1, 5, (1,))], "packed in order"),
    ([Segment(1, 2, 2, (0,))], "packed in order"),
    ([Segment(0, 0, 4, (0,))], "q_len"),
    ([Segment(0, 5, 4, (0,))], "q_len"),
    ([Segment(0, 1, 17, (0,))], "cannot hold"),
])
def test_page_table_rejects_bad_segments(segs, match):
    with pytest.raises(CacheError, match=match):
        page_table(segs, 16)


# ------------------------------------ FlashInfer planning against the torch reference (CPU)
# flashinfer-python 0.6.18's plan signatures, positional part (BatchPrefillWithPagedKVCacheWrapper
# and BatchDecodeWithPagedKVCacheWrapper): what wrapper_plan's positional arguments mean to it.
PREFILL_PLAN = ("qo_indptr", "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len",
                "num_qo_heads", "num_kv_heads", "head_dim_qk", "page_size")
DECODE_PLAN = ("indptr", "indices", "last_page_len", "num_qo_heads", "num_kv_heads", "head_dim",
               "page_size")


def flashinfer_semantics(kind, args, kwargs, q, kv_cache, layout):
    """What FlashInfer's documented API computes for this plan and ``run(q, kv_cache)`` with a
    wrapper built for ``layout`` ("NHD": pages ``[page_size, kv_heads, dim]``; "HND": ``[kv_heads,
    page_size, dim]``): per request its pages' K/V (the last page ``last_page_len`` full), causal
    aligned to the end of the K/V (decode: one query at the end), ``window_left`` inclusive, soft
    cap on the scaled logits, GQA by head groups, output ``head_dim_vo`` wide."""
    plan = dict(zip(PREFILL_PLAN if kind == "prefill" else DECODE_PLAN, args), **kwargs)
    if kind == "decode":
        plan.update(qo_indptr=torch.arange(len(plan["indptr"])), paged_kv_indptr=plan["indptr"],
                    paged_kv_indices=plan["indices"], paged_kv_last_page_len=plan["last_page_len"],
                    head_dim_qk=plan["head_dim"], head_dim_vo=plan["head_dim"])
    assert kind == "decode" or plan["causal"]
    k_cache, v_cache = kv_cache
    if layout == "HND":  # read the pages token-major below
        k_cache, v_cache = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    else:
        assert layout == "NHD", layout
    assert k_cache.shape[1:] == (plan["page_size"], plan["num_kv_heads"], plan["head_dim_qk"])
    assert v_cache.shape[1:] == (plan["page_size"], plan["num_kv_heads"], plan["head_dim_vo"])
    heads, groups = plan["num_qo_heads"], plan["num_qo_heads"] // plan["num_kv_heads"]
    out = q.new_zeros(q.shape[0], heads, plan["head_dim_vo"])
    qo, kvp, last = plan["qo_indptr"].tolist(), plan["paged_kv_indptr"].tolist(), \
        plan["paged_kv_last_page_len"].tolist()
    indices = plan["paged_kv_indices"].tolist()
    for i in range(len(qo) - 1):
        pages = indices[kvp[i]:kvp[i + 1]]
        kv_len = (len(pages) - 1) * plan["page_size"] + last[i]
        k = k_cache[pages].reshape(-1, *k_cache.shape[2:])[:kv_len].float()
        v = v_cache[pages].reshape(-1, *v_cache.shape[2:])[:kv_len].float()
        for row in range(qo[i], qo[i + 1]):
            pos = kv_len - (qo[i + 1] - row)
            keys = torch.arange(kv_len)
            visible = keys <= pos
            if plan["window_left"] >= 0:
                visible &= pos - keys <= plan["window_left"]
            for h in range(heads):
                logits = (k[:, h // groups] @ q[row, h].float()) * plan["sm_scale"]
                if plan["logits_soft_cap"]:
                    cap = plan["logits_soft_cap"]
                    logits = cap * torch.tanh(logits / cap)
                weights = torch.softmax(logits.masked_fill(~visible, float("-inf")), 0)
                out[row, h] = weights @ v[:, h // groups]
    return out


@pytest.mark.parametrize("head_dims", [(16, 16), (24, 12)])  # (K, V): MLA-style when they differ
@pytest.mark.parametrize("steps", ["mixed", "decode"])
@pytest.mark.parametrize("window, softcap", [(None, None), (5, None), (None, 4.0)])
def test_flashinfer_plan_means_what_the_torch_reference_computes(head_dims, steps, window, softcap):
    """wrapper_plan's wrapper choice and plan arguments, read with FlashInfer's documented
    semantics over paged_kv_cache, give the torch backend's output (K and V head dims equal or
    not; mixed prefill/decode steps and pure decodes; sliding window; soft cap)."""
    from radixcache.attention import StepPlan
    from radixcache.attention.flashinfer_backend import (KV_LAYOUT, paged_kv_cache, plan_step,
                                                         wrapper_plan)
    from radixcache.kv.pool import KVPool

    dk, dv = head_dims
    g = torch.Generator().manual_seed(dk + len(steps))
    pool = KVPool(2, 24, 4, 2, dk, dtype=torch.float32, device="cpu", head_dim_v=dv)
    rows = pool.rows_for(list(range(24)), 0, 96)
    for layer in range(2):
        pool.write(layer, rows, torch.randn(96, 2, dk, generator=g), torch.randn(96, 2, dv, generator=g))
    if steps == "mixed":
        segments = [Segment(0, 7, 7, (3, 4)), Segment(7, 1, 10, (0, 1, 2)),
                    Segment(8, 5, 13, (0, 1, 9, 10)), Segment(13, 1, 4, (5,))]
    else:
        segments = [Segment(0, 1, 10, (0, 1, 2)), Segment(1, 1, 9, (0, 1, 6)), Segment(2, 1, 1, (7,))]
    plan = StepPlan(pool, segments, TorchBackend())
    query = torch.randn(plan.num_tokens, 4, dk, generator=g)
    window_left = window - 1 if window else -1
    config = (4, 0.4, window_left, softcap or 0.0, torch.float32, torch.float32)
    kind, args, kwargs = wrapper_plan(plan_step(plan, CPU, 0), config, pool)
    assert kind == ("decode" if steps == "decode" and dk == dv else "prefill")
    for layer in range(2):
        want = TorchBackend().attend(layer, query, plan, 0.4, sliding_window=window, softcap=softcap)
        got = flashinfer_semantics(kind, args, kwargs, query, paged_kv_cache(pool, layer), KV_LAYOUT)
        assert got.shape == want.shape == (plan.num_tokens, 4, dv)
        assert torch.allclose(got, want, atol=1e-5)
