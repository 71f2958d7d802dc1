"""Smoke test: `benchmarks/store.py --quick` runs against its own redis-server and prints its tables."""

import pytest
import json
import subprocess
import sys
from pathlib import Path

from redis_servers import redis_binary

pytestmark = pytest.mark.bench  # `make test-all` (not `make test`)

ROOT = Path(__file__).resolve().parent.parent


def test_store_bench_quick_prints_tables(tmp_path):
    redis_binary()
    redis_binary("redis-benchmark")
    out = tmp_path / "store.json"
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "store.py"), "--quick",
                             "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    text = result.stdout
    assert "radixcache store benchmark (quick)" in text
    assert "redis-benchmark -h 127.0.0.1 -p PORT -t get -d 737475 -c 1 -P 16" in text
    assert "target: store.fetch >= 50% of redis-benchmark" in text
    data = json.loads(out.read_text())
    assert data["value_bytes"] == 737_475  # the SmolLM2 fp32 block: 737,280 B of K/V + header
    paths = [r["path"] for r in data["rows"]]
    assert paths[:3] == ["memory copy (numpy)", "TCP loopback (socket, no Redis)",
                         "redis-benchmark -t get -P 16"]
    assert "store.fetch (verified)" in paths and "store.fetch + KVPool.import_block" in paths
    assert all(r["bytes_per_s"] > 0 for r in data["rows"])
    bench = next(r for r in data["rows"] if r["path"] == "redis-benchmark -t get -P 16")
    assert bench["share_of_redis_benchmark"] == 1.0
    assert [m["bytes_per_token"] for m in data["per_model"]] == [46_080, 131_072, 65_536, 4_997_120]  # MLA: the expanded K/V the pool holds
    assert isinstance(data["target_met"], bool)


def test_store_ttft_quick_gives_the_same_token_and_hits_the_store(tmp_path):
    """The cold-process TTFT benchmark's quick mode on the embedded model: the warm-store side
    loads the whole prefix from Redis (and the script checks the first token is the same)."""
    redis_binary()
    out = tmp_path / "ttft.json"
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "store_ttft.py"), "--quick",
                             "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "radixcache store TTFT benchmark (quick)" in result.stdout
    data = json.loads(out.read_text())
    assert data["bytes_per_token"] == 46_080
    (row,) = data["rows"]
    assert row["prefix"] == 256 and row["store_hit_tokens"] == row["mac_hit_tokens"] == 256
    assert row["recompute_s"] > 0 and row["store_s"] > 0 and row["mac_s"] > 0
