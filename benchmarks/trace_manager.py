"""The trace replay's row through ``CacheManager``: the request lifecycle an engine runs, beside
the bare tree (``benchmarks/trace_replay.py`` prints both).

The same event order, clock, pool and capacity as the bare replay; per request: ``admit`` (timed
as its match), ``grow`` to the tokens it will insert (evicting LRU leaves when the pool is short,
untimed), and at its finish ``commit`` of its whole blocks and ``finish`` (retained like the bare
replay's retention policy does; timed together as its insert); after each finish the tree is
trimmed to the capacity, as in the bare replay. Tokens are handed over as ``array('I')``, packed
once per request. ``admit`` matches ``tokens[:-1]`` (a request always computes its last token), so
a fully cached, block-aligned prompt hits one block less than the bare tree's ``match``.
"""

from __future__ import annotations

import gc
import time
from array import array

import numpy as np

from benchmarks.report import fmt, table
from benchmarks.trace_timings import Timings, pool_blocks
from radixcache.lifecycle.manager import CacheManager


def replay_manager(trace, order, capacity: int, policy: str, bs: int, keep_s: float,
                   pool_blocks: int, timings) -> dict:
    """One replay of ``trace`` through a manager of ``pool_blocks`` blocks; the calls go into
    ``timings`` (a ``trace_timings.Timings``: op 0 = admit, 1 = commit + finish)."""
    now = [0.0]
    mgr = CacheManager(pool_blocks, bs, clock=lambda: now[0])
    tree = mgr.tree
    hits = np.zeros(len(trace), dtype=np.int64)
    flight: dict = {}
    wall, cpu = time.perf_counter_ns, time.thread_time_ns
    gc.collect()
    started = time.perf_counter()
    for t, kind, i in order:
        now[0] = t
        n_in = int(trace.input_len[i])
        if kind:
            tokens = array("I", trace.tokens(i, int(trace.insert_len[i])).tobytes())
            t0, c0 = wall(), cpu()
            lease = mgr.admit(tokens[:n_in])
            timings.add(0, wall() - t0, cpu() - c0, n_in, n_in)
            mgr.grow(lease, len(tokens) // bs * bs)
            flight[i] = (tokens, lease)
            hits[i] = lease.cached_tokens
            continue
        tokens, lease = flight.pop(i)
        keep = keep_s if policy == "retention" and trace.continues[i] else None
        t0, c0 = wall(), cpu()
        mgr.commit(lease, tokens, len(tokens) // bs * bs)
        mgr.finish(lease, tokens, keep)
        timings.add(1, wall() - t0, cpu() - c0, len(tokens), n_in)
        if tree.cached_blocks > capacity:
            tree.evict(tree.cached_blocks - capacity)
    elapsed = time.perf_counter() - started
    result = {"capacity_blocks": capacity, "pool_blocks": pool_blocks, "policy": policy,
              "hit_tokens": int(hits.sum()), "cached_blocks": tree.cached_blocks,
              "elapsed_s": elapsed, "timings": timings.summary()}
    mgr.clear()
    return result


def replay_all(trace, order, args, working_set: int, queried: int, policies, log) -> list:
    """``replay_manager`` at every capacity and policy of the bare replay (GC on)."""
    bs, rows = args.block_size, []
    for pct in sorted(args.capacities):
        capacity = max(1, round(working_set * pct / 100))
        for policy in policies:
            r = replay_manager(trace, order, capacity, policy, bs, args.keep_s,
                               pool_blocks(trace, bs, order, capacity), Timings())
            r.update(capacity_pct=pct, hit_rate=r["hit_tokens"] / queried)
            rows.append(r)
            log(f"  {trace.name}: {pct}% {policy} through CacheManager: hit {r['hit_rate']:.4f}, "
                f"{r['elapsed_s']:.1f} s")
    return rows


def render_manager(result: dict, clock: str) -> list:
    """The lines of the table of the manager rows, beside the bare tree's (GC on) numbers."""
    bare = {(r["capacity_pct"], r["policy"]): r for r in result["rows"] if r["gc"] == "on"}
    lines = []
    for r in result.get("manager_rows", []):
        t, b = r["timings"][clock], bare[r["capacity_pct"], r["policy"]]["timings"][clock]
        lines.append((f"{r['capacity_pct']}%", r["policy"], f"{r['hit_rate']:.4f}",
                      f"{fmt(t['match']['p50_us'], '.1f')} / {fmt(t['match']['p99_us'], '.1f')}",
                      f"{fmt(b['match']['p50_us'], '.1f')}",
                      f"{fmt(t['insert']['p50_us'], '.1f')} / {fmt(t['insert']['p99_us'], '.1f')}",
                      f"{fmt(b['insert']['p50_us'], '.1f')}"))
    if not lines:
        return []
    return ["", "through CacheManager (gc on; us/1k as above):",
            table(("capacity", "policy", "hit", "admit p50/p99", "tree match p50",
                   "commit+finish p50/p99", "tree insert p50"), lines, left=(0, 1))]
