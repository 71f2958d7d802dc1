"""Smoke tests: benchmarks/batch.py and benchmarks/fp8_drift.py run end to end on a tiny random Llama
(built from a LlamaConfig, no downloads) and print their tables. Nothing here checks timings."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
import transformers as tf

pytestmark = pytest.mark.bench  # `make test-all` (not `make test`)

ROOT = Path(__file__).resolve().parent.parent


def _load_script(name):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


batch = _load_script("batch")
fp8_drift = _load_script("fp8_drift")


def tiny_llama():
    """(model, tokenizer) for the injectable loaders: a deterministic tiny fp32 Llama, no tokenizer."""
    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                            initializer_range=0.2)
    model = tf.LlamaForCausalLM(config).eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model, None


TINY_BATCH = dict(requests=4, system_tokens=40, unique_tokens=8, new_tokens=4, samples=2,
                  temperature=0.8, repeats=1, cb_repeats=1, cb_greedy=4, cb_sampled=2,
                  plain_greedy=2, plain_sampled=1, floor_requests=3, floor_new_tokens=3,
                  sched_systems=2, sched_per_system=3, sched_system_tokens=48,
                  sched_unique_tokens=8, sched_new_tokens=2, sched_cache_prompts=1.5,
                  decode_floor=((3, 48),), decode_floor_steps=3,
                  decode_floor_rounds=2)


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_ideal_blocks_formula():
    # the workload: 62 shared blocks + 32 x 9 own blocks (1,131 stored tokens end in block 71)
    assert batch.ideal_blocks(1000, 100, 32, 32, 1) == 62 + 32 * 9
    # n=4: 6 whole prompt blocks per request once, then 3 blocks per sample (positions 1088..1130)
    assert batch.ideal_blocks(1000, 100, 32, 32, 4) == 62 + 32 * 6 + 32 * 4 * 3
    assert batch.ideal_blocks(32, 0, 1, 1, 1) == 2  # block-aligned: nothing partial to add


def test_batch_core_runs_and_prints_tables():
    """Every system runs; radixcache's greedy tokens equal plain generate's and the floor's; the
    shared system prompt is hit; peak blocks stay within the ideal's slack; both policies run."""
    report = batch.run(TINY_BATCH, load=tiny_llama)
    text = batch.render(report)
    header = text.splitlines()[0]
    for column in batch.COLUMNS:
        assert column in header
    for system in ("radixcache generate_batch", "transformers CB generate_batch", "plain generate"):
        assert text.count(system) >= 2  # greedy and n=2 sampled
    assert "floor" in text and "overhead ms/step" in text and "fcfs" in text
    greedy, sampled = report["modes"]
    assert greedy["ideal_blocks"] == batch.ideal_blocks(40, 8, 4, 4, 1)
    rc = greedy["radixcache"]
    assert rc["generated"] == 4 * 4 and sampled["radixcache"]["generated"] == 4 * 2 * 4
    assert greedy["cb"]["generated"] == 4 * 4 and sampled["cb"]["generated"] == 2 * 2 * 4
    assert 0 < rc["peak_blocks"] <= batch.PEAK_SLACK * greedy["ideal_blocks"]
    assert rc["hit_rate"] >= 3 * 32 / (4 * 48)  # three prompts hit the system prompt's 2 blocks
    same, compared = greedy["agreement"]["radixcache_vs_plain"]
    assert compared == 2 and same == compared
    floor = report["floor"]
    assert floor["same_tokens"] and floor["steps"] >= 3 and floor["radix_overhead_ms"] >= 0
    assert floor["radix_forward_ms"] > 0 and floor["floor_decode_step_ms"] > 0
    assert {r["schedule"] for r in report["schedulers"]} == {"lpm", "fcfs"}
    assert all(r["generated"] == 6 * 2 for r in report["schedulers"])
    (decode,) = report["decode_floor"]
    assert "decode floor" in text and decode["same_tokens"] and decode["fallbacks"] == 0
    assert (decode["sequences"], decode["context"]) == (3, 48) and decode["ratio"] > 0
    assert len(decode["round_ratios"]) == 2 and decode["ratio"] in decode["round_ratios"]


def test_batch_main_quick_writes_json(tmp_path, capsys):
    out = tmp_path / "batch.json"
    # --quick sizes, shrunk further so the tiny model stays well under the time budget
    quick = dict(batch.QUICK)
    try:
        batch.QUICK.update(requests=3, system_tokens=32, unique_tokens=4, new_tokens=2, samples=2,
                           cb_greedy=3, cb_sampled=2, plain_greedy=1, plain_sampled=1,
                           floor_requests=2, floor_new_tokens=2, sched_systems=2,
                           sched_per_system=2, sched_system_tokens=32, sched_unique_tokens=4,
                           decode_floor=((2, 32),), decode_floor_steps=2,
                           decode_floor_rounds=1)
        assert batch.main(["--quick", "--threads", "1", "--json", str(out)], load=tiny_llama) == 0
    finally:
        batch.QUICK.clear()
        batch.QUICK.update(quick)
    printed = capsys.readouterr().out
    assert batch.HEADER in printed and "[--quick]" in printed and "ideal blocks" in printed
    payload = json.loads(out.read_text())
    assert payload["benchmark"] == "batch" and len(payload["modes"]) == 2
    assert payload["floor"]["same_tokens"] is True and payload["floor"]["ratio"] > 0


def test_fp8_drift_core_runs_and_prints_tables(tmp_path, capsys):
    out = tmp_path / "fp8.json"
    quick = dict(fp8_drift.QUICK)
    try:
        fp8_drift.QUICK.update(prompts=2, new_tokens=6)
        assert fp8_drift.main(["--quick", "--threads", "1", "--json", str(out)], load=tiny_llama) == 0
    finally:
        fp8_drift.QUICK.clear()
        fp8_drift.QUICK.update(quick)
    printed = capsys.readouterr().out
    assert fp8_drift.HEADER in printed
    for title in ("first-token logits", "greedy agreement over 6", "KV bytes per token"):
        assert title in printed
    report = json.loads(out.read_text())
    by_kv = {r["kv"]: r for r in report["bytes"]}
    assert by_kv["fp32"]["bytes_per_token"] == 2 * by_kv["bf16"]["bytes_per_token"]
    assert by_kv["bf16"]["bytes_per_token"] == 2 * by_kv["fp8 (e4m3)"]["bytes_per_token"]
    assert report["fp8_holds_2x_bf16"] is True
    assert {r["kv"] for r in report["greedy"]} == {"fp8 (e4m3)", "bf16"}
    assert all(0.0 <= r["agree_overall"] <= 1.0 for r in report["greedy"])
    assert all(r["fp32_vs_model"] < 1e-3 for r in report["logits"])  # fp32 KV = the model
    assert "fp8 scales" in printed
    c = report["calibration"]
    assert c["calibrated"] == c["layers"] == 2 and 0 < c["k_scale_min"] <= c["k_scale_max"]
    assert all(r["argmax_agree"] for r in report["logits"] if r["kv"] == "bf16")
