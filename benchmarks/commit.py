#!/usr/bin/env python
"""What one block's commit costs as a sequence's context grows: ``CacheManager.commit`` per block.

Workload (seeded): for each context length (1k .. 32k tokens), a fresh ``CacheManager`` admits a
prompt of that many random tokens, grows and commits it in one go (untimed, as a prefill), then
decodes ``--blocks`` blocks one token at a time, as an engine does: append the token, ``grow``,
``commit``. Every ``grow`` + ``commit`` call is timed; the cost per block is their total over the
decode divided by the blocks it completed (the calls inside a block cost little; the one that
completes it adopts it into the tree). Tokens are what the engine hands over: an ``array('I')``
(``--tokens list`` passes a Python list instead). Medians over ``--repeats`` runs.

Beside it, the alternative a user of the bare tree would write: ``RadixCache.adopt`` of the whole
sequence from the root at every block boundary (timed the same way, one call per block).

With ``--store``, a second table runs the same decode with a store attached whose ``offer``
snapshots every block it is given through the pool (a CPU ``KVPool`` of SmolLM2-135M's geometry,
bf16) and sends nothing: it shows how long the manager's lock is held per block (the commit, timed
inside an outer ``with manager.mutex``) against the whole call (the lock's release included, where
the snapshot is taken once the lock is free).

    python benchmarks/commit.py [--quick] [--store] [--tokens array|list] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from array import array
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.report import table  # noqa: E402

from radixcache import BlockAllocator, RadixCache  # noqa: E402
from radixcache.lifecycle.manager import CacheManager  # noqa: E402

BS = 16
CONTEXTS = (1024, 2048, 4096, 8192, 16384, 32768)
QUICK_CONTEXTS = (1024, 4096)
TARGET_FLATNESS = 1.5  # the bound: the largest context's cost per block over the 1k one
VOCAB = 32_000


def tokens_for(n: int, seed: int) -> array:
    rng = random.Random(seed)
    return array("I", (rng.randrange(VOCAB) for _ in range(n)))


def decode_manager(context: int, blocks: int, form: str, seed: int, store=None, pool=None):
    """Per-block cost (us) of grow + commit over ``blocks`` decoded blocks after ``context``
    tokens: the whole calls and the lock-held part (inside an outer ``with manager.mutex``), each
    on the wall clock and on this thread's CPU clock (which leaves out waiting for a core)."""
    total = context + blocks * BS
    mgr = CacheManager(total // BS + 8, BS, pool=pool, store=store)
    seq = tokens_for(total, seed)
    tokens = seq[:context] if form == "array" else seq[:context].tolist()
    lease = mgr.admit(tokens)
    mgr.grow(lease, context)
    mgr.commit(lease, tokens, context)
    spent = [0, 0, 0, 0]  # whole wall, held wall, whole cpu, held cpu
    wall, cpu = time.perf_counter_ns, time.thread_time_ns
    for i in range(context, total):
        tokens.append(seq[i])
        t0, c0 = wall(), cpu()
        with mgr.mutex:
            mgr.grow(lease, i + 1)
            mgr.commit(lease, tokens, i + 1)
            t1, c1 = wall(), cpu()
        t2, c2 = wall(), cpu()
        spent[0] += t2 - t0
        spent[1] += t1 - t0
        spent[2] += c2 - c0
        spent[3] += c1 - c0
    mgr.release(lease, tokens)
    mgr.close()
    return [x / blocks / 1e3 for x in spent]


def decode_tree(context: int, blocks: int, form: str, seed: int) -> list:
    """Per-block cost (us, wall and CPU) of adopting the whole sequence from the root at every
    block boundary."""
    total = context + blocks * BS
    alloc = BlockAllocator(2 * (total // BS) + 8)
    tree = RadixCache(alloc, BS)
    seq = tokens_for(total, seed)
    held = alloc.allocate(context // BS)
    tree.adopt(seq[:context], held)
    spent = [0, 0]
    for end in range(context + BS, total + 1, BS):
        held += alloc.allocate(1)
        given = seq[:end] if form == "array" else seq[:end].tolist()
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        tree.adopt(given, held)
        spent[0] += time.perf_counter_ns() - t0
        spent[1] += time.thread_time_ns() - c0
    alloc.release(held)
    tree.reset()
    return [x / blocks / 1e3 for x in spent]


class SnapshotStore:
    """A ``BlockStore`` that snapshots what it is offered through the pool and keeps nothing."""

    block_size = BS

    def __init__(self):
        self.snapshots = 0

    def fetch(self, namespace, tokens, start, limit):
        return []

    def offer(self, namespace, tokens, start, blocks, pool):
        export = getattr(pool, "export_blocks", None)
        got = export(list(blocks)) if export else [pool.export_block(b) for b in blocks]
        self.snapshots += len(got)
        return len(got)

    def stats(self):
        return {}

    def close(self, timeout=10.0):
        return {}


def store_pool(num_blocks: int):
    import torch

    from radixcache.kv.pool import KVPool

    return KVPool(30, num_blocks, BS, 3, 64, dtype=torch.bfloat16, device="cpu")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="contexts 1k and 4k, fewer blocks")
    parser.add_argument("--blocks", type=int, default=64, help="decoded blocks per run (default 64)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--tokens", choices=("array", "list"), default="array")
    parser.add_argument("--store", action="store_true", help="also the table with a snapshotting store")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    contexts = QUICK_CONTEXTS if args.quick else CONTEXTS
    blocks = 8 if args.quick else args.blocks
    repeats = 2 if args.quick else args.repeats

    print(f"commit cost per block: block size {BS}, {blocks} decoded blocks per run, "
          f"tokens as {args.tokens}, median of {repeats}" + (" [--quick]" if args.quick else ""))
    rows, out = [], []
    base = None
    for ctx in contexts:
        runs = [decode_manager(ctx, blocks, args.tokens, r) for r in range(repeats)]
        bare_runs = [decode_tree(ctx, blocks, args.tokens, r) for r in range(repeats)]
        wall = statistics.median(r[0] for r in runs)
        cpu = statistics.median(r[2] for r in runs)
        bare = [statistics.median(r[k] for r in bare_runs) for k in (0, 1)]
        base = base or (wall, cpu)
        out.append(dict(context=ctx, manager_us=wall, manager_cpu_us=cpu, ratio=wall / base[0],
                        cpu_ratio=cpu / base[1], tree_adopt_us=bare[0], tree_adopt_cpu_us=bare[1]))
        rows.append((f"{ctx:,}", f"{wall:.1f}", f"{wall / base[0]:.2f}", f"{cpu:.1f}",
                     f"{cpu / base[1]:.2f}", f"{bare[0]:.1f}", f"{bare[1]:.1f}"))
    print(table(("context tokens", "manager us/block", "x 1k", "cpu us/block", "cpu x 1k",
                 "tree.adopt whole seq us/block", "cpu us/block"), rows))
    for clock, key in (("wall", "ratio"), ("cpu", "cpu_ratio")):
        worst = max(r[key] for r in out)
        print(f"flatness ({clock} clock): the most a block costs over the 1k context's: {worst:.2f}x "
              f"(target <= {TARGET_FLATNESS}x: {'met' if worst <= TARGET_FLATNESS else 'NOT met'})")
    result = {"rows": out, "tokens": args.tokens, "blocks": blocks}
    if args.store:
        rows, stored = [], []
        for ctx in contexts:
            pool = store_pool(ctx // BS + blocks + 8)
            runs = [decode_manager(ctx, blocks, args.tokens, r, SnapshotStore(), pool)
                    for r in range(repeats)]
            med = [statistics.median(r[k] for r in runs) for k in range(4)]
            stored.append(dict(context=ctx, whole_us=med[0], lock_held_us=med[1],
                               whole_cpu_us=med[2], lock_held_cpu_us=med[3]))
            rows.append((f"{ctx:,}", f"{med[1]:.1f}", f"{med[0]:.1f}", f"{med[3]:.1f}",
                         f"{med[2]:.1f}"))
        print()
        print("with a store that snapshots every offered block (SmolLM2-135M geometry, bf16, CPU):")
        print(table(("context tokens", "lock held us/block", "whole call us/block",
                     "cpu: lock held", "cpu: whole call"), rows))
        result["store"] = stored
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
