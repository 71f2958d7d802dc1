"""Smoke tests: `benchmarks/commit.py --quick --store` and `benchmarks/scheduler.py --quick` run to
completion and print their tables (their numbers are measured, never asserted)."""

import pytest
import json
import subprocess
import sys
from pathlib import Path

pytestmark = pytest.mark.bench  # `make test-all` (not `make test`)

ROOT = Path(__file__).resolve().parent.parent


def run(script, *args):
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_commit_benchmark_quick(tmp_path):
    out = run("commit.py", "--quick", "--store", "--json", str(tmp_path / "c.json"))
    assert "manager us/block" in out and "flatness (cpu clock)" in out and "lock held" in out
    data = json.loads((tmp_path / "c.json").read_text())
    assert [r["context"] for r in data["rows"]] == [1024, 4096]
    assert all(r["manager_us"] > 0 and r["tree_adopt_us"] > 0 for r in data["rows"])
    assert all(r["lock_held_us"] <= r["whole_us"] for r in data["store"])


def test_scheduler_benchmark_quick(tmp_path):
    out = run("scheduler.py", "--quick", "--json", str(tmp_path / "s.json"))
    assert "scheduler p50 ms" in out
    rows = json.loads((tmp_path / "s.json").read_text())
    assert [r["limit"] for r in rows] == ["slots", "memory"]
    assert all(r["scheduler_p50_ms"] > 0 and r["mean_waiting"] > 0 for r in rows)
