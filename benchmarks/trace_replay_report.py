"""The tables ``benchmarks/trace_replay.py`` prints for one replayed trace: hit rates, timings and
memory per capacity and policy (``render``, with the ``CacheManager`` rows of
``benchmarks/trace_manager.py``), and KV events off, logged and on side by side
(``render_kv_events``)."""

from __future__ import annotations

from benchmarks.report import fmt, table
from benchmarks.trace_manager import render_manager


def render(result: dict, clock: str) -> str:
    """The tables for one trace: hit rates and timings (on ``clock``) per capacity and policy, then
    memory."""
    header = ("capacity", "blocks", "policy", "gc", "ideal hit", "hit", "match p50/p99 us/1k",
              "insert p50/p99 us/1k", "worst call")
    lines = []
    for r in result["rows"]:
        if r["kv_events"] != "off":
            continue  # beside its events-off twin in render_kv_events
        t = r["timings"][clock]
        w = t["worst"]
        lines.append((f"{r['capacity_pct']}%", f"{r['capacity_blocks']:,}", r["policy"], r["gc"],
                      f"{r['ideal_hit_rate']:.4f}", f"{r['hit_rate']:.4f}",
                      f"{fmt(t['match']['p50_us'], '.1f')} / {fmt(t['match']['p99_us'], '.1f')}",
                      f"{fmt(t['insert']['p50_us'], '.1f')} / {fmt(t['insert']['p99_us'], '.1f')}",
                      f"{w['ms']:.2f} ms {w['op']} ({w['tokens']:,} tok)"))
    out = [table(header, lines, left=(0, 2, 3, 8))]
    by = {(r["capacity_pct"], r["policy"], r["gc"]): r["hit_rate"] for r in result["rows"]}
    gains = [f"{pct}%: {by[pct, 'retention', 'on'] - by[pct, 'lru', 'on']:+.4f}"
             for pct in sorted({k[0] for k in by}) if (pct, "retention", "on") in by]
    if gains:
        out.append("retention - lru hit rate: " + ", ".join(gains))
    out.extend(render_manager(result, clock))
    mem = [m for r in result["rows"] for m in r["memory"]]
    if mem:
        out.append("")
        out.append(table(("cached blocks", "RSS growth", "RSS B/block", "tree structures", "B/block"),
                         [(f"{b:,}", f"{d / 2**20:.1f} MiB", f"{d / b:.1f}", f"{t / 2**20:.1f} MiB",
                           f"{t / b:.1f}") for b, d, t in mem if b], left=()))
    return "\n".join(out)



def render_kv_events(result: dict, clock: str) -> str:
    """KV events off, logged and on side by side per row: the tree's match + insert time (p50 per
    1k tokens, and in all), and the publisher thread's CPU time. Empty without ``--kv-events``."""
    rows = {(r["capacity_pct"], r["policy"], r["gc"], r["kv_events"]): r for r in result["rows"]}
    lines = []
    for (pct, policy, gc_on, events), r in rows.items():
        if events != "on":
            continue
        off, log = (rows[pct, policy, gc_on, e]["timings"][clock] for e in ("off", "log"))
        on, pub = r["timings"][clock], r["publisher"]
        base = off["match_insert_s"]
        lines.append((f"{pct}%", policy, gc_on,
                      " / ".join(fmt(t["match"]["p50_us"], ".1f") for t in (off, log, on)),
                      " / ".join(fmt(t["insert"]["p50_us"], ".1f") for t in (off, log, on)),
                      " / ".join(f"{t['match_insert_s']:.3f}" for t in (off, log, on)),
                      f"{rows[pct, policy, gc_on, 'log']['paired_cost_pct'][clock]:+.1f}%",
                      f"{r['paired_cost_pct'][clock]:+.1f}%",
                      f"{pub['kv_events_thread_cpu_s']:.2f} ({100 * pub['kv_events_thread_cpu_s'] / base:.0f}%)",
                      f"{pub['kv_events_batches']:,}", f"{pub['kv_events_dropped']:,}"))
    if not lines:
        return ""
    header = ("capacity", "policy", "gc", "match p50 us/1k off/log/on",
              "insert p50 us/1k off/log/on", "match+insert s off/log/on", "log cost*", "on cost*",
              "publisher CPU s (of off)", "batches", "dropped")
    return ("KV events: off, log (the tree's thread records its changes), on (and the publisher's "
            "thread hashes, encodes and sends beside it):\n" + table(header, lines, left=(0, 1, 2))
            + "\n* the median over match and insert calls of the same call's time with events / "
              "without, minus 1; publisher CPU: its thread's CPU time, and its share of the "
              "events-off match + insert time")
