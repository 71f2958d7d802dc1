#!/usr/bin/env python
"""How far an fp8 (e4m3) KV cache moves SmolLM2's outputs from an fp32 KV cache, and what it saves.

Model: the embedded SmolLM2-135M-Instruct, fp32, CPU. Wrappers over the same model:
``radixcache.wrap(model, max_cache_tokens=C)`` (KV stored in the model's dtype, fp32: the
reference), ``radixcache.wrap(model, max_cache_tokens=C, kv_dtype="fp8")`` and, as a yardstick for
what "small" drift means, the same with ``kv_dtype="bf16"``. EOS is disabled so every run has
exactly the asked length.

1. First-token logits, per prompt (chat-formatted questions): ``lm.generate(ids, max_new_tokens=1,
   do_sample=False, return_dict_in_generate=True, output_logits=True).logits[0]`` on each wrapper,
   twice: *cold* (nothing cached: the whole prompt is prefilled, and attention already reads the
   K/V back from the pool, so in fp8) and *warm* (the same prompt again: all but its last token are
   served from the cache). Reported: max |fp8 - fp32| (and |bf16 - fp32|) over the vocabulary,
   that relative to the fp32 logits' max |value|, and whether the argmax agrees. The fp32-KV
   wrapper is also checked against the plain model's own forward (it should be ~0).
2. Greedy agreement over G generated tokens (full: 200), all prompts in one
   ``lm.generate_batch(prompts, max_new_tokens=G)`` per wrapper (prompts cached from step 1): the
   first position where the fp8 (bf16) run's token differs from the fp32 run's, the fraction of positions
   that agree up to that first divergence (= first divergence / G), and overall (positionwise,
   including after the runs have diverged, where agreement is mostly by chance).
3. KV bytes per token (``stats()["kv_bytes_per_token"]``) of fp32, bf16 and fp8 KV wrappers, and how
   many tokens each holds in the same byte budget (fp8 holds 2x bf16, 4x fp32).
4. The fp8 scales: calibrated per layer on the first real K/V written (the first prompt's prefill,
   not the wrap-time self-test), their range over layers for K and V, and how many writes of the
   whole run exceeded a layer's calibrated range and were clamped (``stats()["fp8_clamped_writes"]``).

    python benchmarks/fp8_drift.py [--quick] [--json PATH] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.report import fmt, model_label, table  # noqa: E402

HEADER = "radixcache fp8 KV drift benchmark"
QUESTIONS = [
    "What is the capital of France, and what is it famous for?",
    "Write a short poem about the sea at night.",
    "Explain in simple words how a refrigerator keeps food cold.",
    "List three tips for learning a new programming language.",
    "Why is the sky blue? Answer in two sentences.",
    "Summarise the plot of Romeo and Juliet.",
]
FULL = dict(prompts=4, new_tokens=200)
QUICK = dict(prompts=2, new_tokens=24)
FP8 = "fp8 (e4m3)"
COMPARED = ((FP8, "fp8"), ("bf16", "bf16"))  # each against the fp32-KV wrapper; bf16 as a yardstick
BUDGET_BYTES = 1 << 30  # the byte budget for the capacity comparison: 1 GiB
CACHE_TOKENS = 8192  # pool size of each wrapper (enough for every prompt and its generation)


def make_prompts(tokenizer, count: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Chat-formatted questions when there is a tokenizer with a chat template, else random ids."""
    if tokenizer is not None:
        out = []
        for q in QUESTIONS[:count]:
            messages = [{"role": "user", "content": q}]
            if getattr(tokenizer, "chat_template", None):
                ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
                if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                    ids = ids["input_ids"]
            else:
                ids = tokenizer(q)["input_ids"]
            out.append(list(ids))
        return out
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(40 + 7 * i)] for i in range(count)]


def first_logits(lm, prompt: list[int]):
    import torch

    ids = torch.tensor([prompt], device=lm.device)
    out = lm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False,
                      return_dict_in_generate=True, output_logits=True)
    return out.logits[0][0].float()


def divergence(a: list[int], b: list[int]) -> dict:
    """First differing position (len if none), agreement up to it and overall."""
    n = min(len(a), len(b))
    first = next((i for i in range(n) if a[i] != b[i]), n)
    same = sum(1 for i in range(n) if a[i] == b[i])
    return dict(first_divergence=first, agree_until_divergence=first / n if n else 1.0,
                agree_overall=same / n if n else 1.0, length=n)


def run(cfg: dict, load=None, log=lambda msg: None) -> dict:
    """Run the comparison with ``load() -> (model, tokenizer)``; return the report dict."""
    import torch

    import radixcache

    if load is None:
        from radixcache.models import load_model as load
    model, tokenizer = load()
    model.eval()
    model.generation_config.eos_token_id = None  # every run generates exactly the asked length
    prompts = make_prompts(tokenizer, cfg["prompts"], model.config.vocab_size)
    cache_tokens = max(CACHE_TOKENS, 2 * sum(len(p) + cfg["new_tokens"] + 16 for p in prompts))
    ref = radixcache.wrap(model, max_cache_tokens=cache_tokens)
    lms = {name: radixcache.wrap(model, max_cache_tokens=cache_tokens, kv_dtype=kv) for name, kv in COMPARED}

    log("first-token logits ...")
    logit_rows = []
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            plain = model(input_ids=torch.tensor([prompt], device=model.device)).logits[0, -1].float()
        for phase in ("cold", "warm"):  # the first call prefills the prompt, the second hits the cache
            a = first_logits(ref, prompt)
            scale = float(a.abs().max())
            for name, lm in lms.items():
                b = first_logits(lm, prompt)
                diff = float((b - a).abs().max())
                logit_rows.append(dict(kv=name, prompt=i, prompt_tokens=len(prompt), phase=phase,
                                       max_abs_diff=diff, rel_diff=diff / scale if scale else None,
                                       argmax_agree=int(a.argmax()) == int(b.argmax()),
                                       fp32_vs_model=float((a - plain).abs().max())))

    log(f"greedy, {cfg['new_tokens']} tokens ...")
    started = time.perf_counter()
    ref_out = ref.generate_batch(prompts, max_new_tokens=cfg["new_tokens"], do_sample=False)
    greedy_rows, greedy_all = [], {}
    for name, lm in lms.items():
        out = lm.generate_batch(prompts, max_new_tokens=cfg["new_tokens"], do_sample=False)
        rows = [dict(kv=name, prompt=i, **divergence(r[0], o[0]))
                for i, (r, o) in enumerate(zip(ref_out, out))]
        total = sum(r["length"] for r in rows)
        greedy_all[name] = dict(
            first_divergence_min=min(r["first_divergence"] for r in rows),
            agree_until_divergence=sum(r["first_divergence"] for r in rows) / total if total else 1.0,
            agree_overall=sum(r["agree_overall"] * r["length"] for r in rows) / total if total else 1.0)
        greedy_rows += rows
    greedy_s = time.perf_counter() - started

    bytes_rows = []
    wrappers = sorted((("fp32", ref), *lms.items()), key=lambda item: -item[1].stats()["kv_bytes_per_token"])
    for name, lm in wrappers:
        per_token = lm.stats()["kv_bytes_per_token"]
        bytes_rows.append(dict(kv=name, bytes_per_token=per_token,
                               tokens_in_budget=BUDGET_BYTES // per_token))
    by_kv = {r["kv"]: r for r in bytes_rows}
    for r in bytes_rows:
        r["vs_bf16"] = r["tokens_in_budget"] / by_kv["bf16"]["tokens_in_budget"]
    fp8 = lms[FP8]
    pool = fp8.pool
    scales = [pool.host_scales(layer) for layer in range(pool.num_layers)]
    calibration = dict(layers=pool.num_layers, calibrated=pool.calibrated_layers(),
                       k_scale_min=min(k for k, _ in scales), k_scale_max=max(k for k, _ in scales),
                       v_scale_min=min(v for _, v in scales), v_scale_max=max(v for _, v in scales),
                       clamped_writes=fp8.stats()["fp8_clamped_writes"])
    return dict(calibration=calibration, model=model_label(model), device=str(model.device), logits=logit_rows,
                greedy=greedy_rows, greedy_all=greedy_all, greedy_s=greedy_s, bytes=bytes_rows,
                fp8_holds_2x_bf16=by_kv[FP8]["bytes_per_token"] * 2 == by_kv["bf16"]["bytes_per_token"],
                config=cfg, cache_tokens=cache_tokens, threads=torch.get_num_threads(),
                fp8_stats={k: v for k, v in fp8.stats().items() if k in ("fallbacks", "fallback_reasons")},
                fp8_unsupported=fp8.unsupported)


# --------------------------------------------------------------------------- report
def render(report: dict) -> str:
    out = ["first-token logits vs the fp32-KV wrapper (cold: prompt prefilled; warm: prompt served from "
           "the cache)"]
    rows = [(r["kv"], str(r["prompt"]), str(r["prompt_tokens"]), r["phase"], fmt(r["max_abs_diff"], ".4f"),
             fmt(r["rel_diff"], ".2e"), "yes" if r["argmax_agree"] else "NO", fmt(r["fp32_vs_model"], ".1e"))
            for r in report["logits"]]
    out.append(table(("KV dtype", "prompt", "tokens", "phase", "max|dlogit|", "rel. to max|logit|",
                      "argmax =", "fp32 KV vs model"), rows))
    out.append("")
    g = report["config"]["new_tokens"]
    out.append(f"greedy agreement over {g} generated tokens vs the fp32-KV wrapper")
    rows = []
    for name, agg in report["greedy_all"].items():
        for r in report["greedy"]:
            if r["kv"] == name:
                first = r["first_divergence"]
                rows.append((name, str(r["prompt"]), str(first) if first < r["length"] else f"none ({g})",
                             fmt(r["agree_until_divergence"], ".3f"),
                             fmt(r["agree_overall"], ".3f")))
        earliest = agg["first_divergence_min"]
        rows.append((name, "all", f"{earliest} (earliest)" if earliest < g else f"none ({g})",
                     fmt(agg["agree_until_divergence"], ".3f"), fmt(agg["agree_overall"], ".3f")))
    out.append(table(("KV dtype", "prompt", "first divergence", "agree until divergence", "agree overall"),
                     rows))
    out.append("")
    out.append(f"KV bytes per token (stats()['kv_bytes_per_token']) and tokens held in a "
               f"{BUDGET_BYTES / 2**30:.0f} GiB budget")
    rows = [(r["kv"], str(r["bytes_per_token"]), f"{r['tokens_in_budget']:,}", fmt(r["vs_bf16"], ".2f"))
            for r in report["bytes"]]
    out.append(table(("KV dtype", "bytes/token", "tokens in budget", "x bf16"), rows))
    out.append("fp8 holds 2x the tokens of bf16 in the same budget: "
               + ("yes" if report["fp8_holds_2x_bf16"] else "NO"))
    c = report["calibration"]
    out.append("")
    out.append("fp8 scales (one K and one V scale per layer, calibrated on the first real K/V)")
    out.append(table(("layers calibrated", "K scale min..max", "V scale min..max", "clamped writes"),
                     [(f"{c['calibrated']}/{c['layers']}", f"{c['k_scale_min']:.3g}..{c['k_scale_max']:.3g}",
                       f"{c['v_scale_min']:.3g}..{c['v_scale_max']:.3g}", str(c["clamped_writes"]))]))
    if report["fp8_unsupported"] or report["fp8_stats"].get("fallbacks"):
        out.append(f"note: the fp8 wrapper fell back to plain generate ({report['fp8_unsupported']}; "
                   f"{report['fp8_stats']})")
    return "\n".join(out)


def main(argv=None, load=None) -> int:
    """Command line entry; ``load() -> (model, tokenizer)`` replaces the embedded SmolLM2 (tests)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer prompts and tokens, for a smoke test")
    parser.add_argument("--json", metavar="PATH", help="also write the numbers to PATH as JSON")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: every core this process may use)")
    args = parser.parse_args(argv)
    cfg = dict(QUICK if args.quick else FULL)

    import torch

    threads = args.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    started = time.perf_counter()

    def log(msg):
        print(f"[{time.perf_counter() - started:7.1f} s] {msg}", file=sys.stderr, flush=True)

    report = run(cfg, load=load, log=log)
    elapsed = time.perf_counter() - started
    machine = (f"{platform.system()} {platform.machine()}, os.cpu_count()={os.cpu_count()}, "
               f"torch threads={threads}, torch {torch.__version__}")
    print(f"{HEADER}: {report['model']} on {report['device']}" + (" [--quick]" if args.quick else ""))
    print(f"workload: {cfg['prompts']} chat prompts, first-token logits and {cfg['new_tokens']} greedy "
          f"tokens; EOS disabled")
    print(f"machine: {machine}")
    print()
    print(render(report))
    print(f"total run {elapsed:.0f} s")
    if args.json:
        payload = dict(benchmark="fp8_drift", machine=machine, elapsed_s=elapsed, **report)
        Path(args.json).write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
