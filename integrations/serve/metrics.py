"""The server's Prometheus metrics, in a registry of its own (never prometheus-client's global one).

Names follow vLLM's where one exists, with the ``radixcache:`` prefix:

- ``prefix_cache_queries_total`` / ``prefix_cache_hits_total``: prompt tokens looked up in the cache
  and prompt tokens served from it (hit rate = hits / queries, as vLLM and SGLang count it);
- ``prompt_tokens_total``, ``generation_tokens_total``, ``request_success_total{finish_reason}``,
  ``requests_rejected_total{status}``;
- ``num_requests_running``, ``num_requests_waiting``, ``kv_cache_usage_perc`` (share of pool blocks
  in use, 0..1): read from the engine at scrape time;
- histograms ``time_to_first_token_seconds``, ``inter_token_latency_seconds``,
  ``e2e_request_latency_seconds``;
- ``prefix_cache_short_hits_total{reason}`` and ``prefix_cache_short_hit_tokens_total{reason}``:
  requests whose hit stopped before the previous turn's history form, and the tokens that cost
  (reasons from ``history.classify_hit``, and ``previous_response_rendered_anew`` from
  ``openai_responses``);
- ``history_divergence_total{reason}``: replies whose history form departs from the computed
  tokens (reasons from ``history.history_after_reply``), and ``history_precompute_tokens_total``;
- with a shared store, its counters as ``store_hit_tokens_total``, ``store_miss_blocks_total``,
  ``store_written_blocks_total``, ``store_dropped_blocks_total``, ``store_bytes_read_total``,
  ``store_bytes_written_total``, ``store_errors_total``, ... (read at scrape time).
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

PREFIX = "radixcache:"
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.2, 0.3,
               0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0)


class _StoreCounters:
    """A collector that reads the store's counters from ``source()`` (a dict) at each scrape."""

    def __init__(self):
        self.source = None

    def describe(self):
        return []

    def collect(self):
        for name, value in sorted((self.source() if self.source is not None else {}).items()):
            yield CounterMetricFamily(PREFIX + name, f"Shared store: {name.removeprefix('store_')}.",
                                      value=float(value))


class ServerMetrics:
    """Counters, gauges and histograms of one server; ``render()`` is the ``/metrics`` body.

    ``attach(counts, store)`` makes the gauges read ``counts()`` (an ``EngineCounts``) and the
    store counters ``store()`` (a dict) at every scrape; without them they read 0 / are absent.
    """

    def __init__(self):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.queries = Counter(PREFIX + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                               registry=r)
        self.hits = Counter(PREFIX + "prefix_cache_hits", "Prompt tokens served from the prefix cache.",
                            registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of admitted requests.", registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated.", registry=r)
        self.success = Counter(PREFIX + "request_success", "Finished requests, by finish reason.",
                               ["finish_reason"], registry=r)
        self.rejected = Counter(PREFIX + "requests_rejected", "Requests answered with an error, by status.",
                                ["status"], registry=r)
        self.running = Gauge(PREFIX + "num_requests_running", "Requests in the running batch.", registry=r)
        self.waiting = Gauge(PREFIX + "num_requests_waiting", "Requests waiting to be scheduled.", registry=r)
        self.usage = Gauge(PREFIX + "kv_cache_usage_perc", "Share of KV-pool blocks in use (0..1).", registry=r)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time from arrival to the first token.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between tokens of one sample.",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Time from arrival to the last token.",
                             buckets=E2E_BUCKETS, registry=r)
        self.short_hits = Counter(PREFIX + "prefix_cache_short_hits",
                                  "Requests whose cache hit stopped before the previous turn, by reason.",
                                  ["reason"], registry=r)
        self.short_hit_tokens = Counter(PREFIX + "prefix_cache_short_hit_tokens",
                                        "Prompt tokens of the previous turn that were not hit, by reason.",
                                        ["reason"], registry=r)
        self.divergence = Counter(PREFIX + "history_divergence",
                                  "Replies whose history form departs from the computed tokens, by reason.",
                                  ["reason"], registry=r)
        self.precompute_tokens = Counter(PREFIX + "history_precompute_tokens",
                                         "Tokens of history forms submitted for low-priority prefill.", registry=r)
        self._store = _StoreCounters()
        r.register(self._store)
        self.attach(None)

    def attach(self, counts, store=None) -> None:
        """Read running/waiting/pool usage from ``counts()`` (None: report 0) and the store's
        counters from ``store()`` (None: none) at each scrape."""
        self._store.source = store
        def read(pick):
            def value():
                c = counts() if counts is not None else None
                return 0.0 if c is None else float(pick(c))
            return value

        self.running.set_function(read(lambda c: c.running))
        self.waiting.set_function(read(lambda c: c.waiting))
        self.usage.set_function(read(lambda c: c.used_blocks / c.total_blocks if c.total_blocks else 0.0))

    # ------------------------------------------------------------------ observations
    def observe_admitted(self, prompt_tokens: int, cached_tokens: int) -> None:
        """A request was admitted: its prompt was looked up and ``cached_tokens`` of it were hits."""
        self.queries.inc(prompt_tokens)
        self.hits.inc(cached_tokens)
        self.prompt_tokens.inc(prompt_tokens)

    def observe_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def observe_inter_token(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def observe_finished(self, finish_reason: str, completion_tokens: int, seconds: float) -> None:
        self.success.labels(finish_reason).inc()
        self.generation_tokens.inc(completion_tokens)
        self.e2e.observe(seconds)

    def observe_rejected(self, status: int) -> None:
        self.rejected.labels(str(status)).inc()

    def observe_short_hit(self, reason: str, missed_tokens: int) -> None:
        self.short_hits.labels(reason).inc()
        self.short_hit_tokens.labels(reason).inc(max(0, missed_tokens))

    def observe_divergence(self, reason: str) -> None:
        self.divergence.labels(reason).inc()

    def observe_precompute(self, tokens: int) -> None:
        self.precompute_tokens.inc(tokens)

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition of every metric, and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
