"""benchmarks/agent_loop.py end to end on a tiny random Llama: every system matches plain generate."""

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch
import transformers

from tiny_models import tiny_model

pytestmark = pytest.mark.bench  # `make test-all` (not `make test`)

ROOT = Path(__file__).resolve().parent.parent


def load_bench():
    spec = importlib.util.spec_from_file_location("agent_loop_bench", ROOT / "benchmarks" / "agent_loop.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(spec.name, None)
        raise
    return module


@pytest.fixture
def keep_threads(monkeypatch):
    """main() sets OMP_NUM_THREADS and torch's thread count; put both back afterwards."""
    threads = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", str(threads)))
    yield
    torch.set_num_threads(threads)


def test_agent_loop_tiny_llama_matches_plain_and_prints_tables(tmp_path, capsys, keep_threads):
    bench = load_bench()
    tiny = bench.Config(system_tokens=40, user_tokens=8, new_tokens=4, linear_turns=3,
                        branching_turns=2, conversations=3, interleaved_turns=2)
    floor = bench.ttft_floor.FloorConfig(aligned=48, unaligned=45, new=6, repeats=2)
    out = tmp_path / "agent_loop.json"

    def loader():
        model = tiny_model("llama")
        model.generation_config.eos_token_id = 2  # the benchmark must disable it itself
        return model, None

    assert bench.main(["--threads", "1", "--json", str(out)], load_model=loader, config=tiny,
                      floor_config=floor) == 0
    printed = capsys.readouterr().out

    assert "radixcache agent_loop benchmark" in printed
    for title in ("[linear]", "[branching]", "[interleaved]", "summary", "targets"):
        assert title in printed
    assert "TTFT ms a" in printed and "= a? b c d" in printed
    summary_header = next(line for line in printed.splitlines() if line.startswith("variant "))
    for column in ("TTFT hit ms", "decode tok/s", "total s", "peak KV MiB", "hit rate", "greedy = (a)"):
        assert column in summary_header

    payload = json.loads(out.read_text())
    cb_available = hasattr(transformers.LlamaForCausalLM, "generate_batch")
    expected_calls = {"linear": 3, "branching": 4, "interleaved": 6}
    for variant in payload["variants"]:
        runs = variant["runs"]
        n = expected_calls[variant["name"]]
        plain = runs["a"]["calls"]
        assert len(plain) == n
        assert all(len(c["tokens"]) == tiny.new_tokens for c in plain)
        for key in ("b", "c", "d"):
            if key == "c" and not cb_available:
                assert runs[key]["status"].startswith(("skipped", "failed"))
                continue
            assert runs[key]["status"] == "ok", (variant["name"], key, runs[key]["status"])
            calls = runs[key]["calls"]
            assert [c["tokens"] for c in calls] == [c["tokens"] for c in plain], (variant["name"], key)
            assert all(c["match"] for c in calls)
            assert all(c["ttft_s"] > 0 and c["total_s"] >= c["ttft_s"] for c in calls)
        # the shared system prompt is served from cache after the first call
        d = runs["d"]["calls"]
        assert d[0]["hit_tokens"] == 0 and all(c["hit_tokens"] > 0 for c in d[1:])
        assert 0 < runs["d"]["hit_rate"] < 1
        if cb_available:  # CB shares whole blocks only; radixcache also reuses partial last blocks
            pairs = zip(runs["c"]["calls"], d)
            assert all(rc["hit_tokens"] >= cb["hit_tokens"] for cb, rc in pairs)
        assert variant["summary"]["d"]["peak_kv_bytes"] > 0

    # the floor rows: the cached turn computes only its new tokens, the partial tail included
    assert "TTFT floor ms" in printed
    rows = {r["kind"]: r for r in payload["floor"]}
    assert rows["aligned"]["cached"] == 48 and rows["unaligned"]["cached"] == 45
    assert rows["aligned"]["computed"] == rows["unaligned"]["computed"] == 6
    assert all(r["radix_ms"] > 0 and r["floor_ms"] > 0 and len(r["radix_s"]) == 2 for r in rows.values())
