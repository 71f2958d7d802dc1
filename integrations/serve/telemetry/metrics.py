"""The server's Prometheus metrics, in a registry of its own (never prometheus-client's global one).

Names follow vLLM's where one exists, with the ``radixcache:`` prefix:

- ``prefix_cache_queries_total`` / ``prefix_cache_hits_total``: prompt tokens looked up in the cache
  and prompt tokens served from it (hit rate = hits / queries, as vLLM and SGLang count it), and
  ``prompt_tokens_total`` (the same prompt tokens): read at scrape time from the cache manager's
  ledger (``Ledger``: the one count of requests, queried and hit tokens; background history
  prefills are not queries);
- ``generation_tokens_total``, ``request_success_total{finish_reason}``,
  ``requests_rejected_total{status}``;
- ``num_requests_running``, ``num_requests_waiting``, ``kv_cache_usage_perc`` (share of pool blocks
  in use, 0..1): read from the engine at scrape time;
- histograms ``time_to_first_token_seconds``, ``inter_token_latency_seconds``,
  ``e2e_request_latency_seconds``;
- ``prefix_cache_short_hits_total{reason}`` and ``prefix_cache_short_hit_tokens_total{reason}``:
  requests whose hit stopped before the previous turn's history form, and the tokens that cost
  (reasons from ``history.classify_hit``, and ``previous_response_rendered_anew`` from
  ``protocols.openai.responses``);
- ``history_divergence_total{reason}``: replies whose history form departs from the computed
  tokens (reasons from ``history.history_after_reply``), and ``history_precompute_tokens_total``;
- with a shared store, its counters as ``store_hit_tokens_total``, ``store_miss_blocks_total``,
  ``store_written_blocks_total``, ``store_dropped_blocks_total``, ``store_bytes_read_total``,
  ``store_bytes_written_total``, ``store_errors_total``, ... (read at scrape time);
- ``cached_blocks``: the whole blocks the tree holds (partial tails not counted); with KV events
  on, exactly those announced by ``BlockStored`` and not yet by ``BlockRemoved`` since the last
  ``AllBlocksCleared`` (read at scrape time);
- with KV events on (``--kv-events``), the publisher's counters ``kv_events_batches_total``
  (messages sent), ``kv_events_dropped_total`` (block records dropped on a full queue),
  ``kv_events_resyncs_total``, ``kv_events_errors_total`` and the gauge ``kv_events_queued``.

vLLM's own names, for the routers and scorers that read them (vLLM's production-stack router,
llm-d, SMG for vLLM workers), are aliases of five of these: ``VLLM_ALIASES`` maps each to the
``radixcache:`` metric it re-exports. An alias is not a second counter: it is collected from the
same metric at the same scrape, so both names always read the same value.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

PREFIX = "radixcache:"
VLLM_PREFIX = "vllm:"
# vLLM's name -> the radixcache: metric (without the prefix) it is an alias of
VLLM_ALIASES = {"vllm:num_requests_running": "num_requests_running",
                "vllm:num_requests_waiting": "num_requests_waiting",
                "vllm:kv_cache_usage_perc": "kv_cache_usage_perc",
                "vllm:prefix_cache_queries": "prefix_cache_queries",
                "vllm:prefix_cache_hits": "prefix_cache_hits"}
EVENT_GAUGES = {"kv_events_queued"}  # publisher stats that are levels, not counts
EVENT_COUNTERS = {"kv_events_batches", "kv_events_dropped", "kv_events_resyncs", "kv_events_errors"}
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


LEDGER_COUNTERS = {"prefix_cache_queries": ("queried_tokens", "Prompt tokens looked up in the prefix cache."),
                   "prefix_cache_hits": ("hit_tokens", "Prompt tokens served from the prefix cache."),
                   "prompt_tokens": ("queried_tokens", "Prompt tokens of admitted requests.")}


class _LedgerCounter:
    """A collector of one counter of the cache manager's ledger, read from ``source()`` (a dict
    with ``queried_tokens`` and ``hit_tokens``; None or missing: 0) at each scrape."""

    def __init__(self, name: str):
        self.name = name
        self.key, self.doc = LEDGER_COUNTERS[name]
        self.source = None

    def describe(self):
        return []

    def value(self) -> float:
        ledger = self.source() if self.source is not None else None
        return float((ledger or {}).get(self.key, 0))

    def collect(self):
        yield CounterMetricFamily(PREFIX + self.name, self.doc, value=self.value())


class _EventCounters:
    """A collector of the KV event publisher's counters from ``source()`` (a dict, empty when
    events are off: nothing is exported then) at each scrape."""

    def __init__(self):
        self.source = None

    def describe(self):
        return []

    def collect(self):
        stats = self.source() if self.source is not None else {}
        for name in sorted(stats):
            if name in EVENT_COUNTERS:
                yield CounterMetricFamily(PREFIX + name, f"KV events: {name.removeprefix('kv_events_')}.",
                                          value=float(stats[name]))
            elif name in EVENT_GAUGES:
                yield GaugeMetricFamily(PREFIX + name, "KV events: block records waiting to be sent.",
                                        value=float(stats[name]))


class _Alias:
    """A collector re-exporting ``metric`` (a prometheus-client metric) under ``name``: its samples,
    collected from it at each scrape, renamed (the same values, never a copy kept)."""

    def __init__(self, name: str, metric):
        self.name, self.metric = name, metric

    def describe(self):
        return []

    def collect(self):
        for family in self.metric.collect():
            alias = Metric(self.name, f"{family.documentation} (alias of {family.name})", family.type)
            for sample in family.samples:
                alias.add_sample(self.name + sample.name[len(family.name):], sample.labels, sample.value,
                                 sample.timestamp)
            yield alias


class ServerMetrics:
    """Counters, gauges and histograms of one server; ``render()`` is the ``/metrics`` body.

    ``attach(counts, store, events, ledger)`` makes the gauges read ``counts()`` (an
    ``EngineCounts``), the store counters ``store()``, the KV event counters ``events()`` and the
    prefix cache counters ``ledger()`` (dicts) at every scrape; without them they read 0 / are
    absent. ``prefix_cache_totals()`` is the (queries, hits) pair the ``prefix_cache_*`` counters
    show, for ``/v1/loads``.
    """

    def __init__(self):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self._ledger = {name: _LedgerCounter(name) for name in LEDGER_COUNTERS}
        for counter in self._ledger.values():
            r.register(counter)
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
        self.cached_blocks = Gauge(PREFIX + "cached_blocks",
                                   "Whole KV blocks the prefix tree holds (partial tails not counted).",
                                   registry=r)
        self._store = _StoreCounters()
        r.register(self._store)
        self._events = _EventCounters()
        r.register(self._events)
        for name, source in VLLM_ALIASES.items():
            r.register(_Alias(name, self._metric(source)))
        self.attach(None)

    def _metric(self, name: str):
        return {"num_requests_running": self.running, "num_requests_waiting": self.waiting,
                "kv_cache_usage_perc": self.usage, "prefix_cache_queries": self._ledger["prefix_cache_queries"],
                "prefix_cache_hits": self._ledger["prefix_cache_hits"]}[name]

    def attach(self, counts, store=None, events=None, ledger=None) -> None:
        """Read running/waiting/pool usage/cached blocks from ``counts()`` (None: report 0), the
        store's counters from ``store()``, the KV event publisher's from ``events()`` and the
        manager's ledger from ``ledger()`` (None: none) at each scrape."""
        self._store.source = store
        self._events.source = events
        for counter in self._ledger.values():
            counter.source = ledger
        def read(pick):
            def value():
                c = counts() if counts is not None else None
                return 0.0 if c is None else float(pick(c))
            return value

        self.running.set_function(read(lambda c: c.running))
        self.waiting.set_function(read(lambda c: c.waiting))
        self.usage.set_function(read(usage_share))
        self.cached_blocks.set_function(read(lambda c: c.cached_blocks))

    def prefix_cache_totals(self) -> tuple[float, float]:
        """(prompt tokens looked up, prompt tokens hit): the values ``prefix_cache_queries_total`` and
        ``prefix_cache_hits_total`` show now."""
        return self._ledger["prefix_cache_queries"].value(), self._ledger["prefix_cache_hits"].value()

    # ------------------------------------------------------------------ observations
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


def usage_share(counts) -> float:
    """The share of pool blocks in use (0..1) of an ``EngineCounts``: ``kv_cache_usage_perc``."""
    return counts.used_blocks / counts.total_blocks if counts.total_blocks else 0.0
