"""What the trace replays time and size: ``Timings`` (every timed call), ``pool_blocks`` (the pool a
replay needs), ``OPS`` (the operations, by code), ``rss_bytes`` and ``tree_bytes`` (memory),
shared by ``trace_replay.py`` (the bare tree) and ``trace_manager.py`` (the same replay through
``CacheManager``)."""

from __future__ import annotations

import os
import sys
from array import array

import numpy as np

OPS = ("match", "insert", "evict", "lock", "unlock", "keep")
_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    """Resident set size of this process."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def tree_bytes(tree) -> int:
    """Bytes a ``RadixCache``'s own structures hold, counted object by object (``sys.getsizeof``): the
    node columns, every node's tokens, block ids and child table, the recency tiers, and the
    in-tree marks (one byte per pool block). Ints shared with other structures count once."""
    nodes, recency = tree.node_table, tree.recency
    total = sum(sys.getsizeof(col) for col in (nodes.parent, nodes.lock_ref, nodes.own_locks, nodes.access,
                                               nodes.until, nodes.gen, nodes.free_ids, nodes.keys,
                                               nodes.blocks, nodes.kids))
    total += sum(sys.getsizeof(k) for k in nodes.keys if k is not None)
    total += sum(sys.getsizeof(b) for b in nodes.blocks)
    total += sum(sys.getsizeof(d) for d in nodes.kids if d is not None)
    for tier in (recency.lru, recency.kept, recency.expiry):
        total += sum(sys.getsizeof(x) + 8 for x in tier)  # each entry and its list slot
    total += sys.getsizeof(recency.where) + sys.getsizeof(recency.deadlines)
    return total + tree.allocator.num_blocks


def pool_blocks(trace, bs: int, order, capacity: int) -> int:
    """The capacity plus the most blocks that requests in flight (``order`` of a ``traces.Trace``)
    hold at once."""
    held = peak = 0
    for _, kind, i in order:
        held += (1 if kind else -1) * int(trace.insert_len[i] // bs)
        peak = max(peak, held)
    return capacity + peak + 1


class Timings:
    """Every timed call: operation, wall and thread-CPU nanoseconds, tokens given, prompt length.

    On a quiet machine the two clocks agree; on a loaded one the wall clock also counts the time the
    process waited for a core, which the CPU clock leaves out."""

    def __init__(self):
        self.op, self.tokens, self.prompt = array("b"), array("q"), array("q")
        self.ns = {"wall": array("q"), "cpu": array("q")}

    def add(self, op: int, wall_ns: int, cpu_ns: int, tokens: int, prompt: int) -> None:
        self.op.append(op)
        self.ns["wall"].append(wall_ns)
        self.ns["cpu"].append(cpu_ns)
        self.tokens.append(tokens)
        self.prompt.append(prompt)

    def summary(self) -> dict:
        """Per clock: p50/p99 per 1k tokens of match and insert (prompts >= 1k tokens), the worst
        call, and the slowest call of each operation."""
        op = np.frombuffer(self.op, np.int8)
        tokens, prompt = np.frombuffer(self.tokens, np.int64), np.frombuffer(self.prompt, np.int64)
        out = {}
        for clock, samples in self.ns.items():
            ns = np.frombuffer(samples, np.int64)
            res = out[clock] = {}
            for code, name in enumerate(OPS[:2]):
                sel = (op == code) & (prompt >= 1000)
                per_1k = ns[sel] / 1000.0 / (tokens[sel] / 1000.0)
                res[name] = {"p50_us": float(np.percentile(per_1k, 50)) if sel.any() else None,
                             "p99_us": float(np.percentile(per_1k, 99)) if sel.any() else None,
                             "calls": int(sel.sum())}
            res["match_insert_s"] = float(ns[op <= 1].sum()) / 1e9
            worst = int(np.argmax(ns))
            res["worst"] = {"op": OPS[op[worst]], "ms": float(ns[worst]) / 1e6, "tokens": int(tokens[worst])}
            for code, name in enumerate(OPS):
                sel = op == code
                res[f"max_{name}_ms"] = float(ns[sel].max()) / 1e6 if sel.any() else None
        return out
