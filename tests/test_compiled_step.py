"""``wrap(model, compile=True)``: the engine's step through ``torch.compile``, the attention one
opaque op. Its tokens are the eager engine's, it compiles at wrap time and never again, nothing
breaks the graph, and where it cannot compile the engine stays eager and says why."""

import random

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import radixcache
from radixcache.errors import CacheError
from radixcache.integrations.hf.attention import paged_attention_op
from radixcache.integrations.hf.runner import HFModelRunner

from tiny_models import tiny_model


def prompts(seed: int, lengths) -> list:
    rng = random.Random(seed)
    return [[rng.randrange(3, 200) for _ in range(n)] for n in lengths]


def test_a_compiled_engine_step_gives_the_eager_tokens_and_never_recompiles():
    torch._dynamo.reset()
    counters.clear()
    model = tiny_model("llama")
    compiled = radixcache.wrap(model, compile=True, max_cache_tokens=4096)
    assert compiled.compile_failed is None and compiled.compile_s > 0
    assert compiled.runner.compiled is not None
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= 1
    eager = radixcache.wrap(model, max_cache_tokens=4096)
    # batches of one and many, prompts of every length class, shared prefixes, parallel samples
    for batch in (prompts(0, [5]), prompts(1, [40, 17, 70, 3]), prompts(2, [33, 33])):
        want = eager.generate_batch(batch, max_new_tokens=9, do_sample=False, eos_token_id=None)
        got = compiled.generate_batch(batch, max_new_tokens=9, do_sample=False, eos_token_id=None)
        assert list(got) == list(want)
    sampled = compiled.generate_batch(prompts(3, [21]), max_new_tokens=6, do_sample=True, seed=7, n=3)
    assert len(sampled[0]) == 3
    assert counters["stats"]["unique_graphs"] == graphs  # compiled at wrap time, never on a request
    assert not counters["graph_break"]
    assert compiled.stats()["fallbacks"] == 0
    compiled.manager.check()


def test_a_step_that_fails_to_compile_leaves_the_engine_eager_and_says_why(monkeypatch, caplog):
    def broken(runner):
        def fails(**inputs):
            raise RuntimeError("no C++ compiler here")

        runner.compiled = fails

    monkeypatch.setattr(HFModelRunner, "compile", broken)
    model = tiny_model("llama")
    with caplog.at_level("WARNING", logger="radixcache"):
        lm = radixcache.wrap(model, compile=True, max_cache_tokens=2048)
    assert "no C++ compiler here" in lm.compile_failed
    assert lm.runner.compiled is None and lm.engine_unsupported is None
    assert "the engine runs eagerly" in caplog.text
    out = lm.generate_batch(prompts(4, [12]), max_new_tokens=4, do_sample=False, eos_token_id=None)
    assert len(out[0][0]) == 4


def test_compile_must_be_a_bool():
    with pytest.raises(TypeError, match="compile must be True or False"):
        radixcache.wrap(tiny_model("llama"), compile="yes")


def test_the_attention_op_refuses_to_run_outside_a_compiled_step():
    q = torch.zeros(1, 4, 2, 8)
    k = torch.zeros(1, 2, 2, 8)
    with pytest.raises(CacheError, match="outside compiled_step"):
        paged_attention_op(q, k, k, 0, 0.35, 0, 0.0)


def test_a_model_that_runs_dense_is_not_compiled_and_says_why(monkeypatch):
    # no family of this transformers runs dense (each reaches the hook); a model that did would say so
    monkeypatch.setattr("radixcache.integrations.hf.lm.hooked", lambda model: False)
    lm = radixcache.wrap(tiny_model("llama"), compile=True, max_cache_tokens=2048)
    assert "runs dense" in lm.compile_failed and lm.runner.compiled is None and lm.compile_s is None


def test_lm_generate_runs_the_compiled_step_gives_plain_tokens_and_never_recompiles(monkeypatch):
    torch._dynamo.reset()
    counters.clear()
    model = tiny_model("llama")
    compiled = radixcache.wrap(model, compile=True, max_cache_tokens=4096)
    eager = radixcache.wrap(model, max_cache_tokens=4096)  # the same model, not compiled
    graphs = counters["stats"]["unique_graphs"]
    routed = []
    forward_generate = HFModelRunner.forward_generate

    def spy(runner, cache, input_ids, position_ids):
        routed.append(runner)
        return forward_generate(runner, cache, input_ids, position_ids)

    monkeypatch.setattr(HFModelRunner, "forward_generate", spy)
    ids = torch.tensor([[0, 0, 7, 8, 9, 10], [5, 6, 7, 8, 9, 11]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    single = torch.tensor([prompts(5, [37])[0]])
    longer = torch.cat([single, torch.tensor([prompts(6, [20])[0]])], dim=1)  # a cached prefix
    for args in (dict(input_ids=ids, attention_mask=mask, pad_token_id=0), dict(input_ids=single),
                 dict(input_ids=longer), dict(input_ids=ids, attention_mask=mask, pad_token_id=0)):
        want = model.generate(**args, max_new_tokens=7, do_sample=False, eos_token_id=None)
        assert compiled.generate(**args, max_new_tokens=7, do_sample=False, eos_token_id=None).tolist() == want.tolist()
        assert routed and set(routed) == {compiled.runner}
        routed.clear()
        assert eager.generate(**args, max_new_tokens=7, do_sample=False, eos_token_id=None).tolist() == want.tolist()
        assert not routed  # the eager wrapper's forwards are the model's own
    assert compiled.stats()["hit_tokens"] >= 37
    assert counters["stats"]["unique_graphs"] == graphs and not counters["graph_break"]
    compiled.manager.check()
    eager.manager.check()


def test_two_threads_generate_through_one_compiled_step_at_once():
    from concurrent.futures import ThreadPoolExecutor

    model = tiny_model("llama")
    lm = radixcache.wrap(model, compile=True, max_cache_tokens=4096)
    batch = [torch.tensor([p]) for p in prompts(8, [30, 45, 12, 60])]
    want = [model.generate(p, max_new_tokens=12, do_sample=False, eos_token_id=None).tolist() for p in batch]
    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(lambda p: lm.generate(p, max_new_tokens=12, do_sample=False,
                                                  eos_token_id=None).tolist(), batch * 2))
    assert got == want * 2
    lm.manager.check()
