"""The CPU attention backends side by side, one layer at a time: gather + SDPA against in place.

For each KV shape (SmolLM2-135M: 3 KV heads of 64, 9 query heads; Llama 3 8B: 8 KV heads of 128, 32
query heads) and dtype, one layer's pool with its blocks scattered at random, and these steps:

- decode, 32 sequences x 2,048 tokens of context (each its own blocks);
- decode, 32 sequences sharing a 1,536-token prefix (whole blocks) with 512 tokens of their own:
  the gather path reads the prefix once (cascade), in place reads it per sequence;
- decode, one sequence over 1,500 tokens;
- a 100-token suffix over 1,500 and over 8,000 cached tokens (the backend keeps gather + SDPA for
  these; the kernel's own time is shown for the record).

Sides: ``TorchBackend()`` (attention "torch", and "auto" in float32: gather each context, then
SDPA; cascade for the shared prefix), and the in-place kernel (``radixcache.attention.paged_cpu``) on the same
step. Reps alternate the sides; medians; the ratio is in place over gather + SDPA, its range per
repetition. The last column says what attention "torch-inplace" runs for that step: the kernel
for decodes, except over a shared prefix in half precision (the cascade), and gather + SDPA for a
suffix.

    python benchmarks/attention.py [--threads 1] [--reps 15] [--dtypes float32 bfloat16]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.report import cpu_name, fmt, median, met, table  # noqa: E402

TARGET = 0.7  # in place / gather + SDPA, at most (decode 32 x 2k; a suffix over a cached prefix)
SHAPES = {"SmolLM2-135M": (3, 64, 9), "Llama-3-8B": (8, 128, 32)}
BLOCK = 16


def cases():
    """``(name, [(q_len, own context, shared prefix)] per sequence, targeted)``."""
    return [("decode 32 x 2,048", [(1, 2048, 0)] * 32, True),
            ("decode 32 x (1,536 shared + 512)", [(1, 512, 1536)] * 32, False),
            ("decode 1 x 1,500", [(1, 1500, 0)], False),
            ("suffix 100 over 1,500", [(100, 1600, 0)], True),
            ("suffix 100 over 8,000", [(100, 8100, 0)], True)]


def build_step(kv_heads, dim, heads, rows, dtype, backend, seed=0):
    """One layer's pool holding ``rows`` (see ``cases``) in scattered blocks, written; the step
    plan over them (via ``backend``) and a query."""
    import torch

    from radixcache.attention.plan import Segment, StepPlan
    from radixcache.kv.pool import KVPool

    shared = rows[0][2]
    per = [-(-own // BLOCK) for _, own, _ in rows]
    total = sum(per) + shared // BLOCK + 2
    pool = KVPool(1, total, BLOCK, kv_heads, dim, dtype=dtype, device="cpu")
    pool.keys[0][:total].normal_()
    pool.values[0][:total].normal_()
    ids = list(range(total))
    random.Random(seed).shuffle(ids)
    prefix, ids = tuple(ids[:shared // BLOCK]), ids[shared // BLOCK:]
    segments, start = [], 0
    for (q_len, own, _), n in zip(rows, per):
        blocks, ids = prefix + tuple(ids[:n]), ids[n:]
        segments.append(Segment(start, q_len, shared + own, blocks))
        start += q_len
    plan = StepPlan(pool, segments, backend)
    query = torch.randn(start, heads, dim, dtype=dtype)
    return pool, plan, query


def measure(shape: str, case, dtype_name: str, reps: int, kernel) -> dict:
    import torch

    from radixcache.attention.torch_backend import TorchBackend

    dtype = getattr(torch, dtype_name)
    kv_heads, dim, heads = SHAPES[shape]
    name, rows, targeted = case
    pool, plan, query = build_step(kv_heads, dim, heads, rows, dtype, TorchBackend())
    chosen = TorchBackend(in_place=True).plan(plan).kernel is not None and all(r[0] == 1 for r in rows)
    segments = torch.tensor([(s.q_start, s.q_len, s.kv_len, i) for i, s in enumerate(plan.segments)],
                            dtype=torch.long)
    scale = dim ** -0.5
    sides = {"gather": lambda: plan.attend(0, query, scale),
             "in place": lambda: kernel.paged_attention(query, pool.keys[0], pool.values[0], plan.block_table,
                                                        segments, scale, 0, 0.0)}
    error = (sides["gather"]().float() - sides["in place"]().float()).abs().max().item()
    times = {side: [] for side in sides}
    for rep in range(reps):
        for side in (sides if rep % 2 == 0 else reversed(list(sides))):
            started = time.perf_counter()
            sides[side]()
            times[side].append(time.perf_counter() - started)
    ratios = [b / a for a, b in zip(times["gather"], times["in place"])]
    gather, in_place = median(times["gather"]), median(times["in place"])
    return {"shape": shape, "case": name, "dtype": dtype_name, "targeted": targeted, "gather_ms": gather * 1e3,
            "in_place_ms": in_place * 1e3, "ratio": in_place / gather, "low": min(ratios), "high": max(ratios),
            "error": error, "torch-inplace": "in place" if chosen else "gather + SDPA"}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = parser.parse_args(argv)

    import torch

    from radixcache.attention import paged_cpu

    torch.set_num_threads(args.threads)
    kernel = paged_cpu.kernel()
    if kernel is None:
        print(f"the in-place kernel is not available here: {paged_cpu.unavailable_reason()}", file=sys.stderr)
        return 1
    rows = [measure(shape, case, dtype, args.reps, kernel)
            for dtype in args.dtypes for shape in args.shapes for case in cases()]
    print(f"one layer's attention, in place against gather + SDPA; {args.threads} torch thread(s), {args.reps} "
          f"repetitions, medians; {cpu_name()}, torch {torch.__version__}")
    header = ("dtype", "KV shape", "step", "gather + SDPA ms", "in place ms", "ratio", "per repetition",
              f"<= {TARGET}", "max abs diff", "torch-inplace runs")
    print(table(header, [(r["dtype"], r["shape"], r["case"], fmt(r["gather_ms"], ".2f"), fmt(r["in_place_ms"], ".2f"),
                          fmt(r["ratio"], ".2f"), f"{r['low']:.2f}-{r['high']:.2f}",
                          met(r["ratio"], TARGET) if r["targeted"] else "-", f"{r['error']:.1e}", r["torch-inplace"])
                         for r in rows], left=(0, 1, 2, 9)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
