"""What ``wrap`` decides before any pool exists (issue 17, items 3, 4 and 6): a model the paged
path cannot serve (non-attention layers, an ALiBi bias) is named at wrap time, gets no KV pool,
and every entry point falls back to plain transformers (the engine and the server refuse); a
servable model's fresh wrapper counts nothing, its self-test leaves no trace."""

import logging
import os
import subprocess
import sys

import pytest
import torch
import transformers as tf

import radixcache
from radixcache.integrations.hf.resources import unsupported_reason
from serve_helpers import embedded_tokenizer, write_model_dir
from tiny_models import VOCAB, plain_greedy, random_ids, tiny_model

LAYERS = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2)
HEADS = dict(LAYERS, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)

NON_ATTENTION = {  # tiny configs of the non-attention and hybrid families transformers ships
    "Mamba": lambda: tf.MambaForCausalLM(tf.MambaConfig(state_size=8, **LAYERS)),
    "Mamba2": lambda: tf.Mamba2ForCausalLM(tf.Mamba2Config(state_size=8, num_heads=8, head_dim=16,
                                                           n_groups=1, **LAYERS)),
    "FalconMamba": lambda: tf.FalconMambaForCausalLM(tf.FalconMambaConfig(state_size=8, **LAYERS)),
    "Rwkv": lambda: tf.RwkvForCausalLM(tf.RwkvConfig(attention_hidden_size=64, intermediate_size=128,
                                                     context_length=128, **LAYERS)),
    "RecurrentGemma": lambda: tf.RecurrentGemmaForCausalLM(tf.RecurrentGemmaConfig(
        lru_width=64, attention_window_size=16, **dict(HEADS, num_hidden_layers=3, num_key_value_heads=1))),
    "Jamba": lambda: tf.JambaForCausalLM(tf.JambaConfig(
        attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
        num_experts=2, mamba_d_state=8, mamba_expand=2, **HEADS)),
    "Bamba": lambda: tf.BambaForCausalLM(tf.BambaConfig(
        mamba_n_heads=4, mamba_d_head=32, mamba_d_state=8, mamba_n_groups=1, attn_layer_indices=[1],
        **HEADS)),
    "Zamba2": lambda: tf.Zamba2ForCausalLM(tf.Zamba2Config(
        mamba_d_state=8, mamba_headdim=16, n_mamba_heads=8, layers_block_type=["mamba", "hybrid"],
        **HEADS)),
    "FalconH1": lambda: tf.FalconH1ForCausalLM(tf.FalconH1Config(
        mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1, **HEADS)),
    "Lfm2": lambda: tf.Lfm2ForCausalLM(tf.Lfm2Config(layer_types=["conv", "full_attention"], **HEADS)),
}

ALIBI = {
    "Bloom": lambda: tf.BloomForCausalLM(tf.BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=2,
                                                        n_head=4)),
    "Mpt": lambda: tf.MptForCausalLM(tf.MptConfig(vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4)),
    "Falcon": lambda: tf.FalconForCausalLM(tf.FalconConfig(vocab_size=VOCAB, hidden_size=64,
                                                           num_hidden_layers=2, num_attention_heads=4,
                                                           alibi=True)),
}


def build(factory):
    torch.manual_seed(0)
    model = factory().eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model


def assert_served_plainly(model, lm, reason: str, caplog):
    """Every entry point answers as plain transformers, says ``reason`` once, holds no pool."""
    assert lm.pool is None and lm.unsupported == lm.engine_unsupported == reason
    stats = lm.stats()
    assert stats["kv_pool_bytes"] == 0 and stats["capacity_tokens"] == 0 and stats["requests"] == 0
    ids = random_ids(12, 1)
    want = plain_greedy(model, ids[0].tolist(), 3)
    with caplog.at_level(logging.WARNING, logger="radixcache"):
        for _ in range(2):  # cold and "warm": nothing is ever cached
            assert lm.generate(ids, max_new_tokens=3, do_sample=False)[0, 12:].tolist() == want
    assert sum(reason in r.message for r in caplog.records) == 1
    assert lm.generate_batch([ids[0].tolist()], max_new_tokens=3)[0][0] == want
    with pytest.raises(ValueError, match="cannot run on radixcache's engine"):
        lm.new_engine()
    stats = lm.stats()
    assert stats["fallbacks"] == 3 and stats["fallback_reasons"] == {reason: 3}
    assert stats["cached_tokens"] == 0 and stats["capacity_tokens"] == 0
    assert reason in repr(lm)


@pytest.mark.parametrize("family", sorted(NON_ATTENTION))
def test_non_attention_models_wrap_and_fall_back(family, caplog):
    """Mamba and every other family whose layers keep no K/V (or not only K/V): ``wrap`` succeeds
    (no AttributeError from the missing attention heads), names the model, allocates no pool."""
    model = build(NON_ATTENTION[family])
    lm = radixcache.wrap(model)  # the default pool size: none is allocated
    assert lm.unsupported.startswith(f"non-attention layers ({family}")
    assert_served_plainly(model, lm, lm.unsupported, caplog)


@pytest.mark.parametrize("family", sorted(ALIBI))
def test_alibi_models_say_alibi_and_get_no_pool(family, caplog):
    """Bloom, MPT and Falcon with ``alibi``: the reason is the ALiBi bias, not a shape error of the
    self-test, and the default pool (a share of RAM) is never allocated."""
    model = build(ALIBI[family])
    lm = radixcache.wrap(model)
    assert_served_plainly(model, lm, f"ALiBi position bias ({family})", caplog)


@pytest.mark.parametrize("model", [
    lambda: tf.FalconForCausalLM(tf.FalconConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                                 num_attention_heads=4, new_decoder_architecture=True,
                                                 num_kv_heads=2)),
    lambda: tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
        num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16,
        q_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)),
], ids=["falcon-gqa", "deepseek-v3-mla"])
def test_falcon_without_alibi_and_mla_are_not_refused_at_wrap_time(model):
    """Servable attention (decided by the self-test, not refused by the config check)."""
    assert unsupported_reason(model()) is None


def test_a_store_is_not_used_for_a_model_without_pool(caplog):
    """A model ruled out at wrap time opens no store (it has nothing to put there) and says so."""
    with caplog.at_level(logging.WARNING, logger="radixcache"):  # port 9: nothing listens there
        lm = radixcache.wrap(build(ALIBI["Bloom"]), store="redis://127.0.0.1:9/0")
    assert lm.manager.store is None
    assert any("store is not used" in r.message for r in caplog.records)


@pytest.mark.parametrize("max_cache_tokens", [None, 48])
def test_a_fresh_wrapper_counts_nothing(max_cache_tokens):
    """The wrap-time self-test runs on a probe pool of its own: the wrapper's ledger and tree
    start at zero (no evicted_tokens from the probe), even when the pool is too small to probe."""
    lm = radixcache.wrap(tiny_model("llama"), block_size=16, max_cache_tokens=max_cache_tokens)
    assert lm.unsupported is None and lm.engine_unsupported is None
    stats = lm.stats()
    counters = ("requests", "queried_tokens", "hit_tokens", "computed_prompt_tokens",
                "generated_tokens", "preemptions", "fallbacks", "cached_tokens", "pinned_tokens",
                "evictable_tokens", "evicted_tokens", "running", "fp8_clamped_writes")
    assert {k: stats[k] for k in counters} == dict.fromkeys(counters, 0)
    assert stats["fallback_reasons"] == {} and stats["hit_rate"] == 0
    assert stats["free_tokens"] == stats["capacity_tokens"] > 0
    assert lm.cache.stats.queried_tokens == lm.cache.stats.inserted_tokens == 0
    assert lm.manager.allocator.num_free == lm.manager.allocator.num_blocks


def test_radixcache_serve_refuses_an_alibi_model_with_the_reason(tmp_path):
    """The server never starts on a model the engine cannot serve; it says why, without a traceback."""
    path = write_model_dir(tmp_path / "tiny-bloom")
    torch.manual_seed(0)
    config = tf.BloomConfig(vocab_size=len(embedded_tokenizer()), hidden_size=64, n_layer=2, n_head=4,
                            max_position_embeddings=512)  # the server reads its context length
    tf.BloomForCausalLM(config).eval().save_pretrained(path)
    result = subprocess.run([sys.executable, "-m", "radixcache.app.cli", "serve", "--model", str(path),
                             "--port", "9"], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 1, result.stderr
    assert "ALiBi position bias (Bloom)" in result.stderr and "Traceback" not in result.stderr


def test_layers_caching_different_shapes_are_named_and_fall_back(caplog):
    """Gemma 4 caches K/V of one head dim in its sliding layers and another in its global ones:
    one pool cannot hold both, so ``wrap`` names the shapes (found by running the model's own
    forward, not guessed from the config) and every entry point answers as plain transformers."""
    model = build(lambda: tf.Gemma4ForCausalLM(tf.Gemma4TextConfig(
        head_dim=16, global_head_dim=32, layer_types=["sliding_attention", "full_attention"],
        sliding_window=16, **HEADS)))
    lm = radixcache.wrap(model)
    assert lm.unsupported == ("the paged KV path cannot serve this model: the layers of "
                              "Gemma4ForCausalLM cache K/V of different shapes (heads, head_dim, "
                              "head_dim_v) [(2, 16, 16), (2, 32, 32)]: one pool cannot hold them")
    assert_served_plainly(model, lm, lm.unsupported, caplog)
