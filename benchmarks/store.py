#!/usr/bin/env python
"""How fast the shared KV tier reads blocks from Redis, side by side with what bounds it.

One throwaway redis-server on a loopback port (``--save '' --appendonly no``) holds a chain of B
blocks of the embedded SmolLM2-135M's fp32 KV (30 layers x 2 x 16 tokens x 3 KV heads x 64 dims x
4 B = 737,280 B per block; B = 128 is a 2,048-token prefix). Each row reads the same bytes:

1. ``memory copy``: numpy copying B blocks in RAM (the ceiling);
2. ``TCP loopback``: the bytes over a plain loopback socket, no Redis (the transport);
3. ``redis-benchmark``: ``redis-benchmark -t get -d V -c 1 -P 16`` on the same server (C, one
   client, 16 pipelined GETs of one key of V bytes, V = our value: the 737,280 B payload plus a
   195 B header and checksum): what a native client gets; and the same with ``-r B`` over B
   distinct keys (the one key's value stays in the server's CPU cache; a chain's B values do not);
4. ``store.fetch``: ``RedisStore.fetch`` of the whole chain (chained keys, pipelined GETs, every value
   verified: size, checksum, header, tokens), the read path the cache manager calls;
5. ``store.fetch + import``: the same, then ``KVPool.import_block`` of every block into a pool.

Target: ``store.fetch`` at least 50% of ``redis-benchmark``. A second table turns the measured
``store.fetch`` rate into load time per model, from each model's KV bytes per token
(``radixcache.app.kv_size``): what a warm store saves depends on that against the model's prefill rate.
Medians over repetitions. (The cold-process TTFT table, 1k/2k/4k-token prefixes from a warm store
against recomputing on the embedded model, joins this script with ``wrap(model, store=URL)``.)

    python benchmarks/store.py [--quick] [--blocks B] [--reps R] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.report import fmt, median, table  # noqa: E402
from radixcache.integrations.redis_store import RedisStore, pool_format  # noqa: E402
from radixcache.integrations.redis_store.local import LocalRedis, find_binary  # noqa: E402
from radixcache.kv.pool import KVPool  # noqa: E402
from radixcache.app.kv_size import preset  # noqa: E402

HEADER = "radixcache store benchmark"
MODEL = "smollm2-135m-instruct"  # its KV geometry: 30 layers, 3 KV heads, head_dim 64, fp32
LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 30, 3, 64, 16
NS = (MODEL, None)
FULL = dict(blocks=128, reps=9)
QUICK = dict(blocks=8, reps=2)
TARGET_SHARE = 0.5
MODELS = (("SmolLM2-135M", "fp32"), ("Llama-3-8B", "bf16"), ("Llama-3-8B", "fp8"),
          ("DeepSeek-V3", "bf16"))
PREFIX_TOKENS = 2048
DISTINCT = "redis-benchmark ... -r B (B keys)"


def interleaved(paths: dict, reps: int) -> dict:
    """Median seconds of each path over ``reps`` rounds, one run of every path per round (after a
    warm-up round), so a noisy machine weighs on every path alike. A path may return its own
    seconds (a float) instead of being timed from outside."""
    runs = {name: [] for name in paths}
    for round_ in range(reps + 1):
        for name, fn in paths.items():
            start = time.perf_counter()
            own = fn()
            if round_:
                runs[name].append(own if isinstance(own, float) else time.perf_counter() - start)
    return {name: median(times) for name, times in runs.items()}


def filled_pool(blocks: int) -> KVPool:
    pool = KVPool(LAYERS, blocks, BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.float32, device="cpu")
    rows = pool.rows_for(list(range(blocks)), 0, blocks * BLOCK)
    g = torch.Generator().manual_seed(0)
    for layer in range(LAYERS):
        shape = (blocks * BLOCK, KV_HEADS, HEAD_DIM)
        pool.write(layer, rows, torch.randn(shape, generator=g), torch.randn(shape, generator=g))
    return pool


def memory_copy(nbytes: int):
    """A run: copy ``nbytes`` in RAM."""
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    return lambda: np.copyto(dst, src)


def tcp_loopback(nbytes: int, stack):
    """A run: receive ``nbytes`` over a fresh loopback TCP connection (the listener closes with ``stack``)."""
    payload = os.urandom(1 << 20)
    server = stack.enter_context(socket.create_server(("127.0.0.1", 0)))
    port = server.getsockname()[1]

    def send_all(conn):
        with conn:
            left = nbytes
            while left:
                n = min(left, len(payload))
                conn.sendall(memoryview(payload)[:n])
                left -= n

    buf = bytearray(1 << 20)

    def one():
        client = socket.create_connection(("127.0.0.1", port))
        conn, _ = server.accept()
        sender = threading.Thread(target=send_all, args=(conn,))
        sender.start()
        got = 0
        with client:
            while got < nbytes:
                n = client.recv_into(buf)
                if not n:
                    break
                got += n
        sender.join()

    return one


def redis_benchmark_command(port, value_bytes: int, requests: int) -> list[str]:
    return [find_binary("redis-benchmark"), "-h", "127.0.0.1", "-p", str(port), "-t", "get",
            "-d", str(value_bytes), "-c", "1", "-P", "16", "-n", str(requests), "--csv"]


def redis_benchmark(server: LocalRedis, value_bytes: int, blocks: int, distinct: bool = False):
    """A run: ``redis-benchmark -t get -d value_bytes -c 1 -P 16 -n R``; returns the seconds that
    ``blocks`` GETs take at the rate it reports (R = 4 x blocks, at least 64). ``distinct``: GET
    ``blocks`` different keys at random (``-r blocks``), as a chain read does, instead of one key
    whose value stays in the server's CPU cache."""
    # -t get reads "key:__rand_int__" (with -r: key:000000000000 .. ); a missing key would make
    # every GET a tiny nil reply
    value = os.urandom(value_bytes)
    names = [f"key:{i:012d}" for i in range(blocks)] if distinct else ["key:__rand_int__"]
    client = server.client()
    for name in names:
        client.set(name, value)
    command = redis_benchmark_command(server.port, value_bytes, max(64, 4 * blocks))
    if distinct:
        command[1:1] = ["-r", str(blocks)]

    def one() -> float:
        out = subprocess.run(command, capture_output=True, text=True, timeout=300, check=True)
        line = next(ln for ln in out.stdout.splitlines() if ln.startswith('"GET"'))
        return blocks / float(line.split(",")[1].strip('"'))

    return one


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=HEADER)
    parser.add_argument("--quick", action="store_true", help="a few blocks, a few repetitions")
    parser.add_argument("--blocks", type=int, help="blocks in the chain (default 128; quick 8)")
    parser.add_argument("--reps", type=int, help="rounds, every path once per round (default 9; quick 2)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    cfg = dict(QUICK if args.quick else FULL)
    cfg["blocks"] = args.blocks or cfg["blocks"]
    cfg["reps"] = args.reps or cfg["reps"]
    blocks, reps = cfg["blocks"], cfg["reps"]
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

    pool = filled_pool(blocks)
    fmt_ = pool_format(pool, MODEL)
    tokens = [i % 49152 for i in range(blocks * BLOCK)]
    with tempfile.TemporaryDirectory() as scratch, LocalRedis(scratch) as server:
        version = server.client().info("server")["redis_version"]
        writer = RedisStore(server.url, fmt_, timeout=5.0)
        writer.offer(NS, tokens, 0, list(range(blocks)), pool)
        report = writer.close(timeout=300)
        if report["store_written_blocks"] != blocks:
            raise SystemExit(f"only {report['store_written_blocks']} of {blocks} blocks were written: {report}")
        store = RedisStore(server.url, fmt_, timeout=5.0, fetch_deadline=60.0)
        value_bytes = store.value_bytes
        total = blocks * value_bytes

        def fetch():
            got = store.fetch(NS, tokens, 0, blocks)
            assert len(got) == blocks, f"fetched {len(got)} of {blocks} blocks: {store.stats()}"
            return got

        target = KVPool(LAYERS, blocks, BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.float32, device="cpu")

        def fetch_and_import():
            for i, kv in enumerate(fetch()):
                target.import_block(i, kv)

        with contextlib.ExitStack() as stack:
            seconds = interleaved({
                "memory copy (numpy)": memory_copy(total),
                "TCP loopback (socket, no Redis)": tcp_loopback(total, stack),
                "redis-benchmark -t get -P 16": redis_benchmark(server, value_bytes, blocks),
                DISTINCT: redis_benchmark(server, value_bytes, blocks, distinct=True),
                "store.fetch (verified)": fetch,
                "store.fetch + KVPool.import_block": fetch_and_import,
            }, reps)
        rates = {name: total / s for name, s in seconds.items()}
        store.close()

    order = ["memory copy (numpy)", "TCP loopback (socket, no Redis)", "redis-benchmark -t get -P 16",
             DISTINCT, "store.fetch (verified)", "store.fetch + KVPool.import_block"]
    bench = rates["redis-benchmark -t get -P 16"]
    rows = [dict(path=name, bytes_per_s=rates[name], share_of_redis_benchmark=rates[name] / bench)
            for name in order]
    fetch_rate = rates["store.fetch (verified)"]
    share = fetch_rate / bench
    per_model = []
    for name, dtype in MODELS:
        bpt = preset(name).bytes_per_token(dtype)
        per_model.append(dict(model=name, kv_dtype=dtype, bytes_per_token=bpt,
                              tokens_per_s=fetch_rate / bpt,
                              prefix_load_ms=PREFIX_TOKENS * bpt / fetch_rate * 1e3))

    print(f"{HEADER} ({'quick' if args.quick else 'full'})")
    print(f"python {platform.python_version()}, {platform.machine()}, {os.cpu_count()} CPUs, "
          f"redis-server {version} on loopback; {blocks} blocks of {value_bytes:,} B "
          f"({blocks * BLOCK} tokens of {MODEL} fp32 KV), median of {reps}")
    print("redis-benchmark: " + " ".join(
        ["redis-benchmark"] + redis_benchmark_command("PORT", value_bytes, max(64, 4 * blocks))[1:]))
    print()
    print(table(["path", "MB/s", "vs redis-benchmark"],
                [(r["path"], fmt(r["bytes_per_s"] / 1e6, ",.0f"), fmt(r["share_of_redis_benchmark"], ".0%"))
                 for r in rows]))
    print()
    print(f"target: store.fetch >= {TARGET_SHARE:.0%} of redis-benchmark: {share:.0%} "
          f"({'met' if share >= TARGET_SHARE else 'NOT met'})")
    print()
    print(f"what the measured store.fetch rate means per model ({PREFIX_TOKENS}-token prefix):")
    print(table(["model", "KV dtype", "B/token", "tokens/s from store", f"load {PREFIX_TOKENS} ms"],
                [(m["model"], m["kv_dtype"], fmt(m["bytes_per_token"], ",d"),
                  fmt(m["tokens_per_s"], ",.0f"), fmt(m["prefix_load_ms"], ",.1f")) for m in per_model],
                left=(0, 1)))
    if args.json:
        args.json.write_text(json.dumps(dict(config=cfg, value_bytes=value_bytes, redis=version,
                                             rows=rows, target_met=share >= TARGET_SHARE,
                                             per_model=per_model), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
