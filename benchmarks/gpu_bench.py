#!/usr/bin/env python
"""GPU benchmark: radixcache ``generate_batch`` with attention="torch" vs attention="flashinfer".

Workload (seeded): a random Llama-like model in bf16 (default 8 layers, hidden 1024, 8 query heads /
2 KV heads of 128, vocab 32,000; about 150M parameters, random weights), a 1,000-token shared
system prompt, 32 requests = system prompt + 100 unique tokens, 32 greedy tokens each, all submitted
to one ``generate_batch`` call (continuous batching: the system prompt is computed once and shared
through the radix tree).

For each backend, on its own wrapper (own pool and tree): one small warm-up call (FlashInfer
JIT-compiles its kernels on first use; that time is reported separately as ``warmup_s``), ``clear()``,
then the timed call from a cold cache. Reported per backend:

- ``gen_tok_s``: generated tokens / wall time of the call; ``step_tok_s``: every token the
  forwards computed (uncached prompt tokens + generated) / wall time;
- ``ttft_p50_ms`` / ``ttft_p90_ms``: time from the call's start to each request's first token;
- ``generate_ttft_ms``: the drop-in path: TTFT of one ``lm.generate`` turn whose system prompt is
  cached (it reads the block tables through the same backend);
- ``hit_rate``: prompt tokens served from the cache / prompt tokens admitted.

And one direct forward through each backend on the same blocks (a mixed prefill step of four
sequences, then a pure-decode step of one token each): ``max |logit diff|`` flashinfer vs torch for
both steps, next to the torch backend vs the model's own attention (HF, no cache) on the prefill as
the bf16 noise floor. Nothing asserts on numbers; the script fails only if a call fails or leaks.

    python benchmarks/gpu_bench.py [--out DIR] [--backends torch,flashinfer] [--device cuda] ...

Results go to ``DIR/gpu_bench.json`` (``DIR`` defaults to ``$OUT`` when set).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import radixcache  # noqa: E402
from benchmarks.measure import timed_generate, timed_stream  # noqa: E402
from radixcache.attention import Segment, StepPlan  # noqa: E402


def parse_args(argv=None):
    """Command-line options (defaults: the workload described in the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backends", default="torch,flashinfer")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--system", type=int, default=1000, help="shared system-prompt tokens")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--unique", type=int, default=100, help="unique tokens per request")
    p.add_argument("--new", type=int, default=32, help="generated tokens per request")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.environ.get("OUT"), help="directory for gpu_bench.json")
    return p.parse_args(argv)


def build_model(args, device, dtype):
    """A random-weight ``LlamaForCausalLM`` of the requested shape on ``device`` in ``dtype``."""
    import transformers

    torch.manual_seed(args.seed)
    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, max_position_embeddings=4096)
    model = transformers.LlamaForCausalLM(config).to(device, dtype).eval()
    model.generation_config.eos_token_id = None  # every request generates exactly --new tokens
    model.generation_config.pad_token_id = 0
    return model


def sync(device):
    """Wait for the device's queued work (so that wall times cover it)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_backend(model, attention, prompts, warm_prompts, args, device):
    """Warm up, then time one cold-cache generate_batch call and one cached generate turn;
    returns (row dict, outputs, lm)."""
    need = sum(len(p) + args.new for p in prompts) + 64 * len(prompts)
    lm = radixcache.wrap(model, attention=attention, max_cache_tokens=max(need, 4096))
    t0 = time.perf_counter()
    lm.generate_batch(warm_prompts, max_new_tokens=4)
    sync(device)
    warmup = time.perf_counter() - t0
    lm.clear()
    lm.reset_stats()
    engine = lm.new_engine()
    sync(device)
    outputs, first, wall = timed_stream(lm.generate_batch(prompts, max_new_tokens=args.new,
                                                          stream=True, engine=engine))
    sync(device)
    hit_rate = lm.stats()["hit_rate"]
    # the drop-in path: a cached turn (the system prompt is in the tree now) through lm.generate
    turn = torch.tensor([prompts[0][:args.system] + prompts[-1][args.system:][::-1]], device=device)
    _, _, gen_ttft, _ = timed_generate(lm.generate, turn, max_new_tokens=4, do_sample=False)
    leaks = lm.cache.leaks()
    if leaks:
        raise SystemExit(f"{attention}: leaked cache state: {leaks}")
    lm.clear()
    if lm.manager.allocator.num_free != lm.manager.allocator.num_blocks:
        raise SystemExit(f"{attention}: blocks leaked after clear()")
    ttft = sorted(first.values())
    generated = sum(len(o[0]) for o in outputs)
    row = {
        "backend": lm.backend.name,
        "wall_s": wall,
        "warmup_s": warmup,
        "generated_tokens": generated,
        "computed_tokens": engine.metrics.step_tokens,
        "gen_tok_s": generated / wall,
        "step_tok_s": engine.metrics.step_tokens / wall,
        "ttft_p50_ms": 1000 * statistics.median(ttft),
        "ttft_p90_ms": 1000 * ttft[min(len(ttft) - 1, math.ceil(0.9 * len(ttft)) - 1)],
        "generate_ttft_ms": 1000 * gen_ttft,
        "hit_rate": hit_rate,
        "steps": engine.metrics.steps,
    }
    return row, outputs, lm


def one_forward(lm, seqs):
    """Logits of a mixed prefill step over fresh blocks, then of a pure-decode step (one more
    token per sequence, the next token of ``seq[::-1]``), through the wrapper's runner and
    backend; blocks are released afterwards."""
    bs = lm.block_size
    allocator = lm.manager.allocator
    tables = [allocator.allocate(math.ceil((len(s) + 1) / bs)) for s in seqs]
    try:
        results = []
        for step in ("prefill", "decode"):
            ids, pos, segments, last = [], [], [], []
            for s, blocks in zip(seqs, tables):
                new = s if step == "prefill" else [s[-2]]
                start = 0 if step == "prefill" else len(s)
                segments.append(Segment(len(ids), len(new), start + len(new), tuple(blocks)))
                ids += new
                pos += range(start, start + len(new))
                last.append(len(ids) - 1)
            plan = StepPlan(lm.pool, segments, lm.backend)
            rows = list(range(len(ids))) if step == "prefill" else last
            results.append(lm.runner.forward(ids, pos, plan, rows))
        return results
    finally:
        for blocks in tables:
            allocator.release(blocks)


def logit_diffs(lms, seqs):
    """max |logit diff| flashinfer vs torch (prefill and decode steps), torch vs HF (prefill)."""
    logits = {name: one_forward(lm, seqs) for name, lm in lms.items()}
    out = {}
    if "torch" in logits:
        lm = lms["torch"]
        with torch.no_grad():
            hf = torch.cat([lm.model(input_ids=torch.tensor([s], device=lm.device)).logits[0].float()
                            for s in seqs])
        out["torch_vs_hf_prefill"] = float((logits["torch"][0] - hf).abs().max())
    if "torch" in logits and "flashinfer" in logits:
        for i, step in enumerate(("prefill", "decode")):
            d = (logits["flashinfer"][i] - logits["torch"][i]).abs().max()
            out[f"flashinfer_vs_torch_{step}"] = float(d)
    return out


def main(argv=None) -> int:
    """Run the benchmark, print the table, write ``gpu_bench.json``; 0 on success."""
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    backends = [b for b in args.backends.split(",") if b]
    rng = random.Random(args.seed)
    tok = lambda n: [rng.randrange(1, args.vocab) for _ in range(n)]  # noqa: E731
    system = tok(args.system)
    prompts = [system + tok(args.unique) for _ in range(args.requests)]
    warm_prompts = [tok(40) + tok(n) for n in (3, 20)] + [tok(17)]
    model = build_model(args, device, dtype)
    env = {"torch": torch.__version__, "python": platform.python_version(), "device": str(device),
           "dtype": args.dtype}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    try:
        import flashinfer

        env["flashinfer"] = flashinfer.__version__
    except ImportError:
        env["flashinfer"] = None
    print(f"radixcache gpu benchmark: {env}")
    print(f"model: {args.layers} layers, hidden {args.hidden}, {args.heads}/{args.kv_heads} heads, "
          f"vocab {args.vocab}; workload: {args.requests} x ({args.system} shared + {args.unique} "
          f"unique) prompt tokens, {args.new} new tokens each")

    rows, outputs, lms = [], {}, {}
    for attention in backends:
        row, outputs[attention], lms[attention] = run_backend(model, attention, prompts, warm_prompts,
                                                              args, device)
        rows.append(row)
    cols = ["backend", "gen_tok_s", "step_tok_s", "ttft_p50_ms", "ttft_p90_ms", "generate_ttft_ms",
            "wall_s", "warmup_s", "hit_rate", "steps"]
    print("\n" + "  ".join(f"{c:>12}" for c in cols))
    for r in rows:
        print("  ".join(f"{r[c]:>12.4g}" if isinstance(r[c], float) else f"{r[c]:>12}" for c in cols))

    result = {"env": env, "args": vars(args), "rows": rows}
    if "torch" in outputs and "flashinfer" in outputs:
        pairs = [(a, b) for r, g in zip(outputs["torch"], outputs["flashinfer"])
                 for a, b in zip(r[0], g[0])]
        result["greedy_token_agreement"] = sum(a == b for a, b in pairs) / len(pairs)
        print(f"\ngreedy token agreement flashinfer vs torch: {result['greedy_token_agreement']:.1%}")
    seqs = [prompts[0], prompts[1][-300:], tok(57), tok(16)]
    result["max_abs_logit_diff"] = logit_diffs(lms, seqs)
    for name, value in result["max_abs_logit_diff"].items():
        print(f"max |logit diff| {name}: {value:.4g}")
    for lm in lms.values():
        if lm.manager.allocator.num_free != lm.manager.allocator.num_blocks:
            raise SystemExit("blocks leaked by the one-forward comparison")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        path = Path(args.out) / "gpu_bench.json"
        path.write_text(json.dumps(result, indent=2))
        print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
