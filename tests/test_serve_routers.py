"""What routers read from a worker: ``GET /v1/loads`` (SMG's shape), ``/v1/models``' ``root`` and
``max_model_len``, vLLM's metric names as aliases, ``radixcache:cached_blocks``, and the KV event
publisher's counters; the KV events of a live server rebuilt by a real ZMQ subscriber.

The live tests run uvicorn on a free loopback port over a real engine on a tiny random Llama.
"""

from datetime import datetime

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kv_event_subscriber import Subscriber, tree_blocks
from radixcache.integrations.serve.engine.client import EngineCounts
from radixcache.integrations.serve.telemetry.metrics import VLLM_ALIASES, ServerMetrics
from serve_helpers import Served, write_model_dir

KEY = "sk-router"
BS = 16
ALIASES = {"vllm:num_requests_running": "radixcache:num_requests_running",
           "vllm:num_requests_waiting": "radixcache:num_requests_waiting",
           "vllm:kv_cache_usage_perc": "radixcache:kv_cache_usage_perc",
           "vllm:prefix_cache_queries_total": "radixcache:prefix_cache_queries_total",
           "vllm:prefix_cache_hits_total": "radixcache:prefix_cache_hits_total"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model_dir(tmp_path_factory.mktemp("model") / "tiny-router", max_positions=1024, weights=True)


def samples(text):
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if not s.labels}


def test_vllm_names_are_aliases_of_the_same_metrics():
    m = ServerMetrics()
    state = {"counts": EngineCounts(running=3, waiting=5, used_blocks=30, total_blocks=120, cached_blocks=17),
             "ledger": {"queried_tokens": 1000, "hit_tokens": 960}}
    m.attach(lambda: state["counts"], ledger=lambda: state["ledger"])
    got = samples(m.render()[0].decode())
    for vllm, ours in ALIASES.items():
        assert got[vllm] == got[ours], vllm
    assert got["vllm:prefix_cache_queries_total"] == 1000 and got["vllm:kv_cache_usage_perc"] == 0.25
    assert got["vllm:num_requests_waiting"] == 5 and got["radixcache:cached_blocks"] == 17
    # one source of truth: a later change shows under both names at the next scrape
    state["ledger"] = {"queried_tokens": 1024, "hit_tokens": 976}
    state["counts"] = EngineCounts(1, 0, 60, 120, 40)
    got = samples(m.render()[0].decode())
    for vllm, ours in ALIASES.items():
        assert got[vllm] == got[ours], vllm
    assert got["vllm:prefix_cache_hits_total"] == 976 and got["vllm:kv_cache_usage_perc"] == 0.5
    assert m.prefix_cache_totals() == (1024, 976)
    assert set(VLLM_ALIASES) == {name.removesuffix("_total") for name in ALIASES}
    assert not [k for k in got if k.startswith("radixcache:kv_events")]  # events off: none


def test_kv_event_counters_when_events_are_on():
    m = ServerMetrics()
    stats = {"kv_events_batches": 7, "kv_events_dropped": 2, "kv_events_resyncs": 1,
             "kv_events_queued": 4, "kv_events_errors": 0, "kv_events_thread_cpu_s": 0.5}
    m.attach(None, events=lambda: stats)
    got = samples(m.render()[0].decode())
    assert got["radixcache:kv_events_batches_total"] == 7
    assert got["radixcache:kv_events_dropped_total"] == 2
    assert got["radixcache:kv_events_resyncs_total"] == 1
    assert got["radixcache:kv_events_errors_total"] == 0
    assert got["radixcache:kv_events_queued"] == 4


@pytest.fixture
def served(model_dir):
    server = Served(model_dir, lm_options={"max_cache_tokens": 4096}, api_keys=(KEY,), max_running=8)
    yield server
    server.stop()


def get(server, path, key=KEY):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.get(server.base_url + path, headers=headers, timeout=30)


def test_loads_models_and_metrics_agree(served):
    client = served.client(api_key=KEY)
    assert get(served, "/v1/loads", key=None).status_code == 401
    assert get(served, "/v1/loads", key="wrong").status_code == 401
    body = get(served, "/v1/loads").json()
    assert isinstance(body["timestamp"], str) and datetime.fromisoformat(body["timestamp"]).tzinfo
    assert body["dp_rank_count"] == 1 and body["version"].startswith("radixcache")
    (load,) = body["loads"]
    assert load == {"dp_rank": 0, "num_running_reqs": 0, "num_waiting_reqs": 0, "num_total_reqs": 0,
                    "num_used_tokens": 0, "max_total_num_tokens": 4096, "token_usage": 0.0,
                    "cache_hit_rate": 0.0, "max_running_requests": 8}
    messages = [{"role": "system", "content": "You are a careful assistant. " * 20},
                {"role": "user", "content": "Hello there"}]
    for _ in range(2):
        client.chat.completions.create(model="tiny-router", messages=messages, max_tokens=4, temperature=0)
    served.quiet()
    load = get(served, "/v1/loads").json()["loads"][0]
    got = samples(served.metrics())
    assert load["cache_hit_rate"] > 0  # the second request hit the first one's prefix
    assert load["cache_hit_rate"] == pytest.approx(got["radixcache:prefix_cache_hits_total"]
                                                   / got["radixcache:prefix_cache_queries_total"])
    assert load["token_usage"] == got["radixcache:kv_cache_usage_perc"] == got["vllm:kv_cache_usage_perc"]
    assert load["num_used_tokens"] == load["token_usage"] * 4096
    for vllm, ours in ALIASES.items():
        assert got[vllm] == got[ours], vllm
    with served.lm.manager.mutex:
        whole = served.lm.cache.whole_blocks
    assert whole > 0 and got["radixcache:cached_blocks"] == whole
    (model,) = get(served, "/v1/models").json()["data"]
    assert model["root"] == "tiny-router" and model["max_model_len"] == 1024
    assert model["owned_by"] not in ("vllm", "sglang")
    for path in ("/version", "/server_info"):  # a router finding these takes us for vLLM / SGLang
        assert get(served, path).status_code == 404


def test_kv_events_of_a_live_server_rebuild_its_tree(model_dir):
    """A subscriber's block set equals the tree's after requests, evictions (a small pool) and a
    tenant salt; the metrics show the publisher's batches and the same block count."""
    server = Served(model_dir, lm_options={"max_cache_tokens": 640, "kv_events": "tcp://127.0.0.1:*"},
                    api_keys=("k1", "k2"))
    pub = server.lm.manager.events
    sub = Subscriber(pub.endpoint, BS)
    try:
        sub.join(server.lm.manager.resync_events, pub.flush)
        for i in range(6):  # each about 150 tokens: the pool of 40 blocks has to evict
            key = "k1" if i % 2 else "k2"
            messages = [{"role": "user", "content": f"Question {i}: " + "tell me about routers " * 25}]
            server.client(api_key=key).chat.completions.create(model="tiny-router", messages=messages,
                                                               max_tokens=3, temperature=0)
        server.quiet()
        assert pub.flush()
        sub.receive_until(pub.batches)
        with server.lm.manager.mutex:
            assert sub.blocks == tree_blocks(server.lm.cache)
            whole = server.lm.cache.whole_blocks
        assert sub.removed > 0, "the small pool never evicted"
        got = samples(server.metrics())
        assert got["radixcache:cached_blocks"] == whole == sub.stored - sub.removed
        assert got["radixcache:kv_events_batches_total"] == pub.batches
        assert got["radixcache:kv_events_dropped_total"] == 0
        roots = {h for h, (parent, _) in sub.blocks.items() if parent is None}
        assert len(roots) >= 2  # two tenants: two namespaces, distinct chains
    finally:
        sub.close()
        server.stop()
        server.lm.close()
