"""``GET /v1/loads``: the worker's load in the shape SGLang's model gateway (SMG) polls.

SMG registers a worker whose ``/v1/models`` ``owned_by`` is neither "sglang" nor "vllm" as a
generic OpenAI-compatible runtime and reads its load only from here (every
``--load-monitor-interval`` seconds), for the least-loaded fallback and the balance gates of its
``cache_aware`` policy. The body (every field is parsed by SMG; integers must fit an i32)::

    {"timestamp": "2026-12-02T03:40:00.123456+00:00",   # RFC 3339: SMG refuses a number, and then
     "version": "radixcache-<version>",                  # never polls this worker's loads again
     "dp_rank_count": 1,
     "loads": [{"dp_rank": 0, "num_running_reqs", "num_waiting_reqs", "num_total_reqs",
                "num_used_tokens", "max_total_num_tokens", "token_usage", "cache_hit_rate",
                "max_running_requests"}]}

One source of truth: every number is what ``/metrics`` shows at the same moment.
``num_running_reqs`` / ``num_waiting_reqs`` are ``radixcache:num_requests_running`` /
``_waiting``; ``token_usage`` is ``radixcache:kv_cache_usage_perc`` (pool blocks that cannot be had
now, of all) and ``num_used_tokens`` / ``max_total_num_tokens`` the same blocks in tokens;
``cache_hit_rate`` is ``prefix_cache_hits_total / prefix_cache_queries_total`` since start-up (0
before the first request); ``max_running_requests`` is ``--max-running``. Without an engine every
count is 0 and ``max_total_num_tokens`` is the configured pool (or 0).
"""

from __future__ import annotations

from datetime import datetime, timezone

from radixcache.integrations.serve.telemetry.metrics import usage_share

INT32_MAX = 2**31 - 1


def _i32(value) -> int:
    return max(0, min(INT32_MAX, int(value)))


def _version() -> str:
    try:
        from importlib.metadata import version

        return "radixcache-" + version("radixcache")
    except Exception:  # noqa: BLE001 - not installed as a distribution (a source tree on sys.path)
        return "radixcache"


VERSION = _version()


def worker_loads(state) -> dict:
    """The ``/v1/loads`` body for ``state`` (a ``ServerState``), see the module docstring."""
    block_size = state.limits.block_size
    counts = state.engine.counts() if state.engine is not None else None
    if counts is not None:
        running, waiting = counts.running, counts.waiting
        used, total = counts.used_blocks * block_size, counts.total_blocks * block_size
        usage = usage_share(counts)
    else:
        running = waiting = used = 0
        total, usage = state.limits.pool_tokens or 0, 0.0
    queries, hits = state.metrics.prefix_cache_totals()
    load = {"dp_rank": 0, "num_running_reqs": _i32(running), "num_waiting_reqs": _i32(waiting),
            "num_total_reqs": _i32(running + waiting), "num_used_tokens": _i32(used),
            "max_total_num_tokens": _i32(total), "token_usage": float(usage),
            "cache_hit_rate": hits / queries if queries else 0.0,
            "max_running_requests": _i32(state.options.max_running)}
    return {"timestamp": datetime.now(timezone.utc).isoformat(), "version": VERSION,
            "dp_rank_count": 1, "loads": [load]}
