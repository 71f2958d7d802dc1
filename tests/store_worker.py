"""One process of the two-process store test: a tiny Llama (same seed, same weights, same identity
in every process) wrapped with a Redis store, one greedy ``generate``; prints JSON on stdout.

    python store_worker.py URL PROMPT_LEN NEW_TOKENS
"""

import json
import sys

import torch
import transformers as tf

import radixcache

VOCAB = 256


def tiny_long_llama():
    """The suite's tiny Llama with room for 2k positions."""
    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=2048, initializer_range=0.2)
    model = tf.LlamaForCausalLM(config).eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model


def prompt(n: int) -> list:
    g = torch.Generator().manual_seed(1234)
    return torch.randint(1, VOCAB, (n,), generator=g).tolist()


def main() -> None:
    url, n, new = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    model = tiny_long_llama()
    ids = torch.tensor([prompt(n)])
    with radixcache.wrap(model, block_size=16, max_cache_tokens=4096, store=url) as lm:
        out = lm.generate(ids, max_new_tokens=new, do_sample=False, return_dict_in_generate=True)
        with torch.no_grad():
            plain = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                   do_sample=False)
    stats = lm.stats()  # after close: the store's final counters
    print(json.dumps({"tokens": out.sequences[0, n:].tolist(), "plain": plain[0, n:].tolist(),
                      "cached_tokens": out.cached_tokens[0], "model_id": lm.model_id,
                      **{k: v for k, v in stats.items() if k.startswith("store_")}}))


if __name__ == "__main__":
    main()
