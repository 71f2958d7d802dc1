#!/usr/bin/env python
"""Batch generation with a shared system prompt: radixcache vs transformers' continuous batching vs
plain ``model.generate``, plus the hit rate of the "lpm" scheduler against "fcfs".

Workload (seeded random token ids, EOS disabled so every sample has exactly the asked length):
N requests = one S-token system prompt + U unique tokens each (full: N=32, S=1,000, U=100); G new
tokens per sample (full: 32), first greedy (n=1), then sampled with n=4 (temperature 0.8, top-p 1,
fixed seed). Model: the embedded SmolLM2-135M-Instruct, fp32, CPU. Systems, side by side:

* radixcache: ``radixcache.wrap(model, block_size=16, max_cache_tokens=C).generate_batch(prompts,
  max_new_tokens=G, do_sample=..., temperature=0.8, n=..., seed=...)``; the tree is cleared before
  every timed run. TTFT from ``RunStats.ttft_s``, peak KV blocks from ``RunStats.peak_blocks``,
  hit rate from ``RunStats.hit_rate``.
* transformers CB: ``model.generate_batch(prompts, generation_config=GenerationConfig(
  max_new_tokens=G, do_sample=..., num_return_sequences=n, eos_token_id=None[, temperature=0.8,
  top_p=1.0, top_k=0]), continuous_batching_config=ContinuousBatchingConfig(page_size=16,
  num_blocks=C // 16, max_batch_tokens=2048, max_requests_per_batch=4, allow_block_sharing=True,
  seed=...), record_timestamps=True, progress_bar=False)``. Prefix sharing is on when
  ``allow_block_sharing`` is and every layer is full attention. max_batch_tokens matches
  radixcache's step budget; max_requests_per_batch=4 is the fastest CPU setting found (see
  ``CB_MAX_REQUESTS``): on CPU, CB runs SDPA over the whole step's packed K/V with a block-diagonal
  mask, so its step cost grows with the square of the requests per step. TTFT per prompt = its
  earliest first-token timestamp minus the parent request's ``created_time``. Hit rate =
  prefix-matched tokens (its debug log "Found a prefix match of N tokens") / prompt tokens. It
  reports no block usage ("-"). CB is slow enough on CPU that the full n=4 run gives it the first
  ``cb_sampled`` prompts only: with at most 4 requests per step its rate barely depends on how many
  are queued, so throughput is reported as measured and the wall time extrapolated (TTFT over
  the subset is then optimistic: fewer requests queue).
* plain: ``model.generate(ids, attention_mask=ones, max_new_tokens=G, ...)`` one request at a time
  (``num_return_sequences=n`` for n > 1), on the first ``plain_*`` requests only when that is fewer
  than N: its throughput (generated tokens / summed wall time) is then extrapolated to the whole
  batch, since serial requests run at the same rate. TTFT: a streamer stamps the first generated
  token inside the same call (time from the call's start: the request alone, no queue); the queued
  TTFT of a serial server (request j waits for the j before it) is estimated on the footnote line.

The three systems see the same prompts, capacity C (tokens: S + N*n*(U+G+16)) and weights (the
baselines run on a deep copy, because radixcache switches its model's attention implementation).
radixcache and CB alternate within each repetition; reported numbers are medians over repetitions
(full: radixcache 3, CB 1, plain 1; the run is sized for ~10 minutes on 2 quiet cores).

Ideal peak KV (blocks of bs=16 tokens, a sample's last token never fed back so never stored):
  greedy: floor(S/bs) + N * (ceil((S+U+G-1)/bs) - floor(S/bs))
  n > 1:  floor(S/bs) + N * (floor((S+U)/bs) - floor(S/bs)) + N*n * (ceil((S+U+G-1)/bs) - floor((S+U)/bs))
i.e. the system prompt's whole blocks once, each prompt's own whole blocks once, and per sample its
tail (the partly filled prompt block, copied per sample, plus its generated tokens). Target: peak
within 10% of that (``PEAK_SLACK``), and radixcache throughput >= CB throughput.

Scheduler check: K system prompts x R requests each (full: 4 x 8, S=1,000, U=100, 8 new tokens),
shuffled arrival, ``max_cache_tokens`` = 2.5 system prompts (not all of them fit at once); one
wrapper per policy, ``radixcache.engine.Engine(lm, schedule="lpm"|"fcfs").generate(...)``.
RunStats.hit_rate counts a preempted-and-readmitted sequence's tokens again.

Nothing asserts on timings; the met?/missed column compares against the targets only.

    python benchmarks/batch.py [--quick] [--json PATH] [--threads N] [--seed N]
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import math
import os
import platform
import random
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.report import fmt, median, model_label, table  # noqa: E402

HEADER = "radixcache batch benchmark"
BLOCK_SIZE = 16
PEAK_SLACK = 1.10  # "close to the ideal": at most 10% above it
CB_MAX_BATCH_TOKENS = 2048  # CB's per-step token budget: radixcache Engine's max_step_tokens default
# CB's requests per step. Its SDPA/eager path (CPU has no flash attention) attends every query of a
# step to the K/V of every request in the step under a block-diagonal mask, so a step costs
# ~(requests per step)^2 x context. Measured (busy 2-core CPU, 1 thread, 16 x 1,100-token prompts,
# 32 new tokens): 4 -> 55 s, 2 -> 65 s; 8 new tokens: 4 -> 32 s, 8 -> 52 s, 16 -> 50 s; the default
# (every request at once) needed > 430 s for the full greedy batch. 4 is the best CPU setting found.
CB_MAX_REQUESTS = 4
TOKEN_LOW = 100  # random prompt ids are drawn from [TOKEN_LOW, vocab): clear of special tokens

FULL = dict(requests=32, system_tokens=1000, unique_tokens=100, new_tokens=32, samples=4,
            temperature=0.8, repeats=3, cb_repeats=1, cb_greedy=32, cb_sampled=8,
            plain_greedy=8, plain_sampled=2,
            sched_systems=4, sched_per_system=8, sched_system_tokens=1000, sched_unique_tokens=100,
            sched_new_tokens=8, sched_cache_prompts=2.5)
QUICK = dict(requests=8, system_tokens=200, unique_tokens=40, new_tokens=8, samples=4,
             temperature=0.8, repeats=1, cb_repeats=1, cb_greedy=8, cb_sampled=8,
             plain_greedy=8, plain_sampled=2,
             sched_systems=4, sched_per_system=4, sched_system_tokens=200, sched_unique_tokens=40,
             sched_new_tokens=4, sched_cache_prompts=2.5)

COLUMNS = ("workload", "system", "tok/s", "wall s", "TTFT p50 s", "TTFT p95 s", "peak KV blocks",
           "ideal blocks", "hit rate", "met?")


# --------------------------------------------------------------------------- workload
def make_prompts(n_systems: int, per_system: int, system_tokens: int, unique_tokens: int,
                 vocab: int, seed: int, shuffle: bool = False) -> tuple[list[list[int]], list[int]]:
    """``n_systems * per_system`` prompts (system prompt + unique suffix) and each one's system index."""
    rng = random.Random(seed)
    low = TOKEN_LOW if vocab > 2 * TOKEN_LOW else 1
    systems = [[rng.randrange(low, vocab) for _ in range(system_tokens)] for _ in range(n_systems)]
    pairs = [(systems[k] + [rng.randrange(low, vocab) for _ in range(unique_tokens)], k)
             for k in range(n_systems) for _ in range(per_system)]
    if shuffle:
        rng.shuffle(pairs)
    return [p for p, _ in pairs], [k for _, k in pairs]


def ideal_blocks(system: int, unique: int, new: int, requests: int, samples: int,
                 bs: int = BLOCK_SIZE) -> int:
    """Blocks of one copy of the system prompt plus each request's own tokens (formula in the docstring)."""
    shared = system // bs
    kv_end = system + unique + new - 1  # the last sampled token is never fed back: no K/V
    if samples == 1:
        return shared + requests * (math.ceil(kv_end / bs) - shared)
    prompt_full = (system + unique) // bs
    return shared + requests * (prompt_full - shared) + requests * samples * (
        math.ceil(kv_end / bs) - prompt_full)


def capacity_tokens(cfg: dict, bs: int = BLOCK_SIZE) -> int:
    """KV capacity (tokens) given to radixcache and CB: everything with the system prompt stored
    once, plus one spare block per sample."""
    n = cfg["requests"] * cfg["samples"]
    tokens = cfg["system_tokens"] + n * (cfg["unique_tokens"] + cfg["new_tokens"] + bs)
    return math.ceil(tokens / bs) * bs


def percentile(values, q: float):
    """Linear-interpolated percentile (q in 0..100) or None for no values."""
    values = sorted(values)
    if not values:
        return None
    pos = (len(values) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


# --------------------------------------------------------------------------- systems
def sampling_args(cfg: dict, sampled: bool) -> dict:
    if not sampled:
        return dict(do_sample=False, n=1)
    return dict(do_sample=True, temperature=cfg["temperature"], top_p=1.0, n=cfg["samples"])


def run_radixcache(lm, prompts, cfg: dict, sampled: bool, seed: int) -> dict:
    """One timed ``generate_batch`` on a cleared tree; the outputs and the engine's RunStats."""
    args = sampling_args(cfg, sampled)
    lm.clear()
    start = time.perf_counter()
    out = lm.generate_batch(prompts, max_new_tokens=cfg["new_tokens"], seed=seed, **args)
    wall = time.perf_counter() - start
    stats = lm._engine.last_run
    generated = sum(len(s) for per_prompt in out for s in per_prompt)
    ttft = [stats.ttft_s[i] for i in range(len(prompts)) if i in stats.ttft_s]
    return dict(outputs=out, wall_s=wall, generated=generated, ttft=ttft,
                peak_blocks=stats.peak_blocks, hit_rate=stats.hit_rate, preemptions=stats.preemptions,
                steps=stats.steps, computed_tokens=stats.computed_tokens)


class _PrefixMatchCounter(logging.Filter):
    """A filter on CB's logger: counts the tokens of its "Found a prefix match of N tokens" debug
    lines and lets only errors through (its console handler is replaced inside generate_batch, so a
    logger-level filter is the one place that sees every record first)."""

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


def run_cb(model, prompts, cfg: dict, sampled: bool, seed: int) -> dict:
    """One timed transformers ``generate_batch`` with prefix sharing and 16-token pages."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    n = cfg["samples"] if sampled else 1
    extra = dict(temperature=cfg["temperature"], top_p=1.0, top_k=0) if sampled else {}
    gen = GenerationConfig(max_new_tokens=cfg["new_tokens"], do_sample=sampled, num_return_sequences=n,
                           eos_token_id=None, **extra)
    cb = ContinuousBatchingConfig(page_size=BLOCK_SIZE, num_blocks=capacity_tokens(cfg) // BLOCK_SIZE,
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
        # parent last in CB's order; put it first like the other systems' sample 0
        ordered = [parent] + [r for r in samples if r is not parent]
        outputs.append([list(r.generated_tokens) for r in ordered])
    generated = sum(len(s) for per_prompt in outputs for s in per_prompt)
    prompt_tokens = sum(len(p) for p in prompts)
    failed = len(prompts) * n - sum(1 for r in results.values() if r.error is None)
    return dict(outputs=outputs, wall_s=wall, generated=generated, ttft=ttft, peak_blocks=None,
                hit_rate=counter.hit_tokens / prompt_tokens if prompt_tokens else 0.0, failed=failed)


def run_plain(model, prompts, cfg: dict, sampled: bool, seed: int, subset: int) -> dict:
    """Plain ``model.generate`` one request at a time on the first ``subset`` prompts."""
    import torch
    from transformers.generation.streamers import BaseStreamer

    class FirstToken(BaseStreamer):
        """Stamps the first generated token (the first ``put`` is the prompt itself)."""

        def __init__(self):
            self.puts = 0
            self.at = None

        def put(self, value):
            self.puts += 1
            if self.puts == 2:
                self.at = time.perf_counter()

        def end(self):
            pass

    n = cfg["samples"] if sampled else 1
    extra = dict(do_sample=True, temperature=cfg["temperature"], top_p=1.0, top_k=0,
                 num_return_sequences=n) if sampled else dict(do_sample=False)
    outputs, walls, ttft = [], [], []
    for i, prompt in enumerate(prompts[:subset]):
        ids = torch.tensor([prompt], device=model.device)
        torch.manual_seed(seed + i)
        timer = FirstToken()
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=cfg["new_tokens"], streamer=timer, **extra)
        walls.append(time.perf_counter() - start)
        ttft.append(timer.at - start if timer.at is not None else None)
        outputs.append(out[:, len(prompt):].tolist())
    generated = sum(len(s) for per_prompt in outputs for s in per_prompt)
    total = sum(walls)
    return dict(outputs=outputs, wall_s=total, generated=generated, ttft=[t for t in ttft if t is not None],
                walls=walls, subset=len(outputs), peak_blocks=None, hit_rate=0.0,
                tok_s=generated / total if total else None)


def run_schedulers(model, cfg: dict, seed: int, log) -> list[dict]:
    """Hit rate of "lpm" vs "fcfs" on shuffled requests over several system prompts, small pool."""
    import radixcache
    from radixcache.engine import Engine

    prompts, _ = make_prompts(cfg["sched_systems"], cfg["sched_per_system"], cfg["sched_system_tokens"],
                              cfg["sched_unique_tokens"], model.config.vocab_size, seed + 1, shuffle=True)
    cap = math.ceil(cfg["sched_cache_prompts"] * cfg["sched_system_tokens"] / BLOCK_SIZE) * BLOCK_SIZE
    rows = []
    for schedule in ("lpm", "fcfs"):
        log(f"scheduler {schedule} ...")
        lm = radixcache.wrap(model, block_size=BLOCK_SIZE, max_cache_tokens=cap)
        engine = Engine(lm, schedule=schedule)
        start = time.perf_counter()
        out = engine.generate(prompts, max_new_tokens=cfg["sched_new_tokens"])
        wall = time.perf_counter() - start
        st = engine.last_run
        rows.append(dict(schedule=schedule, hit_rate=st.hit_rate, computed_tokens=st.computed_tokens,
                         preemptions=st.preemptions, steps=st.steps, wall_s=wall,
                         generated=sum(len(s) for p in out for s in p), cache_tokens=cap,
                         requests=len(prompts)))
    return rows


# --------------------------------------------------------------------------- driver
def greedy_agreement(a: list, b: list) -> tuple[int, int]:
    """(requests whose sample 0 is identical, requests compared) over the common prefix of ``a``/``b``."""
    k = min(len(a), len(b))
    return sum(1 for i in range(k) if a[i][0] == b[i][0]), k


def _summarise(runs: list[dict], extra: dict | None = None) -> dict:
    first = runs[0]
    row = dict(tok_s=median([r["generated"] / r["wall_s"] for r in runs]),
               wall_s=median([r["wall_s"] for r in runs]),
               ttft_p50=median([percentile(r["ttft"], 50) for r in runs]),
               ttft_p95=median([percentile(r["ttft"], 95) for r in runs]),
               peak_blocks=None if first["peak_blocks"] is None else max(r["peak_blocks"] for r in runs),
               hit_rate=median([r["hit_rate"] for r in runs]), generated=first["generated"],
               repeats=len(runs))
    row.update(extra or {})
    return row


def run(cfg: dict, load=None, seed: int = 0, log=lambda msg: None) -> dict:
    """Run the whole benchmark with ``load() -> (model, tokenizer)``; return the report dict."""
    import torch

    import radixcache

    if load is None:
        from radixcache.models import load_model as load
    model, _ = load()
    model.eval()
    model.generation_config.eos_token_id = None  # fixed-length samples for every system
    baseline = copy.deepcopy(model)  # radixcache switches its model's attention implementation
    vocab = model.config.vocab_size
    prompts, _ = make_prompts(1, cfg["requests"], cfg["system_tokens"], cfg["unique_tokens"], vocab, seed)
    cap = capacity_tokens(cfg)
    lm = radixcache.wrap(model, block_size=BLOCK_SIZE, max_cache_tokens=cap)

    log("warm-up ...")
    warm = dict(cfg, requests=2, new_tokens=2)
    run_radixcache(lm, [p[:BLOCK_SIZE * 2] for p in prompts[:2]], warm, False, seed)
    run_cb(baseline, [p[:BLOCK_SIZE * 2] for p in prompts[:2]], warm, False, seed)
    run_plain(baseline, prompts[:1], dict(cfg, new_tokens=2), False, seed, 1)

    modes = []
    for sampled in (False, True):
        n = cfg["samples"] if sampled else 1
        label = f"n={n} sampled" if sampled else "greedy"
        rc_runs, cb_runs = [], []
        cb_prompts = prompts[:min(cfg["cb_sampled" if sampled else "cb_greedy"], len(prompts))]
        for rep in range(max(cfg["repeats"], cfg["cb_repeats"])):
            if rep < cfg["repeats"]:
                log(f"{label}: radixcache, repetition {rep + 1}/{cfg['repeats']} ...")
                rc_runs.append(run_radixcache(lm, prompts, cfg, sampled, seed + rep))
            if rep < cfg["cb_repeats"]:
                log(f"{label}: transformers CB on {len(cb_prompts)} of {len(prompts)} requests, "
                    f"repetition {rep + 1}/{cfg['cb_repeats']} ...")
                cb_runs.append(run_cb(baseline, cb_prompts, cfg, sampled, seed + rep))
        subset = min(cfg["plain_sampled" if sampled else "plain_greedy"], len(prompts))
        log(f"{label}: plain generate on {subset} of {len(prompts)} requests ...")
        plain = run_plain(baseline, prompts, cfg, sampled, seed, subset)
        ideal = ideal_blocks(cfg["system_tokens"], cfg["unique_tokens"], cfg["new_tokens"],
                             cfg["requests"], n)
        rc = _summarise(rc_runs, dict(preemptions=max(r["preemptions"] for r in rc_runs),
                                      steps=rc_runs[0]["steps"], subset=len(prompts)))
        cb = _summarise(cb_runs, dict(failed=max(r["failed"] for r in cb_runs), subset=len(cb_prompts)))
        cb["wall_s_all"] = cb["wall_s"] * len(prompts) / len(cb_prompts)
        rc["wall_s_all"] = rc["wall_s"]
        pl = dict(tok_s=plain["tok_s"], wall_s=plain["wall_s"],
                  wall_s_all=plain["wall_s"] / plain["subset"] * len(prompts),
                  ttft_p50=percentile(plain["ttft"], 50), ttft_p95=percentile(plain["ttft"], 95),
                  peak_blocks=None, hit_rate=None, subset=plain["subset"], generated=plain["generated"],
                  repeats=1)
        # queued TTFT of a serial server: request j starts after j earlier ones (mean wall each)
        mean_wall = plain["wall_s"] / plain["subset"]
        queued = [j * mean_wall + statistics.median(plain["ttft"]) for j in range(len(prompts))]
        pl["queued_ttft_p50"], pl["queued_ttft_p95"] = percentile(queued, 50), percentile(queued, 95)
        mode = dict(label=label, n=n, ideal_blocks=ideal, radixcache=rc, cb=cb, plain=pl,
                    throughput_met=rc["tok_s"] is not None and cb["tok_s"] is not None
                    and rc["tok_s"] >= cb["tok_s"],
                    peak_met=rc["peak_blocks"] is not None and rc["peak_blocks"] <= PEAK_SLACK * ideal)
        if not sampled:
            mode["agreement"] = dict(
                radixcache_vs_plain=greedy_agreement(rc_runs[0]["outputs"], plain["outputs"]),
                cb_vs_plain=greedy_agreement(cb_runs[0]["outputs"], plain["outputs"]),
                radixcache_vs_cb=greedy_agreement(rc_runs[0]["outputs"], cb_runs[0]["outputs"]))
        modes.append(mode)

    sched = run_schedulers(model, cfg, seed, log)
    return dict(model=model_label(model), device=str(model.device), modes=modes, schedulers=sched,
                capacity_tokens=cap, threads=torch.get_num_threads(),
                config=cfg, seed=seed)


# --------------------------------------------------------------------------- report
def render(report: dict) -> str:
    cfg = report["config"]
    rows = []
    for mode in report["modes"]:
        rc, cb, pl = mode["radixcache"], mode["cb"], mode["plain"]
        met = ("tput " + ("met" if mode["throughput_met"] else "MISSED") + ", peak "
               + ("met" if mode["peak_met"] else "MISSED"))
        rows.append((mode["label"], "radixcache generate_batch", fmt(rc["tok_s"], ".1f"),
                     fmt(rc["wall_s_all"], ".1f"), fmt(rc["ttft_p50"], ".2f"), fmt(rc["ttft_p95"], ".2f"),
                     fmt(rc["peak_blocks"], "d"), str(mode["ideal_blocks"]), fmt(rc["hit_rate"], ".3f"),
                     met))
        cb_subset = ("" if cb["subset"] == cfg["requests"]
                     else f", {cb['subset']}/{cfg['requests']} req, extrap.")
        rows.append((mode["label"], f"transformers CB generate_batch{cb_subset}", fmt(cb["tok_s"], ".1f"),
                     fmt(cb["wall_s_all"], ".1f"), fmt(cb["ttft_p50"], ".2f"), fmt(cb["ttft_p95"], ".2f"),
                     "-", str(mode["ideal_blocks"]), fmt(cb["hit_rate"], ".3f"), ""))
        subset = "" if pl["subset"] == cfg["requests"] else f", {pl['subset']}/{cfg['requests']} req, extrap."
        rows.append((mode["label"], f"plain generate, 1 at a time{subset}", fmt(pl["tok_s"], ".1f"),
                     fmt(pl["wall_s_all"], ".1f"), fmt(pl["ttft_p50"], ".2f"), fmt(pl["ttft_p95"], ".2f"),
                     "-", "-", "-", ""))
    out = [table(COLUMNS, rows, left=(0, 1))]
    out.append("")
    for mode in report["modes"]:
        if "agreement" in mode:
            a = mode["agreement"]
            out.append("greedy agreement (identical token lists per request): "
                       f"radixcache = plain {a['radixcache_vs_plain'][0]}/{a['radixcache_vs_plain'][1]}, "
                       f"CB = plain {a['cb_vs_plain'][0]}/{a['cb_vs_plain'][1]}, "
                       f"radixcache = CB {a['radixcache_vs_cb'][0]}/{a['radixcache_vs_cb'][1]}")
    for mode in report["modes"]:
        pl, rc = mode["plain"], mode["radixcache"]
        out.append(f"{mode['label']}: plain queued TTFT (serial server, all {cfg['requests']} arriving at "
                   f"t=0, est.) p50 {fmt(pl['queued_ttft_p50'], '.1f')} s, p95 "
                   f"{fmt(pl['queued_ttft_p95'], '.1f')} s; radixcache preemptions {rc['preemptions']}, "
                   f"CB failed requests {mode['cb']['failed']}")
    out.append("")
    sched_rows = [(r["schedule"], f"{r['requests']}", fmt(r["hit_rate"], ".3f"), str(r["computed_tokens"]),
                   str(r["preemptions"]), str(r["steps"]), fmt(r["wall_s"], ".1f"))
                  for r in report["schedulers"]]
    s0 = report["schedulers"][0]
    out.append(f"scheduler: {cfg['sched_systems']} system prompts x {cfg['sched_per_system']} requests, "
               f"{cfg['sched_system_tokens']}+{cfg['sched_unique_tokens']} prompt tokens, "
               f"{cfg['sched_new_tokens']} new, shuffled arrival, max_cache_tokens={s0['cache_tokens']} "
               f"({cfg['sched_cache_prompts']} system prompts)")
    out.append(table(("schedule", "requests", "hit rate", "computed tokens", "preemptions", "steps",
                      "wall s"), sched_rows, left=(0,)))
    return "\n".join(out)


def main(argv=None, load=None) -> int:
    """Command line entry; ``load() -> (model, tokenizer)`` replaces the embedded SmolLM2 (tests)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke test")
    parser.add_argument("--json", metavar="PATH", help="also write the numbers to PATH as JSON")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: every core this process may use)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    cfg = dict(QUICK if args.quick else FULL)

    import torch

    threads = args.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)

    def log(msg):
        print(f"[{time.perf_counter() - started:7.1f} s] {msg}", file=sys.stderr, flush=True)

    started = time.perf_counter()
    report = run(cfg, load=load, seed=args.seed, log=log)
    elapsed = time.perf_counter() - started
    machine = (f"{platform.system()} {platform.machine()}, os.cpu_count()={os.cpu_count()}, "
               f"torch threads={threads}, torch {torch.__version__}")
    import transformers

    print(f"{HEADER}: {report['model']} on {report['device']}" + (" [--quick]" if args.quick else ""))
    print(f"workload: {cfg['requests']} requests = {cfg['system_tokens']}-token shared system prompt + "
          f"{cfg['unique_tokens']} unique tokens; {cfg['new_tokens']} new tokens per sample; greedy, then "
          f"n={cfg['samples']} sampled (temperature {cfg['temperature']}, seed {args.seed}); EOS disabled; "
          f"KV capacity {report['capacity_tokens']} tokens (bs {BLOCK_SIZE}) for radixcache and CB; "
          f"medians over {cfg['repeats']} radixcache / {cfg['cb_repeats']} CB repetition(s)")
    print(f"machine: {machine}, transformers {transformers.__version__}")
    print()
    print(render(report))
    print()
    print("tok/s = generated tokens / wall time of the whole call. TTFT: radixcache RunStats.ttft_s, CB")
    print("first-token timestamp - request created_time, plain: streamer stamp of the first generated")
    print("token within its own call (no queueing). ideal blocks: one copy of the system prompt's whole")
    print(f"blocks + each request's own blocks (see the docstring); peak target <= {PEAK_SLACK:.2f} x ideal.")
    print("CB reports no block usage; its hit rate comes from its 'Found a prefix match' debug log.")
    print(f"total run {elapsed:.0f} s")
    if args.json:
        payload = dict(benchmark="batch", machine=machine, elapsed_s=elapsed,
                       **{k: v for k, v in report.items()})
        Path(args.json).write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
