"""Tiny random causal LMs built from configs (no downloads), one per supported family."""

import torch
import transformers as tf

VOCAB = 256
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, max_position_embeddings=1024, initializer_range=0.2)

MLA = dict(num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
           v_head_dim=12, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
           n_group=1, topk_group=1, first_k_dense_replace=1)

FAMILIES = {
    "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(num_key_value_heads=2, **COMMON)),
    "mistral": lambda: tf.MistralForCausalLM(tf.MistralConfig(num_key_value_heads=2, sliding_window=24, **COMMON)),
    "qwen2": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(num_key_value_heads=2, **COMMON)),
    "qwen3": lambda: tf.Qwen3ForCausalLM(tf.Qwen3Config(num_key_value_heads=2, head_dim=16, **COMMON)),
    "gemma": lambda: tf.GemmaForCausalLM(tf.GemmaConfig(num_key_value_heads=1, head_dim=16, **COMMON)),
    "gemma2": lambda: tf.Gemma2ForCausalLM(tf.Gemma2Config(num_key_value_heads=2, head_dim=16, sliding_window=24, **COMMON)),
    "phi3": lambda: tf.Phi3ForCausalLM(tf.Phi3Config(num_key_value_heads=4, pad_token_id=0, bos_token_id=1, eos_token_id=2, **COMMON)),
    # MLA: K is qk_nope + qk_rope (24) wide and V v_head_dim (12) per head, expanded from a latent
    "deepseek_v2": lambda: tf.DeepseekV2ForCausalLM(tf.DeepseekV2Config(**MLA, q_lora_rank=None, **COMMON)),
    "deepseek_v3": lambda: tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(**MLA, q_lora_rank=24, **COMMON)),
    # GQA (new decoder architecture), rotary, no ALiBi; computes attention itself (dense caches)
    "falcon": lambda: tf.FalconForCausalLM(tf.FalconConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2,
        new_decoder_architecture=True, alibi=False, max_position_embeddings=1024,
        initializer_range=0.2, bos_token_id=1, eos_token_id=2)),
    "gpt2": lambda: tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4,
                                                     n_positions=1024, initializer_range=0.2,
                                                     bos_token_id=1, eos_token_id=2)),
}


def tiny_model(family: str, seed: int = 0):
    """A deterministic tiny fp32 model of ``family`` in eval mode."""
    torch.manual_seed(seed)
    model = FAMILIES[family]().eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model


def random_ids(n: int, seed: int, batch: int = 1) -> torch.Tensor:
    """``[batch, n]`` random token ids avoiding 0 (the pad id)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (batch, n), generator=g)


def plain_greedy(model, prompt, max_new: int) -> list:
    """The ``max_new`` greedy tokens plain ``model.generate`` appends to ``prompt`` (a token list)."""
    ids = torch.tensor([list(prompt)])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                         do_sample=False)
    return out[0, len(prompt):].tolist()
