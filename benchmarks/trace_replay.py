#!/usr/bin/env python
"""Replay request traces through the core (BlockAllocator + RadixCache) at real sizes.

Each trace (Mooncake-format JSONL given with ``--trace PATH``, and the synthetic agent trace of
``benchmarks/traces.py``) is replayed on a simulated clock, the tree's own clock: a request arrives
at its timestamp, matches its prompt (``match``), locks and holds the matched blocks, allocates the
rest; it finishes when its output has decoded at ``--decode-rate`` tokens/s, then ``adopt``s its
tokens (the prompt, plus the output where the trace knows it: the agent trace), optionally
``keep``s the node, unlocks and releases. After each finish the tree is trimmed to the capacity
(``evict``). The pool holds the capacity plus what requests in flight hold at the peak, so the
capacity bounds the cache alone.

Capacities are fractions of the working set (the trace's distinct blocks). Policies: ``lru``, and
``retention`` (session-aware: a turn whose session sends another turn retains its node for
``--keep-s`` seconds; the last turn of a session retains nothing), compared on traces with
sessions. The ideal hit rate is that of an unbounded cache in the same event order, computed
without the tree; at 100% the tree must reproduce it exactly, or the run fails.

Beside the bare tree, the same replay runs through ``CacheManager`` (``benchmarks/trace_manager.py``:
``admit``, ``grow``, ``commit`` + ``finish``), the lifecycle an engine runs, at GC on.

Timings: every tree call is timed alone (``perf_counter_ns``) with Python's GC on (``--gc off`` or
``both`` adds runs without it). Per 1k tokens: a call's time divided by the tokens it was given, over
requests with prompts of at least 1k tokens. Tokens are handed to the tree as ``array('I')``, the
form an engine keeps them in; ``--tokens list`` passes Python lists instead (each call then also
converts them). Memory, sampled as the 100% run's tree grows: the process's resident-set growth
per cached block, and the bytes of the tree's own structures counted object by object (both
exclude the allocator's fixed 8 B per pool block: counts and free list).

``--kv-events`` replays each row twice more: with the tree logging its block changes into a
``BlockEventLog`` that nothing drains during the timed calls (``log``: what events cost the
tree's own thread), and publishing them (``on``: a ``KVEventPublisher`` bound on loopback, nobody
subscribed, so every message is still hashed, encoded and sent by its thread, which shares the
GIL with the replay); it prints the tree's match + insert time of the three side by side and the
CPU time of the publisher's thread (block digests, encoding).

    python benchmarks/trace_replay.py [--trace PATH ...] [--no-agent] [--quick] [--kv-events] [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from array import array
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.trace_replay_report import render, render_kv_events  # noqa: E402
from benchmarks.trace_timings import Timings, pool_blocks, rss_bytes, tree_bytes  # noqa: E402
from benchmarks.traces import (  # noqa: E402
    AGENT_PARAMS, QUICK_AGENT_PARAMS, Trace, agent_trace, describe, load_mooncake,
)

from radixcache import BlockAllocator, RadixCache  # noqa: E402
from radixcache.kv_events import BlockEventLog, KVEventPublisher  # noqa: E402

MEMORY_STEP = 250_000            # blocks between resident-memory samples
QUICK_REQUESTS = 300             # requests of each --trace replayed with --quick
def completion_s(trace: Trace, decode_rate: float) -> np.ndarray:
    """When each request finishes: its arrival plus its output decoded at ``decode_rate``."""
    return trace.arrival_s + trace.output_len / decode_rate


def events(trace: Trace, done_s: np.ndarray):
    """(time, kind, request) in processing order; at equal times finishes (kind 0) come first."""
    order = sorted([(float(t), 1, i) for i, t in enumerate(trace.arrival_s)]
                   + [(float(t), 0, i) for i, t in enumerate(done_s)])
    return order


def ideal(trace: Trace, bs: int, order) -> tuple[np.ndarray, int]:
    """Hit tokens per request of an unbounded cache (a request's tokens are cached from its finish
    on) and the working set in blocks, from page coverage alone (no tree)."""
    covered = np.zeros(trace.num_pages, dtype=np.int64)
    hits = np.zeros(len(trace), dtype=np.int64)
    for _, kind, i in order:
        start = trace.page_start[i]
        if kind:
            n = int(trace.input_len[i])
            lens = trace.page_lengths(i, n)
            cov = covered[trace.pages[start:start + len(lens)]]
            short = np.flatnonzero(cov < lens)
            if not short.size:
                hits[i] = n // bs * bs
            else:
                j = int(short[0])
                hits[i] = j * 512 + min(int(cov[j]), int(lens[j])) // bs * bs
        else:
            lens = trace.page_lengths(i, int(trace.insert_len[i])) // bs * bs
            pages = trace.pages[start:start + len(lens)]
            covered[pages] = np.maximum(covered[pages], lens)
    return hits, int((covered // bs).sum())


def replay(trace: Trace, order, capacity: int, policy: str, bs: int, keep_s: float,
           token_form: str, sample_memory: bool, kv_events: str = "off") -> dict:
    """One replay of ``trace`` at ``capacity`` blocks under ``policy``, KV events ``off``, ``log``ged
    only or ``on`` (see the module docstring); returns its numbers."""
    now = [0.0]
    alloc = BlockAllocator(pool_blocks(trace, bs, order, capacity))
    tree = RadixCache(alloc, block_size=bs, clock=lambda: now[0])
    publisher = KVEventPublisher("tcp://127.0.0.1:*") if kv_events == "on" else None
    log = publisher.log if publisher else BlockEventLog(2**62) if kv_events == "log" else None
    if log is not None:
        tree.set_event_log(log)
    drain = log.records.clear if kv_events == "log" else (lambda: None)  # untimed
    timings, hits = Timings(), np.zeros(len(trace), dtype=np.int64)
    flight: dict = {}
    memory, next_sample = [], MEMORY_STEP
    gc.collect()
    base_rss = rss_bytes()
    wall, cpu = time.perf_counter_ns, time.thread_time_ns
    convert = array.tolist if token_form == "list" else (lambda a: a)
    started = time.perf_counter()
    for t, kind, i in order:
        now[0] = t
        n_in = int(trace.input_len[i])
        if kind:
            tokens = array("I", trace.tokens(i, int(trace.insert_len[i])).tobytes())
            prompt = convert(tokens[:n_in])
            t0, c0 = wall(), cpu()
            m = tree.match(prompt)
            timings.add(0, wall() - t0, cpu() - c0, n_in, n_in)
            t0, c0 = wall(), cpu()
            tree.lock(m.node)
            timings.add(3, wall() - t0, cpu() - c0, 0, n_in)
            alloc.retain(m.blocks)
            need = len(tokens) // bs - len(m.blocks)
            if need > alloc.num_free:
                t0, c0 = wall(), cpu()
                tree.evict(need - alloc.num_free)
                timings.add(2, wall() - t0, cpu() - c0, 0, n_in)
            flight[i] = (tokens, m.node, list(m.blocks) + alloc.allocate(need))
            drain()
            hits[i] = m.length
            continue
        tokens, node, blocks = flight.pop(i)
        given = convert(tokens)
        t0, c0 = wall(), cpu()
        adopted = tree.adopt(given, blocks)
        timings.add(1, wall() - t0, cpu() - c0, len(tokens), n_in)
        if policy == "retention" and trace.continues[i]:
            t0, c0 = wall(), cpu()
            tree.keep(adopted.node, t + keep_s)
            timings.add(5, wall() - t0, cpu() - c0, 0, n_in)
        t0, c0 = wall(), cpu()
        tree.unlock(node)
        timings.add(4, wall() - t0, cpu() - c0, 0, n_in)
        alloc.release(blocks)
        if tree.cached_blocks > capacity:
            t0, c0 = wall(), cpu()
            tree.evict(tree.cached_blocks - capacity)
            timings.add(2, wall() - t0, cpu() - c0, 0, n_in)
        drain()
        if sample_memory and tree.cached_blocks >= next_sample:
            memory.append((tree.cached_blocks, rss_bytes() - base_rss, tree_bytes(tree)))
            next_sample = (tree.cached_blocks // MEMORY_STEP + 1) * MEMORY_STEP
    elapsed = time.perf_counter() - started
    if sample_memory:
        memory.append((tree.cached_blocks, rss_bytes() - base_rss, tree_bytes(tree)))
    if len(trace) <= QUICK_REQUESTS:
        tree.check()
    result = {"capacity_blocks": capacity, "pool_blocks": alloc.num_blocks, "policy": policy,
              "hit_tokens": int(hits.sum()), "hits": hits, "cached_blocks": tree.cached_blocks,
              "elapsed_s": elapsed, "memory": memory, "timings": timings.summary(), "calls": timings,
              "kv_events": kv_events}
    tree.set_event_log(None)
    if publisher is not None:
        publisher.flush(3600)
        result["publisher"] = publisher.close()
    tree.reset()
    return result


def run_trace(trace: Trace, args, log) -> dict:
    """Every capacity and policy for one trace, side by side in one process."""
    bs = args.block_size
    done = completion_s(trace, args.decode_rate)
    order = events(trace, done)
    ideal_hits, working_set = ideal(trace, bs, order)
    queried = int(trace.input_len.sum())
    policies = ["lru", "retention"] if trace.has_sessions else ["lru"]
    rows = []
    # The largest capacity first: its memory samples then start from a heap no earlier run grew.
    for pct in sorted(args.capacities, reverse=True):
        capacity = max(1, round(working_set * pct / 100))
        for policy in policies:
            for gc_on, events_on in [(g, e) for g in {"on": [True], "off": [False],
                                                      "both": [True, False]}[args.gc]
                                     for e in (["off", "log", "on"] if args.kv_events else ["off"])]:
                (gc.enable if gc_on else gc.disable)()
                r = replay(trace, order, capacity, policy, bs, args.keep_s, args.tokens,
                           sample_memory=pct == 100 and policy == "lru" and gc_on and events_on == "off",
                           kv_events=events_on)
                gc.enable()
                if pct == 100 and r["hit_tokens"] != int(ideal_hits.sum()):
                    bad = np.flatnonzero(r["hits"] != ideal_hits)[:5].tolist()
                    raise SystemExit(f"{trace.name}: at 100% the tree hit {r['hit_tokens']} tokens, "
                                     f"the ideal is {int(ideal_hits.sum())} (requests {bad} differ)")
                del r["hits"]
                calls = r.pop("calls")
                if events_on == "off":
                    twin = calls
                else:
                    r["paired_cost_pct"] = paired_cost(twin, calls)
                r.update(capacity_pct=pct, gc="on" if gc_on else "off",
                         hit_rate=r["hit_tokens"] / queried, ideal_hit_rate=int(ideal_hits.sum()) / queried)
                rows.append(r)
                log(f"  {trace.name}: {pct}% {policy} gc {r['gc']} kv events {r['kv_events']}: "
                    f"hit {r['hit_rate']:.4f} (ideal {r['ideal_hit_rate']:.4f}), {r['elapsed_s']:.1f} s")
    rows.sort(key=lambda r: (r["capacity_pct"], policies.index(r["policy"]), r["gc"] == "off",
                             ("off", "log", "on").index(r["kv_events"])))
    from benchmarks.trace_manager import replay_all

    managed = replay_all(trace, order, args, working_set, queried, policies, log)
    return {"trace": trace.name, "params": trace.params, "measured": describe(trace),
            "working_set_blocks": working_set, "rows": rows, "manager_rows": managed}


def paired_cost(off: Timings, on: Timings) -> dict:
    """Per clock: the median over match and insert calls of (the call with events / the same call
    without) - 1, in percent. The replays make the same calls in the same order, so each pair did
    the same work; the median ignores the calls a loaded machine or a GC pass happened to slow."""
    op = np.frombuffer(off.op, np.int8)
    assert len(on.op) == len(op), "the replays with and without events made different calls"
    sel = op <= 1
    out = {}
    for clock in off.ns:
        a = np.frombuffer(off.ns[clock], np.int64)[sel]
        b = np.frombuffer(on.ns[clock], np.int64)[sel]
        keep = a > 0
        out[clock] = float(100 * (np.median(b[keep] / a[keep]) - 1)) if keep.any() else None
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", action="append", default=[], metavar="PATH",
                        help="Mooncake-format JSONL trace, repeatable (LRU only: no sessions)")
    parser.add_argument("--no-agent", action="store_true", help="skip the synthetic agent trace")
    parser.add_argument("--quick", action="store_true",
                        help=f"bounded smoke run: a 12-session agent trace, the first {QUICK_REQUESTS} "
                             f"requests of each --trace")
    parser.add_argument("--capacities", default="1,5,20,100",
                        type=lambda s: [float(x) if "." in x else int(x) for x in s.split(",")],
                        help="percent of the working set (default 1,5,20,100)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--decode-rate", type=float, default=50.0, help="output tokens/s (default 50)")
    parser.add_argument("--keep-s", type=float, default=300.0,
                        help="retention of a session's node after a turn (default 300 s)")
    parser.add_argument("--gc", choices=("on", "off", "both"), default="on")
    parser.add_argument("--tokens", choices=("array", "list"), default="array",
                        help="how tokens are handed to the tree (default array('I'))")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="clock of the printed timings (both go to --json; cpu leaves out time "
                             "spent waiting for a core on a loaded machine)")
    parser.add_argument("--kv-events", action="store_true",
                        help="replay every row again publishing KV events, and compare")
    parser.add_argument("--json", metavar="PATH", help="also write the numbers to PATH as JSON")
    args = parser.parse_args(argv)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    traces = []
    for path in args.trace:
        trace = load_mooncake(path)
        traces.append(trace.head(QUICK_REQUESTS) if args.quick else trace)
    if not args.no_agent:
        traces.append(agent_trace(args.decode_rate, QUICK_AGENT_PARAMS if args.quick else AGENT_PARAMS))
    if not traces:
        parser.error("nothing to replay: give --trace PATH or drop --no-agent")
    print(f"trace replay: block size {args.block_size}, decode {args.decode_rate:g} tok/s, "
          f"retention {args.keep_s:g} s, tokens as {args.tokens}, GC {args.gc}, {args.clock} clock"
          + (" [--quick]" if args.quick else ""))
    results = []
    for trace in traces:
        log(f"{trace.name}: {len(trace)} requests ...")
        result = run_trace(trace, args, log)
        results.append(result)
        print()
        print(f"== {trace.name}: working set {result['working_set_blocks']:,} blocks")
        print("parameters: " + ", ".join(f"{k} {v}" for k, v in trace.params.items()))
        print("measured: " + ", ".join(f"{k} {v:,.4g}" if isinstance(v, float) else f"{k} {v:,}"
                                       for k, v in result["measured"].items()))
        print(render(result, args.clock))
        events_table = render_kv_events(result, args.clock)
        if events_table:
            print()
            print(events_table)
    print()
    print("ideal hit = an unbounded cache in the same event order; us/1k = microseconds per 1,000 tokens "
          "given to the call (prompts >= 1k tokens); worst call = the slowest single tree call, GC included")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
