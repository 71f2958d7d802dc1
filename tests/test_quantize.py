"""``radixcache.quantize``: int8 weight-only through torchao, the greedy agreement it reports, a
quantized model served by the paged path, and the errors before anything is touched."""

import sys

import pytest
import torch

import radixcache
from radixcache.integrations.hf.identity import model_identity
from radixcache.quantize import PROBE_NEW, QuantizeReport, quantize_weights

from tiny_models import plain_greedy, random_ids, tiny_model

torchao = pytest.importorskip("torchao")  # in the dev extra: skipped only outside it


def test_int8_reports_its_greedy_agreement_and_the_paged_path_serves_it():
    model = tiny_model("llama")
    before = model_identity(model)
    report = quantize_weights(model, "int8")
    assert isinstance(report, QuantizeReport)
    assert report.scheme == "int8" and report.probe_tokens == PROBE_NEW
    assert 0 <= report.agreeing <= PROBE_NEW
    assert report.weights == sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert f"first {report.agreeing} of {PROBE_NEW}" in report.describe()
    assert model.model.layers[0].mlp.up_proj.weight.dtype != torch.float32 or \
        "Int8" in type(model.model.layers[0].mlp.up_proj.weight).__name__  # really quantized
    after = model_identity(model)
    assert after != before and after == model_identity(model)  # new weights, a stable new identity
    lm = radixcache.wrap(model, max_cache_tokens=2048)
    assert lm.unsupported is None and lm.engine_unsupported is None
    prompt = random_ids(40, seed=3)[0].tolist()
    want = plain_greedy(model, prompt, 6)
    ids = torch.tensor([prompt])
    assert lm.generate(ids, max_new_tokens=6, do_sample=False)[0, len(prompt):].tolist() == want
    assert lm.generate_batch([prompt], max_new_tokens=6, do_sample=False)[0][0] == want


def test_an_unknown_scheme_is_refused_before_the_model_changes():
    model = tiny_model("llama")
    weight = model.model.layers[0].mlp.up_proj.weight.detach().clone()
    with pytest.raises(ValueError, match="quantize must be one of int8"):
        quantize_weights(model, "int3")
    assert torch.equal(model.model.layers[0].mlp.up_proj.weight, weight)


def test_without_torchao_the_error_names_the_install_line_and_the_model_is_untouched(monkeypatch):
    model = tiny_model("llama")
    weight = model.model.layers[0].mlp.up_proj.weight.detach().clone()
    monkeypatch.setitem(sys.modules, "torchao.quantization", None)  # what an absent package raises
    with pytest.raises(ImportError, match=r"needs torchao: pip install torchao \(radixcache's \[quantize\] extra\)"):
        quantize_weights(model, "int8")
    assert torch.equal(model.model.layers[0].mlp.up_proj.weight, weight)
