"""benchmarks/cpu_step.py end to end on a tiny random Llama: both sides run, float32 tokens agree."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from tiny_models import tiny_model

pytestmark = pytest.mark.bench  # `make test-all` (not `make test`)

ROOT = Path(__file__).resolve().parent.parent


def load_bench():
    spec = importlib.util.spec_from_file_location("cpu_step_bench", ROOT / "benchmarks" / "cpu_step.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cpu_step_prints_its_table_and_the_sides_agree(tmp_path, capsys):
    bench = load_bench()
    threads = torch.get_num_threads()
    out = tmp_path / "rows.json"
    try:
        status = bench.main(["--dtypes", "float32", "--contexts", "40", "70", "--new", "4", "--reps", "2",
                             "--json", str(out)], load=lambda dtype: tiny_model("llama"))
    finally:
        torch.set_num_threads(threads)
    assert status == 0
    printed = capsys.readouterr().out
    assert "cold plain ms" in printed and "decode radixcache tok/s" in printed
    rows = json.loads(out.read_text())
    assert [r["context"] for r in rows] == [40, 70]
    for row in rows:
        assert row["same"] == row["calls"] == 4  # float32: every timed call's tokens are equal
        assert row["cold_plain_s"] > 0 and row["decode_radixcache_tps"] > 0


def test_cpu_step_times_the_server_beside_lm_generate(tmp_path, capsys):
    from serve_helpers import write_model_dir

    bench = load_bench()
    model_dir = write_model_dir(tmp_path / "model", weights=True)
    threads = torch.get_num_threads()
    out = tmp_path / "rows.json"
    try:
        status = bench.main(["--model", str(model_dir), "--dtypes", "float32", "--contexts", "40",
                             "--new", "4", "--reps", "2", "--serve", "--json", str(out)])
    finally:
        torch.set_num_threads(threads)
    assert status == 0
    assert "decode server tok/s" in capsys.readouterr().out
    (row,) = json.loads(out.read_text())
    assert len(row["decode_server_all"]) == 2  # one streamed decode per repetition
    assert all(rate is not None and rate > 0 for rate in row["decode_server_all"])  # seeded: no early EOS
