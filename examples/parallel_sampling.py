"""Parallel sampling: several answers to the same prompt share its K/V, and several prompts share a preamble.

``generate_batch(prompts, n=4, do_sample=True)`` prefills each prompt once, then forks it into four
samples that share its whole blocks (the partial last block is copied); a fixed system prompt is
computed once for every question. ``seed`` makes the samples reproducible wherever a prompt sits in
the batch. ``stats()`` reports the hit rate at the end.

Run (uses the embedded SmolLM2-135M-Instruct, CPU is fine):  python examples/parallel_sampling.py
"""

import radixcache
from radixcache.models import load_model

SYSTEM = ("You are a copywriter. Answer with one catchy slogan of at most eight words, nothing else. "
          "The client is a small family bakery in Porto that bakes sourdough bread, pastel de nata "
          "and seasonal fruit tarts every morning, and opens at seven.")
BRIEFS = ["A slogan for the shop window.", "A slogan for a delivery van.", "A slogan for a tote bag."]


def main():
    model, tokenizer = load_model()
    lm = radixcache.wrap(model)  # 1. wrap once

    prompts = [tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM},
                                              {"role": "user", "content": brief}],
                                             add_generation_prompt=True, tokenize=True, return_dict=False)
               for brief in BRIEFS]
    # 2. four samples per prompt, in one continuous batch
    results = lm.generate_batch(prompts, n=4, do_sample=True, temperature=0.8, top_p=0.95,
                                max_new_tokens=20, seed=0)
    for brief, samples, cached in zip(BRIEFS, results, results.cached_tokens):
        print(f"{brief}  ({cached} prompt tokens from the cache)")
        for ids in samples:
            print("  -", " ".join(tokenizer.decode(ids, skip_special_tokens=True).split()))

    stats = lm.stats()  # 3. stats
    print(f"hit rate: {stats['hit_rate']:.1%} ({stats['hit_tokens']:,} of "
          f"{stats['queried_tokens']:,} prompt tokens reused)")


if __name__ == "__main__":
    main()
