"""The fault campaign and the soak (``benchmarks/faults.py``, ``benchmarks/soak.py``) run, in small
sizes, to their tables: every fault isolated (0 failed, 0 leaked, 0 wrong), the soak clean."""

import pytest
import json
import subprocess
import sys
from pathlib import Path

pytestmark = pytest.mark.bench  # `make test-all` (not `make test`)

ROOT = Path(__file__).resolve().parent.parent


def run(script, *args, timeout=600):
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def test_the_in_process_faults_stay_with_their_requests(tmp_path):
    out = tmp_path / "faults.json"
    result = run("faults.py", "--sessions", "2", "--turns", "2", "--storm", "4", "--json", str(out),
                 "--faults", "forward raises,NaN logits,disconnect storm,full pool")
    assert result.returncode == 0, result.stdout + result.stderr
    rows = {r["fault"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"forward raises", "NaN logits", "disconnect storm", "full pool"}
    for row in rows.values():
        assert row["failed"] == row["leaked"] == row["wrong"] == 0 and row["checked"] == row["bystanders"] > 0
    assert rows["NaN logits"]["reported"] == rows["NaN logits"]["faulty"] == 8
    assert rows["forward raises"]["reported"] == 8


def test_a_short_soak_is_clean(tmp_path):
    out = tmp_path / "soak.json"
    result = run("soak.py", "--minutes", "0.25", "--sessions", "5", "--json", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert not report["errors"] and report["dropped"] > 0 and all(report["requests"].values())
    assert report["left"]["num_used_tokens"] == 0
