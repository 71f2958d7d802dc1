#!/usr/bin/env python
"""Batch generation with a shared system prompt: radixcache ``generate_batch`` vs its floor, vs
transformers' continuous batching and plain ``model.generate``; plus "lpm" vs "fcfs" admission.

Workload (seeded random token ids, EOS off so every sample has exactly the asked length): N
requests = one S-token system prompt + U unique tokens each, G new tokens per sample (full: N=32,
S=1,000, U=100, G=32), greedy (n=1), then sampled with n=4 (temperature 0.8, top-p 1, top-k off).
Model: the embedded SmolLM2-135M-Instruct, fp32, CPU. Systems (``batch_systems.py``), side by side
on the same prompts and capacity C (tokens: S + N*n*(U+G+16)):

* radixcache: ``lm.generate_batch(prompts, max_new_tokens=G, eos_token_id=None, ...)`` on a
  cleared tree and a fresh engine; TTFT per prompt from the stream, peak blocks and per-step
  times from the engine's metrics, hit rate from ``lm.stats()``.
* floor (greedy, at N=16, S=1,000, U=100, G=16 in the full run): the prefix once into a
  ``DynamicCache``, one ``[N, U]`` forward of the suffixes over it, batched greedy decode: what
  radixcache computes, without any cache management. Target: radixcache <= 1.05x its wall time.
  Per-step overhead: radixcache's mean step time outside the model's forward, next to the floor's
  mean decode step (the model's own forward for one token of every sequence).
* transformers CB: ``model.generate_batch(..., ContinuousBatchingConfig(page_size=16,
  max_batch_tokens=2048, max_requests_per_batch=4, allow_block_sharing=True))`` on a deep copy
  (CB's fastest CPU setting; the full n=4 run gives it the first ``cb_sampled`` prompts, wall time
  extrapolated). Hit rate from its "Found a prefix match" debug log.
* plain: ``model.generate`` one request at a time on the first ``plain_*`` requests, throughput
  extrapolated to the batch.

Decode floor (issue 18): a pure decode step through the engine against a batched ``DynamicCache``
decode step of the same shape, at S sequences x L distinct tokens (full: 32 x 2,048 and 64 x
4,096), on a tiny random fp32 Llama (2 layers, 4 query heads, 2 KV heads of 16: attention over the
cache dominates the step). The engine prefills the prompts, then every sequence decodes in
lockstep; the floor holds the very K/V the engine computed (read back from the pool) and is fed
the engine's first tokens, so both sides decode the same continuation. The floor concatenates the
whole cache every step; the engine gathers it from its blocks: the same copy. Target: the median
engine step <= 1.10x the mean of the floor's medians measured before and after it, the median of
3 such rounds (``decode_floor.run_decode_floor``).

Ideal peak KV blocks: the system prompt's whole blocks once, each prompt's own blocks once, and
per sample its tail (see ``ideal_blocks``); target: peak within 10% of that. Scheduler check: K
system prompts x R requests, shuffled, a pool of 2.5 system prompts; hit rate of each policy (a
preempted prompt is counted once). Nothing asserts on timings.

    python benchmarks/batch.py [--quick] [--json PATH] [--threads N] [--seed N]
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import batch_systems as systems, decode_floor  # noqa: E402
from benchmarks.measure import default_threads, shared_prefix_prompts  # noqa: E402
from benchmarks.report import fmt, median, met, model_label, percentile, table  # noqa: E402

HEADER = "radixcache batch benchmark"
BLOCK_SIZE = systems.BLOCK_SIZE
PEAK_SLACK = 1.10
FLOOR_TARGET = 1.05
DECODE_FLOOR_TARGET = 1.10
FULL = dict(requests=32, system_tokens=1000, unique_tokens=100, new_tokens=32, samples=4,
            temperature=0.8, repeats=3, cb_repeats=1, cb_greedy=32, cb_sampled=8,
            plain_greedy=8, plain_sampled=2, floor_requests=16, floor_new_tokens=16,
            sched_systems=4, sched_per_system=8, sched_system_tokens=1000, sched_unique_tokens=100,
            sched_new_tokens=8, sched_cache_prompts=2.5,
            decode_floor=((32, 2048), (64, 4096)), decode_floor_steps=8, decode_floor_rounds=3)
QUICK = dict(FULL, requests=8, system_tokens=200, unique_tokens=40, new_tokens=8, repeats=1,
             cb_greedy=8, plain_greedy=8, floor_requests=4, floor_new_tokens=4, sched_per_system=4,
             sched_system_tokens=200, sched_unique_tokens=40, sched_new_tokens=4,
             decode_floor=((8, 512),), decode_floor_steps=4, decode_floor_rounds=1)
COLUMNS = ("workload", "system", "tok/s", "wall s", "TTFT p50 s", "TTFT p95 s", "peak KV blocks",
           "ideal blocks", "hit rate", "met?")


def ideal_blocks(system: int, unique: int, new: int, requests: int, samples: int,
                 bs: int = BLOCK_SIZE) -> int:
    """Blocks of one copy of the system prompt plus each request's own tokens: the system
    prompt's whole blocks once, each prompt's own whole blocks once, per sample its tail (the
    last sampled token is never fed back, so never stored)."""
    shared = system // bs
    kv_end = system + unique + new - 1
    if samples == 1:
        return shared + requests * (math.ceil(kv_end / bs) - shared)
    prompt_full = (system + unique) // bs
    return shared + requests * (prompt_full - shared) + requests * samples * (
        math.ceil(kv_end / bs) - prompt_full)


def capacity_tokens(cfg: dict, bs: int = BLOCK_SIZE) -> int:
    """KV capacity (tokens) of radixcache and CB: the system prompt once plus, per sample, its own
    tokens and a spare block."""
    n = cfg["requests"] * cfg["samples"]
    return math.ceil((cfg["system_tokens"] + n * (cfg["unique_tokens"] + cfg["new_tokens"] + bs)) / bs) * bs


def _summary(runs: list[dict]) -> dict:
    return dict(tok_s=median([r["generated"] / r["wall_s"] for r in runs]),
                wall_s=median([r["wall_s"] for r in runs]),
                ttft_p50=median([percentile(r["ttft"], 50) for r in runs]),
                ttft_p95=median([percentile(r["ttft"], 95) for r in runs]),
                peak_blocks=None if runs[0]["peak_blocks"] is None else max(r["peak_blocks"] for r in runs),
                hit_rate=median([r["hit_rate"] for r in runs]), generated=runs[0]["generated"],
                repeats=len(runs))


def agreement(a: list, b: list) -> tuple[int, int]:
    """(requests whose sample 0 is identical, requests compared)."""
    k = min(len(a), len(b))
    return sum(1 for i in range(k) if a[i][0] == b[i][0]), k


def run_floor_comparison(lm, cfg: dict, seed: int, log) -> dict:
    """radixcache vs the floor on the floor's workload, alternating, medians over repeats."""
    prompts, _ = shared_prefix_prompts(1, cfg["floor_requests"], cfg["system_tokens"],
                                       cfg["unique_tokens"], lm.vocab_size, seed + 7)
    system = prompts[0][:cfg["system_tokens"]]
    suffixes = [p[cfg["system_tokens"]:] for p in prompts]
    rc, fl = [], []
    for rep in range(cfg["repeats"]):
        log(f"floor comparison, repetition {rep + 1}/{cfg['repeats']} ...")
        rc.append(systems.run_radixcache(lm, prompts, cfg, False, seed, cfg["floor_new_tokens"]))
        fl.append(systems.run_floor(lm.model, system, suffixes, cfg["floor_new_tokens"]))
    r_wall, f_wall = median([r["wall_s"] for r in rc]), median([f["wall_s"] for f in fl])
    overhead = median([(r["step_s"] - r["forward_s"]) / r["steps"] for r in rc])
    return dict(requests=len(prompts), new_tokens=cfg["floor_new_tokens"], radix_wall_s=r_wall,
                floor_wall_s=f_wall, ratio=r_wall / f_wall, target=FLOOR_TARGET,
                radix_step_ms=1e3 * median([r["step_s"] / r["steps"] for r in rc]),
                radix_forward_ms=1e3 * median([r["forward_s"] / r["steps"] for r in rc]),
                radix_overhead_ms=1e3 * overhead, steps=rc[0]["steps"],
                floor_decode_step_ms=1e3 * median([median(f["decode_step_s"]) for f in fl]),
                same_tokens=[o[0] for o in rc[0]["outputs"]] == [o[0] for o in fl[0]["outputs"]])


def run(cfg: dict, load=None, seed: int = 0, log=lambda msg: None) -> dict:
    """Run the whole benchmark with ``load() -> (model, tokenizer)``; return the report dict."""
    import torch

    import radixcache

    if load is None:
        from radixcache.models import load_model as load
    model, _ = load()
    model.eval()
    model.generation_config.eos_token_id = None
    baseline = copy.deepcopy(model)  # CB switches its model's attention implementation
    prompts, _ = shared_prefix_prompts(1, cfg["requests"], cfg["system_tokens"], cfg["unique_tokens"],
                                       model.config.vocab_size, seed)
    cap = capacity_tokens(cfg)
    lm = radixcache.wrap(model, block_size=BLOCK_SIZE, max_cache_tokens=cap)
    log("warm-up ...")
    short = [p[:BLOCK_SIZE * 2] for p in prompts[:2]]
    systems.run_radixcache(lm, short, dict(cfg, new_tokens=2), False, seed)
    systems.run_cb(baseline, short, dict(cfg, new_tokens=2), False, seed, cap)
    modes = []
    for sampled in (False, True):
        n = cfg["samples"] if sampled else 1
        label = f"n={n} sampled" if sampled else "greedy"
        cb_prompts = prompts[:min(cfg["cb_sampled" if sampled else "cb_greedy"], len(prompts))]
        rc_runs, cb_runs = [], []
        for rep in range(cfg["repeats"]):
            log(f"{label}: radixcache, repetition {rep + 1}/{cfg['repeats']} ...")
            rc_runs.append(systems.run_radixcache(lm, prompts, cfg, sampled, seed + rep))
            if rep < cfg["cb_repeats"]:
                log(f"{label}: transformers CB on {len(cb_prompts)} requests ...")
                cb_runs.append(systems.run_cb(baseline, cb_prompts, cfg, sampled, seed + rep, cap))
        subset = min(cfg["plain_sampled" if sampled else "plain_greedy"], len(prompts))
        log(f"{label}: plain generate on {subset} requests ...")
        plain = systems.run_plain(baseline, prompts, cfg, sampled, seed, subset)
        rc, cb = _summary(rc_runs), _summary(cb_runs)
        rc.update(preemptions=max(r["preemptions"] for r in rc_runs), subset=len(prompts),
                  wall_s_all=rc["wall_s"])
        cb.update(failed=max(r["failed"] for r in cb_runs), subset=len(cb_prompts),
                  wall_s_all=cb["wall_s"] * len(prompts) / len(cb_prompts))
        pl = dict(tok_s=plain["tok_s"], wall_s_all=plain["wall_s"] / plain["subset"] * len(prompts),
                  ttft_p50=percentile(plain["ttft"], 50), ttft_p95=percentile(plain["ttft"], 95),
                  subset=plain["subset"])
        ideal = ideal_blocks(cfg["system_tokens"], cfg["unique_tokens"], cfg["new_tokens"],
                             cfg["requests"], n)
        mode = dict(label=label, n=n, ideal_blocks=ideal, radixcache=rc, cb=cb, plain=pl,
                    throughput_met=rc["tok_s"] >= cb["tok_s"],
                    peak_met=rc["peak_blocks"] <= PEAK_SLACK * ideal)
        if not sampled:
            mode["agreement"] = dict(radixcache_vs_plain=agreement(rc_runs[0]["outputs"], plain["outputs"]),
                                     cb_vs_plain=agreement(cb_runs[0]["outputs"], plain["outputs"]))
        modes.append(mode)
    floor = run_floor_comparison(lm, cfg, seed, log)
    sched = systems.run_schedulers(lm, cfg, seed, log)
    decode = []
    for sequences, context in cfg["decode_floor"]:
        log(f"decode floor, {sequences} x {context} ...")
        row = decode_floor.run_decode_floor(decode_floor.tiny_llama(seed), sequences, context,
                                            cfg["decode_floor_steps"], seed, cfg["decode_floor_rounds"])
        decode.append(dict(row, target=DECODE_FLOOR_TARGET))
    return dict(model=model_label(model), device=str(model.device), modes=modes, floor=floor,
                schedulers=sched, decode_floor=decode, capacity_tokens=cap,
                threads=torch.get_num_threads(), config=cfg, seed=seed)


def render(report: dict) -> str:
    """Every table of the report."""
    cfg = report["config"]
    rows = []
    for mode in report["modes"]:
        rc, cb, pl = mode["radixcache"], mode["cb"], mode["plain"]
        verdict = (f"tput {'met' if mode['throughput_met'] else 'MISSED'}, "
                   f"peak {'met' if mode['peak_met'] else 'MISSED'}")
        rows.append((mode["label"], "radixcache generate_batch", fmt(rc["tok_s"], ".1f"),
                     fmt(rc["wall_s_all"], ".1f"), fmt(rc["ttft_p50"], ".2f"), fmt(rc["ttft_p95"], ".2f"),
                     fmt(rc["peak_blocks"], "d"), str(mode["ideal_blocks"]), fmt(rc["hit_rate"], ".3f"),
                     verdict))
        sub = "" if cb["subset"] == cfg["requests"] else f", {cb['subset']}/{cfg['requests']} req, extrap."
        rows.append((mode["label"], f"transformers CB generate_batch{sub}", fmt(cb["tok_s"], ".1f"),
                     fmt(cb["wall_s_all"], ".1f"), fmt(cb["ttft_p50"], ".2f"), fmt(cb["ttft_p95"], ".2f"),
                     "-", str(mode["ideal_blocks"]), fmt(cb["hit_rate"], ".3f"), ""))
        sub = "" if pl["subset"] == cfg["requests"] else f", {pl['subset']}/{cfg['requests']} req, extrap."
        rows.append((mode["label"], f"plain generate, 1 at a time{sub}", fmt(pl["tok_s"], ".1f"),
                     fmt(pl["wall_s_all"], ".1f"), fmt(pl["ttft_p50"], ".2f"), fmt(pl["ttft_p95"], ".2f"),
                     "-", "-", "-", ""))
    out = [table(COLUMNS, rows, left=(0, 1)), ""]
    for mode in report["modes"]:
        if "agreement" in mode:
            a = mode["agreement"]
            out.append("greedy agreement (identical token lists per request): radixcache = plain "
                       f"{a['radixcache_vs_plain'][0]}/{a['radixcache_vs_plain'][1]}, CB = plain "
                       f"{a['cb_vs_plain'][0]}/{a['cb_vs_plain'][1]}")
        out.append(f"{mode['label']}: radixcache preemptions {mode['radixcache']['preemptions']}, "
                   f"CB failed requests {mode['cb']['failed']}")
    f = report["floor"]
    out += ["", f"floor: N={f['requests']}, S={cfg['system_tokens']}, U={cfg['unique_tokens']}, "
                f"G={f['new_tokens']}, greedy, EOS off (prefix once, one [N, U] forward, batched "
                f"DynamicCache decode); same tokens: {'yes' if f['same_tokens'] else 'NO'}",
            table(("system", "wall s", "ratio", "target", "met?", "steps", "step ms", "forward ms",
                   "overhead ms/step", "model decode step ms"),
                  [("radixcache generate_batch", fmt(f["radix_wall_s"], ".2f"), fmt(f["ratio"], ".3f"),
                    f"<= {f['target']:.2f}", met(f["ratio"], f["target"]), str(f["steps"]),
                    fmt(f["radix_step_ms"], ".1f"), fmt(f["radix_forward_ms"], ".1f"),
                    fmt(f["radix_overhead_ms"], ".2f"), "-"),
                   ("floor", fmt(f["floor_wall_s"], ".2f"), "1.000", "", "", "-", "-", "-", "-",
                    fmt(f["floor_decode_step_ms"], ".1f"))], left=(0,))]
    s0 = report["schedulers"][0]
    out += ["", f"scheduler: {cfg['sched_systems']} system prompts x {cfg['sched_per_system']} "
                f"requests, {cfg['sched_system_tokens']}+{cfg['sched_unique_tokens']} prompt tokens, "
                f"{cfg['sched_new_tokens']} new, shuffled arrival, max_cache_tokens={s0['cache_tokens']}",
            table(("schedule", "requests", "hit rate", "computed tokens", "preemptions", "steps", "wall s"),
                  [(r["schedule"], str(r["requests"]), fmt(r["hit_rate"], ".3f"), str(r["computed_tokens"]),
                    str(r["preemptions"]), str(r["steps"]), fmt(r["wall_s"], ".1f"))
                   for r in report["schedulers"]])]
    decode = report["decode_floor"]
    out += ["", f"decode floor: a pure decode step, engine vs a batched DynamicCache step of the same "
                f"shape; tiny random Llama (fp32, 2 layers, 2 KV heads of 16), greedy, medians of "
                f"{cfg['decode_floor_steps']} steps; floor = mean of its medians before and after; "
                f"the median of {cfg['decode_floor_rounds']} round(s)",
            table(("sequences x tokens", "engine step ms", "floor step ms", "floor before / after ms",
                   "ratio", "target", "met?", "every round", "same tokens"),
                  [(f"{r['sequences']} x {r['context']:,}", fmt(r["engine_step_ms"], ".1f"),
                    fmt(r["floor_step_ms"], ".1f"),
                    f"{r['floor_before_ms']:.1f} / {r['floor_after_ms']:.1f}", fmt(r["ratio"], ".3f"),
                    f"<= {r['target']:.2f}", met(r["ratio"], r["target"]),
                    " ".join(f"{x:.2f}" for x in r["round_ratios"]),
                    "yes" if r["same_tokens"] else "NO") for r in decode], left=(0,))]
    return "\n".join(out)


def main(argv=None, load=None) -> int:
    """Command line entry; ``load() -> (model, tokenizer)`` replaces the embedded SmolLM2 (tests)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke test")
    parser.add_argument("--json", metavar="PATH", help="also write the numbers to PATH as JSON")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    cfg = dict(QUICK if args.quick else FULL)

    import torch
    import transformers

    threads = args.threads or default_threads()
    torch.set_num_threads(threads)
    started = time.perf_counter()

    def log(msg):
        print(f"[{time.perf_counter() - started:7.1f} s] {msg}", file=sys.stderr, flush=True)

    report = run(cfg, load=load, seed=args.seed, log=log)
    machine = (f"{platform.system()} {platform.machine()}, {threads} torch threads, torch "
               f"{torch.__version__}, transformers {transformers.__version__}")
    print(f"{HEADER}: {report['model']} on {report['device']}" + (" [--quick]" if args.quick else ""))
    print(f"workload: {cfg['requests']} requests = {cfg['system_tokens']}-token shared system prompt + "
          f"{cfg['unique_tokens']} unique tokens; {cfg['new_tokens']} new tokens per sample; greedy, then "
          f"n={cfg['samples']} sampled (temperature {cfg['temperature']}); EOS off; KV capacity "
          f"{report['capacity_tokens']} tokens; medians over {cfg['repeats']} repetition(s)")
    print(f"machine: {machine}")
    print()
    print(render(report))
    print(f"ideal blocks: see ideal_blocks(); peak target <= {PEAK_SLACK:.2f} x ideal; total run "
          f"{time.perf_counter() - started:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(benchmark="batch", machine=machine, **report),
                                              indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
