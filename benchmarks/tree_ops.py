#!/usr/bin/env python
"""Per-operation cost of RadixCache (insert / match / evict) against a hash-chain block index.

Workload (seeded, reproducible): 100 "system prompts" of 400 random tokens (vocab 32,000); every
sequence is one of them followed by a fresh random 112-token suffix (512 tokens). For each block
size (1 and 16):

1. insert   10,000 sequences. Each one allocates ``512 // bs`` blocks, ``tree.insert`` runs (timed
            alone), then the caller releases its own references (duplicates free themselves).
2. match    the same 10,000 sequences in shuffled order, ``tree.match`` timed per call.
3. evict    ``tree.evict(512 // bs)`` (512 tokens' worth) timed per call, 200 calls with about
            5,000 leaves in the tree, then the tree is grown with more sequences to about 50,000
            leaves and 200 more calls are timed. Each call must drop exactly ``512 // bs`` blocks and
            free that many in the allocator, or the run fails.

The baseline is the vLLM approach to prefix caching, a hash chain over full blocks
(``benchmarks/hash_chain.py``), timed with ``hashlib.sha256`` and with ``xxhash.xxh3_128`` on the same
sequences and block ids: a lower bound on what a hash-chain index costs.

The allocator is sized to what the tree can hold at its largest plus one in-flight sequence, not to
``512 // bs`` blocks x every sequence (5.12M ids at bs=1): the caller's duplicate blocks are freed
right after each insert, so that bound is never approached. If a sequence does not fit anyway, the
insert loop evicts first, as an engine would (untimed).

Every number is the median over the timed calls (``time.perf_counter_ns`` around the call alone).
Nothing asserts on timings; the ``met?`` column only compares against the issue's targets.

    python benchmarks/tree_ops.py [--quick] [--json PATH] [--seed N]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.hash_chain import HASHES, HashChainIndex  # noqa: E402
from benchmarks.report import fmt, table  # noqa: E402

from radixcache import BlockAllocator, RadixCache  # noqa: E402

VOCAB = 32_000
NUM_PROMPTS = 100
PROMPT_LEN = 400
SUFFIX_LEN = 112
SEQ_LEN = PROMPT_LEN + SUFFIX_LEN
BLOCK_SIZES = (1, 16)
EVICT_TOKENS = 512

# Targets from the issue, in microseconds: (operation, block size or None for every size) -> us.
TARGETS_US = {("insert", 16): 50.0, ("match", 16): 30.0, ("evict", None): 500.0}

FULL = dict(inserts=10_000, matches=10_000, evict_calls=200, small_leaves=5_000, big_leaves=50_000)
QUICK = dict(inserts=400, matches=400, evict_calls=30, small_leaves=200, big_leaves=1_000)

HEADER = "radixcache tree_ops benchmark"
COLUMNS = ("bs", "operation", "radixcache us", "sha256-chain us", "xxh3-chain us",
           "ratio r/sha256", "ratio r/xxh3", "target us", "met?")


# --------------------------------------------------------------------------- workload
class Workload:
    """Seeded token sequences: a fixed pool of system prompts, each sequence gets a fresh suffix."""

    def __init__(self, seed: int):
        self._np = np.random.default_rng(seed)
        self.prompts = self._np.integers(0, VOCAB, size=(NUM_PROMPTS, PROMPT_LEN), dtype=np.int64)

    def sequences(self, n: int) -> list[list[int]]:
        """``n`` new 512-token sequences as plain lists of ints (what a tokenizer hands a caller).

        Every sequence has its own int objects, as a tokenizer's output would: sharing the prompt's
        objects between sequences would let tuple comparisons short-cut on identity and flatter
        any implementation that keeps the caller's objects.
        """
        which = self._np.integers(0, NUM_PROMPTS, size=n)
        suffixes = self._np.integers(0, VOCAB, size=(n, SUFFIX_LEN), dtype=np.int64)
        return np.concatenate([self.prompts[which], suffixes], axis=1).tolist()


# --------------------------------------------------------------------------- timing helpers
def summary(samples_ns: list[int]) -> dict:
    us = sorted(s / 1000.0 for s in samples_ns)
    n = len(us)
    return {"median_us": statistics.median(us), "p10_us": us[n // 10], "p90_us": us[(9 * n) // 10],
            "mean_us": sum(us) / n, "calls": n}


def count_leaves(tree: RadixCache) -> int:
    return sum(1 for node in tree.nodes() if not node.children)


def insert_one(tree: RadixCache, alloc: BlockAllocator, seq, nblocks: int) -> int:
    """Allocate, insert (timed), release. Returns the insert's duration in ns."""
    if alloc.num_free < nblocks:
        tree.evict(nblocks - alloc.num_free)
    blocks = alloc.allocate(nblocks)
    t0 = time.perf_counter_ns()
    tree.insert(seq, blocks)
    t1 = time.perf_counter_ns()
    alloc.release(blocks)
    return t1 - t0


def time_evictions(tree: RadixCache, alloc: BlockAllocator, calls: int, bs: int) -> list[int]:
    want = EVICT_TOKENS // bs
    samples = []
    for _ in range(calls):
        free_before = alloc.num_free
        t0 = time.perf_counter_ns()
        dropped = tree.evict(want)
        t1 = time.perf_counter_ns()
        freed = alloc.num_free - free_before
        if dropped != want or freed != want:
            raise SystemExit(f"evict({want}) at bs={bs} dropped {dropped} blocks and freed {freed}; "
                             f"expected {want} of each")
        samples.append(t1 - t0)
    return samples


def evict_leaves_down_to(tree: RadixCache, target: int) -> None:
    """Untimed: evict whole LRU leaves until about ``target`` leaves remain."""
    per_leaf = SUFFIX_LEN // tree.block_size
    while True:
        excess = count_leaves(tree) - target
        if excess <= 0:
            return
        tree.evict(excess * per_leaf)


# --------------------------------------------------------------------------- one block size
def bench_block_size(bs: int, cfg: dict, seed: int, log) -> dict:
    work = Workload(seed)
    nblocks = SEQ_LEN // bs
    calls = cfg["evict_calls"]
    # Leaves dropped by the timed evictions; start half of that above each level so the tree holds
    # about that many leaves on average while it is being timed.
    leaves_per_evict = (EVICT_TOKENS // bs) / (SUFFIX_LEN // bs)
    margin = int(calls * leaves_per_evict / 2)
    max_leaves = max(cfg["inserts"], cfg["big_leaves"] + margin)
    capacity = (NUM_PROMPTS * (PROMPT_LEN // bs) + max_leaves * (SUFFIX_LEN // bs) + 2 * nblocks)
    alloc = BlockAllocator(capacity)
    tree = RadixCache(alloc, block_size=bs)
    out: dict = {"block_size": bs, "allocator_blocks": capacity}

    # 1. inserts
    seqs = work.sequences(cfg["inserts"])
    gc.collect()
    samples = [insert_one(tree, alloc, s, nblocks) for s in seqs]
    out["insert"] = {"radixcache": summary(samples)}
    log(f"  bs={bs}: insert done ({len(seqs)} sequences, {tree.cached_blocks} blocks cached)")

    # 2. matches
    order = list(range(len(seqs)))
    random.Random(seed + bs).shuffle(order)
    order = (order * (cfg["matches"] // len(order) + 1))[:cfg["matches"]]
    gc.collect()
    samples = []
    for i in order:
        seq = seqs[i]
        t0 = time.perf_counter_ns()
        m = tree.match(seq)
        t1 = time.perf_counter_ns()
        samples.append(t1 - t0)
        if m.length != len(seq) // bs * bs:
            raise SystemExit(f"match at bs={bs} found {m.length} of {len(seq)} inserted tokens")
    out["match"] = {"radixcache": summary(samples)}

    # Baselines on the same sequences, block ids and match order.
    block_ids = [list(range(i * nblocks, (i + 1) * nblocks)) for i in range(len(seqs))]
    for name, (digest, size) in HASHES.items():
        index = HashChainIndex(bs, digest, size)
        gc.collect()
        ins = []
        for seq, ids in zip(seqs, block_ids):
            t0 = time.perf_counter_ns()
            index.insert(seq, ids)
            ins.append(time.perf_counter_ns() - t0)
        mat = []
        for i in order:
            seq = seqs[i]
            t0 = time.perf_counter_ns()
            length, _ = index.match(seq)
            mat.append(time.perf_counter_ns() - t0)
            if length != len(seq) // bs * bs:
                raise SystemExit(f"{name} chain at bs={bs} matched {length} of {len(seq)} tokens")
        out["insert"][name] = summary(ins)
        out["match"][name] = summary(mat)
        del index
    del block_ids
    log(f"  bs={bs}: match and hash-chain baselines done")

    # 3. evictions with ~small_leaves leaves, then grown to ~big_leaves leaves.
    for level, key in ((cfg["small_leaves"], "evict_small"), (cfg["big_leaves"], "evict_big")):
        start = level + margin
        evict_leaves_down_to(tree, start)
        leaves = count_leaves(tree)
        while leaves < start:
            for seq in work.sequences(min(5_000, start - leaves)):
                insert_one(tree, alloc, seq, nblocks)
            leaves = count_leaves(tree)
        gc.collect()
        samples = time_evictions(tree, alloc, calls, bs)
        out[key] = {"radixcache": summary(samples), "leaves_before": leaves,
                    "leaves_after": count_leaves(tree), "level": level}
        log(f"  bs={bs}: evict timed with {leaves} -> {out[key]['leaves_after']} leaves")

    if cfg is QUICK:
        tree.check()
    tree.reset()
    del seqs, tree, alloc
    gc.collect()
    return out


# --------------------------------------------------------------------------- report
def target_for(op: str, bs: int):
    return TARGETS_US.get((op, bs), TARGETS_US.get((op, None)))


def rows_for(result: dict) -> list[dict]:
    bs = result["block_size"]
    rows = []
    for key, label, op in (("insert", "insert", "insert"), ("match", "match", "match"),
                           ("evict_small", None, "evict"), ("evict_big", None, "evict")):
        entry = result[key]
        if label is None:
            label = f"evict @{entry['leaves_before']}->{entry['leaves_after']} leaves"
        radix = entry["radixcache"]["median_us"]
        sha = entry.get("sha256", {}).get("median_us")
        xxh = entry.get("xxh3", {}).get("median_us")
        target = target_for(op, bs)
        rows.append({"block_size": bs, "operation": label, "radixcache_us": radix, "sha256_chain_us": sha,
                     "xxh3_chain_us": xxh, "ratio_vs_sha256": radix / sha if sha else None,
                     "ratio_vs_xxh3": radix / xxh if xxh else None, "target_us": target,
                     "met": None if target is None else radix <= target})
    return rows


def render(rows: list[dict]) -> str:
    cells = [COLUMNS]
    for r in rows:
        cells.append((str(r["block_size"]), r["operation"], fmt(r["radixcache_us"], ".1f"),
                      fmt(r["sha256_chain_us"], ".1f"), fmt(r["xxh3_chain_us"], ".1f"),
                      fmt(r["ratio_vs_sha256"], ".2f"), fmt(r["ratio_vs_xxh3"], ".2f"),
                      fmt(r["target_us"], ".0f"),
                      "-" if r["met"] is None else ("yes" if r["met"] else "NO")))
    return table(cells[0], cells[1:], left=(0, 1))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small counts, for a smoke test")
    parser.add_argument("--json", metavar="PATH", help="also write the numbers to PATH as JSON")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    cfg = QUICK if args.quick else FULL

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    machine = (f"{platform.system()} {platform.machine()}, os.cpu_count()={os.cpu_count()}, "
               f"Python {platform.python_version()} ({platform.python_implementation()})")
    workload = (f"{NUM_PROMPTS} system prompts x {PROMPT_LEN} tokens + random {SUFFIX_LEN}-token suffix "
                f"({SEQ_LEN}-token sequences, vocab {VOCAB}, seed {args.seed}); {cfg['inserts']} inserts, "
                f"{cfg['matches']} matches, {cfg['evict_calls']} x evict({EVICT_TOKENS} tokens) at "
                f"~{cfg['small_leaves']} and ~{cfg['big_leaves']} leaves"
                + (" [--quick]" if args.quick else ""))
    started = time.perf_counter()
    results = []
    for bs in BLOCK_SIZES:
        log(f"block size {bs} ...")
        results.append(bench_block_size(bs, cfg, args.seed, log))
    elapsed = time.perf_counter() - started
    rows = [row for result in results for row in rows_for(result)]

    print(f"{HEADER}: median microseconds per operation")
    print(f"workload: {workload}")
    print(f"machine: {machine}")
    print()
    print(render(rows))
    print()
    print("sha256-chain / xxh3-chain: vLLM-style dict of chained block digests (full blocks only;")
    print("no refcounts, LRU or validation: a lower bound). ratio = radixcache / chain")
    print("(< 1: radixcache faster).")
    print(f"targets apply to insert/match per {SEQ_LEN}-token sequence at bs=16 and to evict at every bs; "
          f"total run {elapsed:.1f} s")

    if args.json:
        payload = {"benchmark": "tree_ops", "workload": workload, "machine": machine,
                   "config": cfg, "seed": args.seed, "elapsed_s": elapsed, "rows": rows,
                   "details": results}
        Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
