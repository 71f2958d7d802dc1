"""The systems ``benchmarks/batch.py`` compares, each timed the same way (see batch.py's docstring).

- ``run_radixcache``: ``lm.generate_batch(..., stream=True)`` on a cleared tree and a fresh engine
  (its metrics give steps, forward time and peak blocks; the stream gives TTFT per prompt);
- ``run_cb``: transformers' ``generate_batch`` with prefix sharing;
- ``run_plain``: ``model.generate`` one request at a time;
- ``run_floor``: the prefix once into a ``DynamicCache``, one ``[N, U]`` forward of the suffixes
  over it (the cache repeated per row), then batched greedy decode; the same tokens computed as
  radixcache's greedy run with the system prompt shared;
- ``run_schedulers``: "lpm" vs "fcfs" admission on shuffled requests over a small pool.
"""

from __future__ import annotations

import logging
import math
import re
import time

from benchmarks.measure import shared_prefix_prompts, timed_stream

BLOCK_SIZE = 16
CB_MAX_BATCH_TOKENS = 2048  # CB's per-step token budget: radixcache Engine's max_step_tokens default
CB_MAX_REQUESTS = 4  # CB's fastest CPU setting found (its step cost grows with requests^2)


def sampling_args(cfg: dict, sampled: bool) -> dict:
    """generate_batch settings of the greedy or the sampled mode."""
    if not sampled:
        return dict(do_sample=False, n=1)
    return dict(do_sample=True, temperature=cfg["temperature"], top_p=1.0, top_k=0, n=cfg["samples"])


def run_radixcache(lm, prompts, cfg: dict, sampled: bool, seed: int, new_tokens=None) -> dict:
    """One timed ``generate_batch`` (streamed) on a cleared tree and a fresh engine."""
    lm.clear()
    lm.reset_stats()
    engine = lm.new_engine()
    stream = lm.generate_batch(prompts, max_new_tokens=new_tokens or cfg["new_tokens"], seed=seed,
                               eos_token_id=None, stream=True, engine=engine,
                               **sampling_args(cfg, sampled))
    outputs, first, wall = timed_stream(stream)
    m, stats = engine.metrics, lm.stats()
    return dict(outputs=outputs, wall_s=wall, generated=sum(len(s) for p in outputs for s in p),
                ttft=list(first.values()), peak_blocks=m.peak_used_blocks,
                hit_rate=stats["hit_rate"], preemptions=stats["preemptions"], steps=m.steps,
                computed_tokens=m.step_tokens, step_s=m.step_s, forward_s=m.forward_s)


class _PrefixMatchCounter(logging.Filter):
    """A filter on CB's logger: sums its "Found a prefix match of N tokens" debug lines and lets
    only errors through."""

    PATTERN = re.compile(r"Found a prefix match of (\d+) tokens")

    def __init__(self):
        super().__init__()
        self.hit_tokens = 0

    def filter(self, record):
        if record.levelno < logging.INFO:
            m = self.PATTERN.search(record.getMessage())
            if m:
                self.hit_tokens += int(m.group(1))
        return record.levelno >= logging.ERROR


def run_cb(model, prompts, cfg: dict, sampled: bool, seed: int, capacity: int) -> dict:
    """One timed transformers ``generate_batch`` with prefix sharing and 16-token pages."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    n = cfg["samples"] if sampled else 1
    extra = dict(temperature=cfg["temperature"], top_p=1.0, top_k=0) if sampled else {}
    gen = GenerationConfig(max_new_tokens=cfg["new_tokens"], do_sample=sampled, num_return_sequences=n,
                           eos_token_id=None, **extra)
    cb = ContinuousBatchingConfig(page_size=BLOCK_SIZE, num_blocks=capacity // BLOCK_SIZE,
                                  max_batch_tokens=CB_MAX_BATCH_TOKENS,
                                  max_requests_per_batch=CB_MAX_REQUESTS, allow_block_sharing=True,
                                  seed=seed)
    cb_logger = logging.getLogger("ContinuousBatchingLogger")
    counter = _PrefixMatchCounter()
    saved_level = cb_logger.level
    cb_logger.addFilter(counter)
    cb_logger.setLevel(logging.DEBUG)
    try:
        start = time.perf_counter()
        results = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb,
                                       record_timestamps=True, progress_bar=False)
        wall = time.perf_counter() - start
    finally:
        cb_logger.removeFilter(counter)
        cb_logger.setLevel(saved_level)
    groups: dict[str, list] = {}
    for rid, res in results.items():
        groups.setdefault(rid.split("__child#")[0], []).append(res)
    outputs, ttft = [], []
    for rid, samples in groups.items():  # insertion order = prompt order
        parent = next((r for r in samples if r.request_id == rid), samples[-1])
        stamps = [r.timestamps[0] for r in samples if r.timestamps]
        if stamps:
            ttft.append(min(stamps) - parent.created_time)
        ordered = [parent] + [r for r in samples if r is not parent]  # sample 0 first
        outputs.append([list(r.generated_tokens) for r in ordered])
    failed = len(prompts) * n - sum(1 for r in results.values() if r.error is None)
    return dict(outputs=outputs, wall_s=wall, generated=sum(len(s) for p in outputs for s in p),
                ttft=ttft, peak_blocks=None, hit_rate=counter.hit_tokens / sum(map(len, prompts)),
                failed=failed)


def run_plain(model, prompts, cfg: dict, sampled: bool, seed: int, subset: int) -> dict:
    """Plain ``model.generate`` one request at a time on the first ``subset`` prompts."""
    import torch

    from benchmarks.measure import TokenTimes

    n = cfg["samples"] if sampled else 1
    extra = dict(do_sample=True, temperature=cfg["temperature"], top_p=1.0, top_k=0,
                 num_return_sequences=n) if sampled else dict(do_sample=False)
    outputs, walls, ttft = [], [], []
    for i, prompt in enumerate(prompts[:subset]):
        ids = torch.tensor([prompt], device=model.device)
        torch.manual_seed(seed + i)
        timer = TokenTimes()
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), eos_token_id=None,
                                 max_new_tokens=cfg["new_tokens"], streamer=timer, **extra)
        walls.append(time.perf_counter() - start)
        ttft.append(timer.times[0] - start if timer.times else None)
        outputs.append(out[:, len(prompt):].tolist())
    generated = sum(len(s) for p in outputs for s in p)
    total = sum(walls)
    return dict(outputs=outputs, wall_s=total, generated=generated,
                ttft=[t for t in ttft if t is not None], subset=len(outputs),
                tok_s=generated / total if total else None)


def run_floor(model, system: list, suffixes: list, new_tokens: int) -> dict:
    """The prefix once, one ``[N, U]`` forward of the suffixes over it, batched greedy decode."""
    import torch
    from transformers import DynamicCache

    n = len(suffixes)
    cache = DynamicCache(config=model.config)
    steps = []
    with torch.no_grad():
        start = time.perf_counter()
        model(input_ids=torch.tensor([system]), cache=cache, use_cache=True, logits_to_keep=1)
        cache.batch_repeat_interleave(n)
        out = model(input_ids=torch.tensor(suffixes), cache=cache, use_cache=True, logits_to_keep=1)
        token = out.logits[:, -1].argmax(dim=-1, keepdim=True)
        generated = [token]
        first = time.perf_counter() - start
        for _ in range(new_tokens - 1):
            t0 = time.perf_counter()
            out = model(input_ids=token, cache=cache, use_cache=True)
            token = out.logits[:, -1].argmax(dim=-1, keepdim=True)
            generated.append(token)
            steps.append(time.perf_counter() - t0)
        tokens = torch.cat(generated, dim=1).tolist()
        wall = time.perf_counter() - start
    return dict(outputs=[[t] for t in tokens], wall_s=wall, ttft_s=first, decode_step_s=steps,
                generated=n * new_tokens)


def run_schedulers(lm, cfg: dict, seed: int, log) -> list[dict]:
    """Hit rate of "lpm" vs "fcfs" on shuffled requests over several system prompts, small pool."""
    import radixcache

    prompts, _ = shared_prefix_prompts(cfg["sched_systems"], cfg["sched_per_system"],
                                       cfg["sched_system_tokens"], cfg["sched_unique_tokens"],
                                       lm.vocab_size, seed + 1, shuffle=True)
    cap = math.ceil(cfg["sched_cache_prompts"] * cfg["sched_system_tokens"] / BLOCK_SIZE) * BLOCK_SIZE
    small = radixcache.wrap(lm.model, block_size=BLOCK_SIZE, max_cache_tokens=cap)
    rows = []
    for schedule in ("lpm", "fcfs"):
        log(f"scheduler {schedule} ...")
        small.clear()
        small.reset_stats()
        engine = small.new_engine(schedule=schedule)
        start = time.perf_counter()
        out = small.generate_batch(prompts, max_new_tokens=cfg["sched_new_tokens"], eos_token_id=None,
                                   engine=engine)
        wall = time.perf_counter() - start
        st = small.stats()
        rows.append(dict(schedule=schedule, hit_rate=st["hit_rate"], computed_tokens=engine.metrics.step_tokens,
                         preemptions=st["preemptions"], steps=engine.metrics.steps, wall_s=wall,
                         generated=sum(len(s) for p in out for s in p), cache_tokens=cap,
                         requests=len(prompts)))
    return rows
