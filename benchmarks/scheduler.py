#!/usr/bin/env python
"""The engine's own time per step, without a model: admission, scheduling, commits and events.

An ``Engine`` over a ``StubRunner`` (``radixcache.engine.stub``: no weights, no attention; the
forward writes each token's K/V and puts all logits mass on one token) is kept at ``--running``
sequences running and ``--waiting`` waiting: requests finish after 16 .. 128 new tokens and new ones
are added after every step, so admissions, chunked prefills (``max_step_tokens`` 2048) and
finishes happen all the time. Prompts: one of 8 shared 512-token system prompts plus 512 tokens of
their own (block size 16). Two limits are measured:

- ``slots``: ``max_running`` = the running count and a pool with room to spare;
- ``memory``: ``max_running`` = running + waiting, and a pool that holds about the running count's
  sequences, so every step ranks the waiting requests and stops at the first that does not fit.

Per step: ``scheduler`` = the scheduler's ``admit`` + ``schedule_step`` (timed around the calls);
``engine`` = the step's wall time outside the forward (the scheduler, commits, token choice,
events). Medians and p90 over ``--steps`` steps after a warm-up. The issue's target: scheduler
time per step <= 1 ms at 256 waiting and 64 running.

    python benchmarks/scheduler.py [--quick] [--running 64] [--waiting 256] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.report import percentile, table  # noqa: E402

from radixcache.engine import Request, SamplingParams  # noqa: E402
from radixcache.engine.stub import stub_engine  # noqa: E402

BS = 16
SYSTEM_TOKENS = 512
OWN_TOKENS = 512
SYSTEMS = 8
VOCAB = 4096  # the stub's logits rows are this wide: token choice stays small beside the scheduler
TARGET_MS = 1.0


class Workload:
    """Seeded prompts: a shared system prompt (one of ``SYSTEMS``) and tokens of their own."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.systems = [[self.rng.randrange(1, VOCAB) for _ in range(SYSTEM_TOKENS)]
                        for _ in range(SYSTEMS)]
        self.count = 0

    def request(self) -> Request:
        rng = self.rng
        prompt = rng.choice(self.systems) + [rng.randrange(1, VOCAB) for _ in range(OWN_TOKENS)]
        self.count += 1
        return Request(self.count, prompt, SamplingParams(max_new_tokens=rng.randint(16, 128)))


def timed(fn, into: list):
    """``fn``, adding its wall and thread-CPU seconds to ``into[-1]`` (a two-item list)."""
    def run(*args, **kwargs):
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            into[-1][0] += time.perf_counter() - t0
            into[-1][1] += time.thread_time() - c0
    return run


def measure(limit: str, running: int, waiting: int, steps: int, warmup: int, seed: int) -> dict:
    """Run one scenario; per-step times in ms and the mean running / waiting counts."""
    own_blocks = (OWN_TOKENS + 72) // BS + 1  # a sequence's own blocks at its mean length
    shared = SYSTEMS * SYSTEM_TOKENS // BS
    if limit == "slots":
        blocks, max_running = 4 * (running * own_blocks + shared), running
    else:
        blocks, max_running = running * own_blocks + shared, running + waiting
    engine = stub_engine(blocks, BS, vocab_size=VOCAB, read_kv=False, max_running=max_running,
                         max_step_tokens=2048)
    sched = engine.scheduler
    sched_s: list = []
    sched.admit = timed(sched.admit, sched_s)
    sched.schedule_step = timed(sched.schedule_step, sched_s)
    work = Workload(seed)
    live = 0
    engine_ms, sched_ms, sched_cpu_ms, counts = [], [], [], []
    for step in range(warmup + steps):
        while live < running + waiting:
            engine.add(work.request())
            live += 1
        sched_s.append([0.0, 0.0])
        before = (engine.metrics.step_s, engine.metrics.forward_s)
        events = engine.step()
        live -= sum(e.finished for e in events)
        if step >= warmup:
            step_s = engine.metrics.step_s - before[0]
            forward_s = engine.metrics.forward_s - before[1]
            engine_ms.append((step_s - forward_s) * 1e3)
            sched_ms.append(sched_s[-1][0] * 1e3)
            sched_cpu_ms.append(sched_s[-1][1] * 1e3)
            counts.append((len(sched.running), len(sched.waiting)))
    for request_id in range(1, work.count + 1):
        engine.abort(request_id)
    while engine.has_work:
        engine.step()
    return dict(limit=limit, max_running=max_running, pool_blocks=blocks,
                scheduler_p50_ms=percentile(sched_ms, 50), scheduler_p90_ms=percentile(sched_ms, 90),
                scheduler_cpu_p50_ms=percentile(sched_cpu_ms, 50),
                scheduler_cpu_p90_ms=percentile(sched_cpu_ms, 90),
                engine_p50_ms=percentile(engine_ms, 50), engine_p90_ms=percentile(engine_ms, 90),
                mean_running=sum(r for r, _ in counts) / len(counts),
                mean_waiting=sum(w for _, w in counts) / len(counts))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--running", type=int, default=64)
    parser.add_argument("--waiting", type=int, default=256)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="8 running, 32 waiting, 20 steps")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # the stub's tensors are tiny: threads would only contend for cores
    if args.quick:
        args.running, args.waiting, args.steps, args.warmup = 8, 32, 20, 10
    print(f"engine time per step without a model: {args.running} running, {args.waiting} waiting, "
          f"block size {BS}, prompts {SYSTEM_TOKENS} shared + {OWN_TOKENS} own tokens, "
          f"{args.steps} steps" + (" [--quick]" if args.quick else ""))
    results = [measure(limit, args.running, args.waiting, args.steps, args.warmup, args.seed)
               for limit in ("slots", "memory")]
    rows = [(r["limit"], str(r["max_running"]), f"{r['pool_blocks']:,}",
             f"{r['mean_running']:.1f}", f"{r['mean_waiting']:.1f}",
             f"{r['scheduler_p50_ms']:.3f}", f"{r['scheduler_p90_ms']:.3f}",
             f"{r['scheduler_cpu_p50_ms']:.3f}", f"{r['scheduler_cpu_p90_ms']:.3f}",
             f"{r['engine_p50_ms']:.3f}", f"{r['engine_p90_ms']:.3f}",
             "yes" if r["scheduler_p50_ms"] <= TARGET_MS else "NO") for r in results]
    print(table(("limit", "max_running", "pool blocks", "running", "waiting", "scheduler p50 ms",
                 "p90 ms", "cpu p50 ms", "cpu p90 ms", "engine p50 ms", "p90 ms",
                 f"p50 <= {TARGET_MS:g} ms"), rows, left=(0,)))
    print("scheduler = Scheduler.admit + schedule_step (wall; cpu = this thread's CPU time, which "
          "leaves out waiting for a core); engine = the step's wall time outside the forward "
          "(scheduler, commits, token choice, events)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
