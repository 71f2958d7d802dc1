"""Sessions through SMG in front of radixcache replicas: which routing keeps the cache useful.

Starts ``--replicas`` ``radixcache serve`` replicas (default 2, on the embedded SmolLM2 or
``--model DIR``) twice over, once alone and once on one redis-server (``--store``), and SGLang's
model gateway (``smg launch``) in front of them, everything on loopback (``smg_cluster.py``). Each
setup then runs the same workload (``cluster_sessions.py``): ``--sessions`` concurrent chat
sessions (default 8, started 0.1 s apart), each ``--turns`` turns (default 4) of a greedy reply of
``--max-tokens`` (default 16), every request the whole conversation, with a pause of about
``--pause`` seconds between turns (default 1: the client running its tool; the store's writes land
meanwhile). Setups, each on sessions no other setup has seen:

- ``one replica``: straight to one replica, no router (the single-server baseline);
- ``cache_aware``, ``round_robin`` (and any of ``--policies``): through SMG, replicas alone;
- ``round_robin + store``, ``cache_aware + store``: through SMG, replicas on Redis.

Per setup and turn it prints the median cached tokens (``usage.prompt_tokens_details``), the hit
rate (cached / prompt tokens) and the median TTFT (request sent to the first content chunk); per
setup the sessions that stayed on one replica (from the replicas' ``--log-token-ids`` files), the
share of the ideal served on turns 2+ (per request the ideal is ``token_log.ideal_cached``: the
longest prefix of its prompt that an earlier request's prompt and output covered on any replica,
in whole blocks; a request's cached tokens count up to its ideal), TTFT p50 / p99 and the wall
time. Bounded: sessions x
turns requests per setup, each with a 120 s timeout. Timings on a shared machine are noisy.

    python benchmarks/cluster.py [--model DIR] [--replicas 2] [--sessions 8] [--turns 4]
                                 [--max-tokens 16] [--pause 1.0] [--policies cache_aware,round_robin]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster_sessions import run_sessions  # noqa: E402
from report import fmt, median, percentile, table  # noqa: E402
from server_process import ServerProcess, free_port  # noqa: E402
from smg_cluster import Router, replica_command, served_by  # noqa: E402

from radixcache.integrations.serve.telemetry.token_log import ideal_cached  # noqa: E402


class Group:
    """``n`` replicas of ``model_dir`` (on ``store`` when given), each with a token log."""

    def __init__(self, name, model_dir, n, log_dir, args, store=None):
        self.logs = [log_dir / f"{name}-{i}.jsonl" for i in range(n)]
        extra = ["--dtype", args.dtype, "--block-size", str(args.block_size),
                 "--max-cache-tokens", str(args.max_cache_tokens)]
        self.procs = []
        try:
            for i in range(n):
                command = replica_command(model_dir, free_port(), store=store, token_log=self.logs[i], extra=extra)
                self.procs.append(ServerProcess(f"{name}-{i}", command, log_dir, args.startup_timeout))
        except BaseException:
            self.stop()
            raise
        self.urls = [p.base for p in self.procs]
        self.model = self.procs[0].model

    def stop(self):
        for proc in self.procs:
            proc.stop()


def summarize(name, turns, served, block_size):
    """(per-turn rows, summary row) of one setup; ``served``: ``served_by`` of its replicas' logs."""
    by_session = {}
    for t in turns:
        by_session.setdefault(t.session, []).append(t)
    sticky = sum(1 for ts in by_session.values() if len({served[t.id][0] for t in ts}) == 1)
    lines = sorted((line for _, line in served.values()), key=lambda line: line["time"])
    ideal_of = dict(zip((line["id"] for line in lines), ideal_cached(lines, block_size)))
    later = [t for t in turns if t.turn > 0]
    ideal = sum(ideal_of[t.id] for t in later)
    served_ideal = sum(min(t.cached_tokens, ideal_of[t.id]) for t in later)
    rows = []
    for turn in sorted({t.turn for t in turns}):
        ts = [t for t in turns if t.turn == turn]
        prompt = sum(t.prompt_tokens for t in ts)
        rows.append([name, str(turn + 1), fmt(median([t.prompt_tokens for t in ts]), ".0f"),
                     fmt(median([t.cached_tokens for t in ts]), ".0f"),
                     fmt(sum(t.cached_tokens for t in ts) / prompt if prompt else None, ".2f"),
                     fmt(median([t.ttft_s * 1000 for t in ts]), ".0f")])
    prompt = sum(t.prompt_tokens for t in turns)
    ttfts = [t.ttft_s * 1000 for t in turns]
    summary = [name, f"{sticky}/{len(by_session)}", fmt(served_ideal / ideal if ideal else None, ".2f"),
               fmt(sum(t.cached_tokens for t in turns) / prompt if prompt else None, ".2f"),
               fmt(percentile(ttfts, 50), ".0f"), fmt(percentile(ttfts, 99), ".0f")]
    return rows, summary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", metavar="DIR", default=None, help="local model directory (default: SmolLM2)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--pause", type=float, default=1.0, help="seconds between turns (1x to 2x by session)")
    parser.add_argument("--policies", default="cache_aware,round_robin", help="SMG policies without the store")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-cache-tokens", type=int, default=65536)
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    args = parser.parse_args(argv)
    from radixcache.models import default_model_dir

    model_dir = Path(args.model) if args.model else default_model_dir()
    rows, summaries, started = [], [], time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="radixcache-cluster-") as tmp:
        tmp = Path(tmp)
        setups = []  # (name, group key, policy or None: straight to one replica)
        setups.append(("one replica", "alone", None))
        setups += [(policy, "alone", policy) for policy in args.policies.split(",") if policy]
        setups += [("round_robin + store", "store", "round_robin"),
                   ("cache_aware + store", "store", "cache_aware")]
        redis = groups = None
        try:
            from radixcache.integrations.redis_store.local import LocalRedis

            redis = LocalRedis(tmp / "redis").start()
            groups = {"alone": Group("alone", model_dir, args.replicas, tmp, args),
                      "store": Group("store", model_dir, args.replicas, tmp, args, store=redis.url)}
            print(f"{args.replicas} replicas of {groups['alone'].model} ({args.dtype}), {args.sessions} sessions x "
                  f"{args.turns} turns, {args.max_tokens} new tokens per turn", flush=True)
            for index, (name, key, policy) in enumerate(setups):
                group, router = groups[key], None
                t0 = time.perf_counter()
                try:
                    if policy is None:
                        url = group.urls[0]
                    else:
                        router = Router(group.urls, policy, tmp / f"smg-{index}.log")
                        url = router.base_url
                    turns = run_sessions(url, group.model, sessions=args.sessions, turns=args.turns,
                                         max_tokens=args.max_tokens, pause_s=args.pause, stagger_s=0.1,
                                         first_session=1000 * index)
                finally:
                    if router is not None:
                        router.stop()
                per_turn, summary = summarize(name, turns, served_by(group.logs), args.block_size)
                rows += per_turn
                summaries.append(summary + [f"{time.perf_counter() - t0:.1f}"])
                print(f"  {name}: done in {time.perf_counter() - t0:.1f} s", flush=True)
        finally:
            for group in (groups or {}).values():
                group.stop()
            if redis is not None:
                redis.stop()
    print()
    print(table(["setup", "turn", "prompt tokens", "cached (median)", "hit rate", "TTFT p50 ms"], rows))
    print()
    print(table(["setup", "sessions on one replica", "of the ideal (turns 2+)", "hit rate",
                 "TTFT p50 ms", "TTFT p99 ms", "wall s"], summaries))
    print(f"\ndone in {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
