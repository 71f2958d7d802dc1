"""Smoke test: `benchmarks/tree_ops.py --quick` runs to completion and prints its table."""

import pytest
import json
import subprocess
import sys
from pathlib import Path

pytestmark = pytest.mark.bench  # `make test-all` (not `make test`)

ROOT = Path(__file__).resolve().parent.parent


def test_tree_ops_quick_prints_table(tmp_path):
    out = tmp_path / "tree_ops.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "tree_ops.py"), "--quick", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "radixcache tree_ops benchmark" in result.stdout
    header = next(line for line in result.stdout.splitlines() if line.startswith("bs "))
    for column in ("operation", "radixcache us", "sha256-chain us", "xxh3-chain us", "target us", "met?"):
        assert column in header
    rows = json.loads(out.read_text())["rows"]
    assert {(r["block_size"], r["operation"].split()[0]) for r in rows} == {
        (bs, op) for bs in (1, 16) for op in ("insert", "match", "evict")}
    assert all(r["radixcache_us"] > 0 for r in rows)
