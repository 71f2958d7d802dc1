"""The trace replay benchmark: its trace loader and agent-trace generator, the ideal hit rate it
compares against, and a bounded ``--quick`` run end to end (on a small Mooncake-format file and the
generator)."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.trace_replay import completion_s, events, ideal  # noqa: E402
from benchmarks.traces import (  # noqa: E402
    PAGE_TOKENS, QUICK_AGENT_PARAMS, agent_trace, describe, load_mooncake,
)

pytestmark = pytest.mark.bench  # `make test-all` (not `make test`)


def write_trace(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


MOONCAKE = [  # three requests: B shares A's first page, C repeats A's whole prompt
    {"timestamp": 0, "input_length": 1200, "output_length": 10, "hash_ids": [7, 8, 9]},
    {"timestamp": 500, "input_length": 700, "output_length": 5, "hash_ids": [7, 3]},
    {"timestamp": 2000, "input_length": 1200, "output_length": 1, "hash_ids": [7, 8, 9]},
]


def test_mooncake_loader_chains_pages_and_makes_distinct_tokens(tmp_path):
    trace = load_mooncake(write_trace(tmp_path / "t.jsonl", MOONCAKE))
    assert len(trace) == 3 and not trace.has_sessions
    assert trace.arrival_s.tolist() == [0.0, 0.5, 2.0]
    assert trace.insert_len.tolist() == trace.input_len.tolist() == [1200, 700, 1200]
    pages = [trace.pages[trace.page_start[i]:trace.page_start[i + 1]].tolist() for i in range(3)]
    assert pages[0] == pages[2] and pages[1][0] == pages[0][0] and pages[1][1] not in pages[0]
    a, b = trace.tokens(0, 1200), trace.tokens(1, 700)
    assert a.dtype == np.uint32 and len(a) == 1200 and len(set(a.tolist())) == 1200
    assert (a[:PAGE_TOKENS] == b[:PAGE_TOKENS]).all() and not set(a[PAGE_TOKENS:]) & set(b[PAGE_TOKENS:])
    assert trace.page_lengths(0, 1200).tolist() == [512, 512, 176]


def test_ideal_is_an_unbounded_cache_in_event_order(tmp_path):
    """B arrives before A finishes (nothing is cached yet); C finds all of A, block-aligned."""
    trace = load_mooncake(write_trace(tmp_path / "t.jsonl", MOONCAKE))
    hits, working_set = ideal(trace, 16, events(trace, completion_s(trace, decode_rate=10.0)))
    assert hits.tolist() == [0, 0, 1200 // 16 * 16]
    assert working_set == 1200 // 16 + 700 // 16 - 32  # B's first page is A's
    hits, _ = ideal(trace, 16, events(trace, completion_s(trace, decode_rate=1000.0)))
    assert hits.tolist() == [0, 512, 1200 // 16 * 16]


@pytest.mark.parametrize("record, what", [
    ({"timestamp": 0, "input_length": 1200, "output_length": 1}, "hash_ids"),
    ({"timestamp": 0, "input_length": 1200, "output_length": 1, "hash_ids": [1]}, "1 hash ids"),
    ("not json", "not a Mooncake"),
])
def test_mooncake_loader_names_the_bad_line(tmp_path, record, what):
    path = tmp_path / "bad.jsonl"
    bad = record if isinstance(record, str) else json.dumps(record)
    path.write_text(json.dumps(MOONCAKE[0]) + "\n" + bad)
    with pytest.raises(ValueError, match=f"bad.jsonl:2: .*{what}|bad.jsonl:2: {what}"):
        load_mooncake(str(path))


def test_agent_trace_is_deterministic_and_calibrated():
    """Same parameters, same trace; sessions grow turn by turn from a shared preamble; every turn's
    prompt starts with the previous turn's prompt and output; the printed ratios are measured."""
    one, two = agent_trace(50.0, QUICK_AGENT_PARAMS), agent_trace(50.0, QUICK_AGENT_PARAMS)
    assert (one.pages == two.pages).all() and (one.arrival_s == two.arrival_s).all()
    assert one.has_sessions and (np.diff(one.arrival_s) >= 0).all()
    pre = QUICK_AGENT_PARAMS["preamble_tokens"]
    for s in range(QUICK_AGENT_PARAMS["sessions"]):
        turns = np.flatnonzero(one.session == s)
        assert one.continues[turns].tolist() == [True] * (len(turns) - 1) + [False]
        for a, b in zip(turns, turns[1:]):
            done = int(one.insert_len[a])
            assert one.input_len[b] > done
            assert (one.tokens(a, done) == one.tokens(b, done)).all()
        assert (one.tokens(turns[0], pre) == one.tokens(0, pre)).all()  # the shared preamble
    info = describe(one)
    assert info["sessions"] == QUICK_AGENT_PARAMS["sessions"] and 50 < info["input:output"] < 400


def test_quick_replay_runs_end_to_end(tmp_path):
    """`--quick` on a Mooncake-format file and the generator: tables for every capacity, LRU only on
    the trace without sessions, LRU and retention on the agent trace, the 100% run equal to the
    ideal (the script fails otherwise), memory samples, and the JSON numbers."""
    trace = write_trace(tmp_path / "m.jsonl", MOONCAKE * 40)
    out = tmp_path / "replay.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "trace_replay.py"), "--quick", "--trace", trace,
         "--json", str(out), "--gc", "both"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "== m.jsonl" in result.stdout and "== synthetic agent trace" in result.stdout
    assert "retention - lru hit rate: 1%:" in result.stdout
    assert result.stdout.count("through CacheManager") == 2
    results = json.loads(out.read_text())
    mooncake, agent = results
    assert {(r["capacity_pct"], r["policy"], r["gc"]) for r in mooncake["rows"]} == {
        (pct, "lru", gc) for pct in (1, 5, 20, 100) for gc in ("on", "off")}
    assert {r["policy"] for r in agent["rows"]} == {"lru", "retention"}
    assert {(r["capacity_pct"], r["policy"]) for r in agent["manager_rows"]} == {
        (pct, policy) for pct in (1, 5, 20, 100) for policy in ("lru", "retention")}
    for res in results:
        ideal = res["rows"][0]["ideal_hit_rate"]
        assert all(0 < r["hit_rate"] <= ideal + 1e-12 for r in res["manager_rows"])
        full = [r for r in res["rows"] if r["capacity_pct"] == 100]
        assert all(r["hit_rate"] == r["ideal_hit_rate"] for r in full)
        assert all(r["hit_rate"] <= r["ideal_hit_rate"] + 1e-12 for r in res["rows"])
        assert any(r["memory"] for r in full)
        for r in res["rows"]:
            for clock in ("wall", "cpu"):
                assert r["timings"][clock]["worst"]["ms"] > 0


def test_quick_replay_with_kv_events_compares_off_log_and_on(tmp_path):
    """`--kv-events`: every row replayed with events off, logged and published, the same hits, the
    side-by-side table, and a publisher that sent batches and dropped nothing."""
    trace = write_trace(tmp_path / "m.jsonl", MOONCAKE * 40)
    out = tmp_path / "replay.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "trace_replay.py"), "--quick", "--trace", trace,
         "--no-agent", "--capacities", "5,100", "--kv-events", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "KV events: off, log" in result.stdout
    rows = json.loads(out.read_text())[0]["rows"]
    assert [(r["capacity_pct"], r["kv_events"]) for r in rows] == [
        (pct, e) for pct in (5, 100) for e in ("off", "log", "on")]
    for pct in (5, 100):
        hits = {r["hit_tokens"] for r in rows if r["capacity_pct"] == pct}
        assert len(hits) == 1  # events never change what the tree does
    published = [r for r in rows if r["kv_events"] == "on"]
    assert all(r["publisher"]["kv_events_batches"] > 0 for r in published)
    assert all(r["publisher"]["kv_events_dropped"] == 0 for r in published)
