"""benchmarks/attention.py end to end, one repetition: every step of its table, both sides agree."""

import importlib.util
import re
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.bench  # `make test-all` (not `make test`)

ROOT = Path(__file__).resolve().parent.parent


def test_attention_bench_prints_every_step_and_the_sides_agree(capsys):
    from radixcache.attention import paged_cpu

    if paged_cpu.kernel() is None:
        pytest.skip(f"no in-place kernel here: {paged_cpu.unavailable_reason()}")
    spec = importlib.util.spec_from_file_location("attention_bench", ROOT / "benchmarks" / "attention.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    threads = torch.get_num_threads()
    try:
        assert bench.main(["--reps", "1", "--dtypes", "float32", "--shapes", "SmolLM2-135M"]) == 0
    finally:
        torch.set_num_threads(threads)
    printed = capsys.readouterr().out
    rows = [line for line in printed.splitlines() if line.startswith("float32")]
    assert len(rows) == len(bench.cases())
    for line, (name, _, _) in zip(rows, bench.cases()):
        assert name in line
        assert float(re.search(r"\d\.\de-\d\d", line).group()) < 1e-5  # float32: the sides agree
    assert "decode 32 x 2,048" in printed and "in place" in printed and "gather + SDPA" in printed
