"""The decode floor ``benchmarks/batch.py`` prints: one pure decode step through the engine against a
batched ``DynamicCache`` decode step of the same shape (see ``run_decode_floor``), on ``tiny_llama``,
a model whose step is mostly attention over the cache."""

from __future__ import annotations

import statistics
import time

from benchmarks.batch_systems import BLOCK_SIZE


def tiny_llama(seed: int = 0):
    """The decode floor's model: a deterministic tiny random fp32 Llama (2 layers, 4 query heads,
    2 KV heads of 16), built from a config, so attention over the cache dominates every step."""
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    config = tf.LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=8192, initializer_range=0.2)
    model = tf.LlamaForCausalLM(config).eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model


def run_decode_floor(model, sequences: int, context: int, steps: int, seed: int,
                     rounds: int = 1) -> dict:
    """One pure decode step through the engine against a batched ``DynamicCache`` decode step of
    the same shape: ``sequences`` distinct prompts of ``context`` tokens are prefilled by the
    engine; the floor is a ``DynamicCache`` holding the very K/V the engine computed (read back from
    the pool), fed the engine's first tokens. A round: ``steps`` floor steps, ``steps`` engine
    steps, ``steps`` floor steps again (each timed alone); its ratio is the engine's median step
    over the mean of the floor's two medians. ``rounds`` rounds run back to back (the engine decodes
    on, each floor restarts from the prompts' K/V); the round of the median ratio is reported, with
    every round's ratio. Tokens of the first round are compared. ``context``: whole blocks of
    ``BLOCK_SIZE``."""
    import random

    import radixcache
    from benchmarks.measure import random_ids

    if context % BLOCK_SIZE:
        raise ValueError(f"context must be whole blocks of {BLOCK_SIZE} (the floor reads them back "
                         f"from the tree), got {context}")
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    prompts = [random_ids(rng, context, vocab) for _ in range(sequences)]
    capacity = sequences * (context + steps + 4 * BLOCK_SIZE)
    lm = radixcache.wrap(model, block_size=BLOCK_SIZE, max_cache_tokens=capacity)
    engine = lm.new_engine(max_running=sequences)
    try:
        return _decode_floor(model, lm, engine, prompts, steps, rounds)
    finally:
        for i in range(sequences):
            engine.abort(i)


def _decode_floor(model, lm, engine, prompts: list, steps: int, rounds: int) -> dict:
    """``run_decode_floor``'s measurement on a fresh wrapper and engine (see there)."""
    import torch
    from transformers import DynamicCache

    from radixcache.engine.request import Request, SamplingParams

    sequences, context = len(prompts), len(prompts[0])
    for i, prompt in enumerate(prompts):  # the prompts into the cache, then all decode in lockstep
        engine.add(Request(("prefill", i), prompt, SamplingParams(), prefill_only=True))
    while engine.has_work:
        engine.step()
    params = SamplingParams(max_new_tokens=rounds * steps + 2)
    for i, prompt in enumerate(prompts):
        engine.add(Request(i, prompt, params))
    tokens: dict = {i: [] for i in range(sequences)}
    while any(not t for t in tokens.values()):  # each prompt's last token, over its cached blocks
        for event in engine.step():
            tokens[event.request_id].append(event.token)
    first = [tokens[i][0] for i in range(sequences)]
    pool = lm.pool
    layers = []
    for layer in range(pool.num_layers):
        per_row = [pool.read(layer, pool.rows_for(lm.cache.match(p, lm.namespace()).blocks, 0, context))
                   for p in prompts]
        layers.append(tuple(torch.stack([kv[j] for kv in per_row]).transpose(1, 2).contiguous()
                            for j in range(2)))

    def floor() -> tuple[list, list]:
        cache = DynamicCache(layers, config=model.config)
        token = torch.tensor(first)[:, None]
        times, out = [], []
        with torch.no_grad():
            for _ in range(steps):
                t0 = time.perf_counter()
                logits = model(input_ids=token, cache=cache, use_cache=True).logits
                token = logits[:, -1].argmax(dim=-1, keepdim=True)
                times.append(time.perf_counter() - t0)
                out.append(token[:, 0].tolist())
        return times, [list(r) for r in zip(*out)]

    results, floor_tokens = [], None
    marks = {i: len(t) for i, t in tokens.items()}
    for _ in range(rounds):
        before, out = floor()
        floor_tokens = floor_tokens or out
        engine_times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            events = engine.step()
            engine_times.append(time.perf_counter() - t0)
            if len(events) != sequences:
                raise RuntimeError(f"a decode step produced {len(events)} events for {sequences} "
                                   "sequences")
            for event in events:
                tokens[event.request_id].append(event.token)
        after, _ = floor()
        floor_ms = (statistics.median(before) + statistics.median(after)) / 2 * 1e3
        engine_ms = statistics.median(engine_times) * 1e3
        results.append(dict(engine_step_ms=engine_ms, floor_step_ms=floor_ms,
                            floor_before_ms=statistics.median(before) * 1e3,
                            floor_after_ms=statistics.median(after) * 1e3, ratio=engine_ms / floor_ms))
    while engine.has_work:
        engine.step()
    engine_tokens = [tokens[i][marks[i]:marks[i] + steps] for i in range(sequences)]
    ratios = sorted(r["ratio"] for r in results)
    middle = next(r for r in results if r["ratio"] == ratios[(len(ratios) - 1) // 2])
    return dict(middle, sequences=sequences, context=context, steps=steps, rounds=rounds,
                round_ratios=[r["ratio"] for r in results], same_tokens=engine_tokens == floor_tokens,
                fallbacks=lm.stats()["fallbacks"])
