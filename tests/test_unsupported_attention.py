"""Problem 8 of issue 8: attention the backends do not compute (sinks, a bias, dropout while
training) is detected, at wrap time by the self-test of each entry point's own path and at run
time, and served by plain transformers instead: never a wrong token."""

import logging

import pytest
import torch
import transformers as tf
from transformers import MaxLengthCriteria, StoppingCriteriaList

import radixcache
from tiny_models import VOCAB, random_ids, tiny_model

BS = 4


def gpt_oss():
    """A tiny GPT-OSS: its attention has learned sinks (``s_aux``)."""
    torch.manual_seed(0)
    config = tf.GptOssConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                             sliding_window=24, max_position_embeddings=4096, initializer_range=0.2,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    model = tf.GptOssForCausalLM(config).eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model


def plain(model, ids, **kw):
    return model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, **kw)


def test_attention_sinks_fall_back_for_generate_and_generate_batch(caplog):
    """s_aux is detected by the self-test of both paths; both entry points answer as plain."""
    model = gpt_oss()
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=512)
    assert "s_aux" in lm.unsupported and "s_aux" in lm.engine_unsupported
    assert lm.pool is None and lm.stats()["kv_pool_bytes"] == 0  # no path passed: no pool
    with pytest.raises(ValueError, match="s_aux"):
        lm.new_engine()
    ids = random_ids(14, 1)
    want = plain(model, ids, max_new_tokens=5)
    with caplog.at_level(logging.WARNING, logger="radixcache"):
        assert torch.equal(lm.generate(ids, max_new_tokens=5, do_sample=False), want)
    assert lm.generate_batch([ids[0].tolist()], max_new_tokens=5)[0][0] == want[0, 14:].tolist()
    with lm.generate_batch([ids[0].tolist()], max_new_tokens=5, stream=True) as stream:  # as BatchRun
        assert [t.token for t in stream] == want[0, 14:].tolist()
    stats = lm.stats()
    assert stats["fallbacks"] == 3 and stats["cached_tokens"] == 0
    assert any("s_aux" in r.message for r in caplog.records)


def test_dropout_while_training_is_detected_at_run_time():
    """A model switched to training mode after wrap() passes attention dropout: that call falls
    back (nothing cached from it, nothing leaked) and says why; back in eval mode, the cache
    serves again."""
    model = tiny_model("llama")
    model.config.attention_dropout = 0.5
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.5
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=512)
    assert lm.unsupported is None  # eval mode: no dropout
    ids = random_ids(10, 2)
    model.train()
    try:
        lm.generate(ids, max_new_tokens=2, do_sample=False)
        assert len(lm.generate_batch([ids[0].tolist()], max_new_tokens=2)[0][0]) == 2
        one_more = StoppingCriteriaList([MaxLengthCriteria(ids.shape[1] + 1)])  # the fallback keeps it
        out = lm.generate(ids, max_new_tokens=4, do_sample=False, stopping_criteria=one_more)
        assert out.shape[1] == ids.shape[1] + 1
    finally:
        model.eval()
    stats = lm.stats()
    assert stats["fallbacks"] == 3 and any("dropout" in r for r in stats["fallback_reasons"])
    assert stats["cached_tokens"] == 0 and lm.cache.leaks() == []
    assert torch.equal(lm.generate(ids, max_new_tokens=2, do_sample=False),
                       plain(model, ids, max_new_tokens=2))
    assert lm.stats()["fallbacks"] == 3


def test_a_model_building_its_own_mask_is_refused(monkeypatch):
    """An attention mask the model built itself (e.g. an additive bias) is not read by the
    backends: such a forward is refused, not silently computed without it."""
    from radixcache.integrations.hf.attention import unsupported_arguments

    assert unsupported_arguments(None, torch.zeros(1, 1, 2, 2), {}) is not None
    assert unsupported_arguments(None, None, {"position_bias": torch.zeros(1)}) is not None
    assert unsupported_arguments(None, None, {"alibi": torch.zeros(1)}) is not None
    assert unsupported_arguments(None, None, {"dropout": 0.0, "scaling": 0.1,
                                              "sliding_window": 4, "softcap": None}) is None


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_supported_models_pass_both_self_tests(family):
    """The self-test runs generate's and the engine's own paths and passes for plain attention."""
    lm = radixcache.wrap(tiny_model(family), block_size=BS, max_cache_tokens=512)
    assert lm.unsupported is None and lm.engine_unsupported is None
    assert lm.stats()["requests"] == 0 and lm.stats()["cached_tokens"] == 0
