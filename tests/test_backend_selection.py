"""Which attention backend ``resolve_backend`` picks, and the FlashInfer page table (CPU only)."""

import importlib.util

import pytest
import torch

from radixcache import CacheError
from radixcache.attention import Segment, resolve_backend
from radixcache.attention.flashinfer_backend import FlashInferBackend, page_table
from radixcache.attention.torch_backend import TorchBackend

CPU = torch.device("cpu")


def without_flashinfer(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name == "flashinfer" else real(name, *a, **k))


def test_auto_on_cpu_is_torch():
    backend = resolve_backend("auto", CPU)
    assert isinstance(backend, TorchBackend) and backend.name == "torch"


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
