#!/usr/bin/env python
"""A cold process with a warm store: TTFT from Redis against recomputing the prefix.

On the embedded SmolLM2-135M (fp32 KV: 46,080 B per token), for prefixes of 1k, 2k and 4k tokens
followed by a 16-token question: a throwaway redis-server on loopback is warmed once by one
wrapper (``wrap(model, store=URL)``, one ``generate``, ``close()``). Then, in rounds, two cold
wrappers (model loaded, local tree empty) each time one ``generate`` call to its first token:

- ``recompute``: no store, the whole prompt is prefilled;
- ``warm store``: ``store=URL``, the prefix's whole blocks are fetched, verified and imported
  (``CacheManager.prefetch``), then only the rest is prefilled;
- ``warm store + MAC``: the same with a store secret (``?secret_file=``): every block written
  carries a keyed BLAKE3 MAC, checked on every read.

All give the same greedy token (checked). Targets: at 2k tokens, warm store TTFT at least 10x
lower; the MAC moves the warm-hit TTFT by at most 5 %. The last table turns the measured rates
into the break-even: loading beats recomputing while KV bytes per token stay below (store read rate) / (prefill rate); how a model compares
depends on its bytes per token (``radixcache kv-size``) and on how fast its device prefills.

    python benchmarks/store_ttft.py [--quick] [--reps R] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import radixcache  # noqa: E402
from benchmarks.measure import random_ids, timed_generate  # noqa: E402
from benchmarks.report import fmt, median, table  # noqa: E402
from radixcache.integrations.redis_store.local import LocalRedis  # noqa: E402
from radixcache.models import load_model  # noqa: E402

HEADER = "radixcache store TTFT benchmark"
FULL = dict(prefixes=(1024, 2048, 4096), reps=5)
QUICK = dict(prefixes=(256,), reps=1)
QUESTION = 16
TARGET_AT, TARGET_X = 2048, 10.0
MAC_TARGET = 1.05


def cold_ttft(model, ids, store=None) -> tuple[float, list, dict]:
    """(seconds to the first token, that token, the store's counters) of a fresh wrapper."""
    lm = radixcache.wrap(model, max_cache_tokens=ids.shape[1] + 64, store=store)
    out, _, ttft, _ = timed_generate(lm.generate, ids, max_new_tokens=1, do_sample=False)
    lm.close()
    return ttft, out[0, ids.shape[1]:].tolist(), lm.stats()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=HEADER)
    parser.add_argument("--quick", action="store_true", help="one short prefix, one round")
    parser.add_argument("--reps", type=int, help="rounds per prefix (default 5; quick 1)")
    parser.add_argument("--model", help="a local model directory (default: the embedded SmolLM2)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    cfg = dict(QUICK if args.quick else FULL)
    reps = args.reps or cfg["reps"]
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    model, _ = load_model(args.model)
    vocab = model.get_input_embeddings().num_embeddings
    bytes_per_token = radixcache.wrap(model, max_cache_tokens=64).pool.bytes_per_token
    rows = []
    with tempfile.TemporaryDirectory() as scratch, LocalRedis(scratch) as server:
        secret = Path(scratch) / "store-secret"
        secret.write_bytes(os.urandom(32))
        paths = {"recompute": None, "warm store": server.url, "warm store + MAC": f"{server.url}?secret_file={secret}"}
        for n in cfg["prefixes"]:
            rng = random.Random(n)
            ids = torch.tensor([random_ids(rng, n + QUESTION, vocab)])
            for url in (paths["warm store"], paths["warm store + MAC"]):
                with radixcache.wrap(model, max_cache_tokens=n + 64, store=url) as warm:
                    warm.generate(ids[:, :n + 1], max_new_tokens=1, do_sample=False)
            times = {name: [] for name in paths}
            tokens, hits = set(), {name: [] for name in paths}
            for _ in range(reps):
                for name, store in paths.items():
                    ttft, token, stats = cold_ttft(model, ids, store)
                    times[name].append(ttft)
                    tokens.add(tuple(token))
                    if store:
                        hits[name].append(stats["store_hit_tokens"])
            if len(tokens) != 1:
                raise SystemExit(f"prefix {n}: the warm store changed the first token: {tokens}")
            recompute, loaded = median(times["recompute"]), median(times["warm store"])
            sealed = median(times["warm store + MAC"])
            rows.append(dict(prefix=n, prompt=n + QUESTION, recompute_s=recompute, store_s=loaded,
                             mac_s=sealed, mac_ratio=sealed / loaded,
                             speedup=recompute / loaded, store_hit_tokens=min(hits["warm store"]),
                             mac_hit_tokens=min(hits["warm store + MAC"]),
                             prefill_tok_s=(n + QUESTION) / recompute,
                             store_tok_s=min(hits["warm store"]) / max(loaded, 1e-9)))
    print(f"{HEADER} ({'quick' if args.quick else 'full'})")
    print(f"model: {getattr(model.config, '_name_or_path', '') or type(model).__name__} "
          f"({next(model.parameters()).dtype}, {bytes_per_token:,} KV bytes/token); "
          f"{torch.get_num_threads()} torch threads, {os.cpu_count()} CPUs, python "
          f"{platform.python_version()}; redis-server on loopback; medians of {reps}")
    print("TTFT = the generate() call to its first token (streamer), in a fresh wrapper (empty tree)\n")
    print(table(["prefix", "prompt", "recompute ms", "warm store ms", "speedup", "store hit tok",
                 "warm store + MAC ms", "MAC / plain"],
                [(fmt(r["prefix"], ",d"), fmt(r["prompt"], ",d"), fmt(r["recompute_s"] * 1e3, ",.0f"),
                  fmt(r["store_s"] * 1e3, ",.0f"), fmt(r["speedup"], ".1f") + "x",
                  fmt(r["store_hit_tokens"], ",d"), fmt(r["mac_s"] * 1e3, ",.0f"),
                  fmt(r["mac_ratio"], ".3f") + "x") for r in rows]))
    target = next((r for r in rows if r["prefix"] == TARGET_AT), None)
    if target:
        verdict = "met" if target["speedup"] >= TARGET_X else "NOT met"
        print(f"\ntarget: at {TARGET_AT} tokens, warm store TTFT >= {TARGET_X:.0f}x lower than "
              f"recomputing: {target['speedup']:.1f}x ({verdict})")
    worst = max(r["mac_ratio"] for r in rows)
    print(f"target: the MAC moves the warm-hit TTFT by at most {MAC_TARGET - 1:.0%}: worst {worst:.3f}x "
          f"({'met' if worst <= MAC_TARGET else 'NOT met'})")
    print("\nbreak-even: loading beats recomputing while KV bytes/token < store bytes/s / prefill tokens/s"
          "\n(store load tok/s = store hit tokens / warm-store TTFT, which includes the question's prefill)")
    print(table(["prefix", "prefill tok/s", "store load tok/s", "store MB/s", "break-even B/token"],
                [(fmt(r["prefix"], ",d"), fmt(r["prefill_tok_s"], ",.0f"), fmt(r["store_tok_s"], ",.0f"),
                  fmt(r["store_tok_s"] * bytes_per_token / 1e6, ",.0f"),
                  fmt(r["store_tok_s"] * bytes_per_token / r["prefill_tok_s"], ",.0f"))
                 for r in rows]))
    if args.json:
        args.json.write_text(json.dumps(dict(bytes_per_token=bytes_per_token, reps=reps, rows=rows),
                                        indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
