"""Keys, tenant salts, the in-flight gate, prompt checks, and the metrics registry."""

import prometheus_client
import pytest
from prometheus_client.parser import text_string_to_metric_families

from radixcache.integrations.serve.engine.client import EngineCounts
from radixcache.integrations.serve.errors import APIError
from radixcache.integrations.serve.admission import AdmissionGate, max_new_tokens, resolve_model
from radixcache.integrations.serve.access import cache_salt, authenticate, authenticate_bearer, tenant_of
from radixcache.integrations.serve.telemetry.metrics import ServerMetrics


def status_of(fn, *args):
    with pytest.raises(APIError) as info:
        fn(*args)
    return info.value


def test_bearer_keys():
    assert authenticate_bearer(None, ()) is None  # no keys: open
    assert authenticate_bearer("Bearer k1", ("k1", "k2")) == "k1"
    assert authenticate_bearer("bearer   k2 ", ("k1", "k2")) == "k2"
    for header in (None, "", "Bearer", "Bearer ", "Basic k1", "Bearer k3", "k1", "Bearer k1x"):
        err = status_of(authenticate_bearer, header, ("k1", "k2"))
        assert err.status == 401 and err.code == "invalid_api_key" and "k1" not in err.message
        assert err.headers["WWW-Authenticate"] == "Bearer"


def test_x_api_key_is_the_same_key():
    """Anthropic's clients send ``x-api-key``; it is the bearer's key by another header."""
    keys = ("k1", "k2")
    assert authenticate(None, "k2", keys) == "k2"
    assert authenticate("Bearer k1", None, keys) == "k1"
    assert authenticate("Bearer nope", "k1", keys) == "k1"  # either header may carry it
    for auth, x in [(None, None), (None, ""), (None, "k3"), ("Basic k1", None), ("Bearer k3", "k4")]:
        assert status_of(authenticate, auth, x, keys).status == 401
    assert authenticate(None, None, ()) is None


def test_tenants_and_cache_salts():
    assert tenant_of("k1", shared=True) is None  # --share-cache-across-keys: one cache for all
    assert tenant_of(None, shared=False) is None  # a server without keys: one tenant
    a, b = tenant_of("k1", False), tenant_of("k2", False)
    assert a != b and a == tenant_of("k1", False) and len(a) == 32 and "k1" not in a
    assert cache_salt(a, None) == a and cache_salt(None, None) is None
    # a request's own salt narrows its tenant's: never equal to another tenant's with that salt
    assert len({cache_salt(a, "s"), cache_salt(b, "s"), cache_salt(None, "s"), cache_salt(a, "t"), a}) == 5
    assert cache_salt(a, "s") == cache_salt(a, "s")


def test_model_resolution():
    assert resolve_model(None, ["m", "alias"]) == "m"
    assert resolve_model("alias", ["m", "alias"]) == "alias"
    err = status_of(resolve_model, "gpt-4o", ["m"])
    assert err.status == 404 and err.code == "model_not_found" and err.param == "model"


def test_prompt_limits():
    assert max_new_tokens(100, None, 512, None) == 412  # up to the context
    assert max_new_tokens(100, 50, 512, 1024) == 50
    for args, param in [((512, None, 512, None), "messages"), ((600, 5, 512, None), "messages"),
                        ((300, None, 512, 256), "messages"), ((256, 1, 512, 256), "messages"),
                        ((500, 20, 512, None), "max_tokens")]:
        err = status_of(max_new_tokens, *args)
        assert err.status == 400 and err.code == "context_length_exceeded" and err.param == param
    assert "pool" in status_of(max_new_tokens, 300, None, 512, 256).message


def test_output_cap_and_clamp():
    """``--max-output-tokens`` lowers every request's budget (a request without one gets the cap);
    ``clamp`` (Anthropic's ``max_tokens`` is a ceiling) lowers an over-long ask to what the context
    leaves instead of refusing it."""
    assert max_new_tokens(100, None, 512, None, cap=64) == 64
    assert max_new_tokens(100, 32000, 512, None, cap=64) == 64
    assert max_new_tokens(100, 10, 512, None, cap=64) == 10
    assert max_new_tokens(500, None, 512, None, cap=64) == 12  # the context still bounds it
    assert max_new_tokens(500, 32000, 512, None, clamp=True) == 12
    assert status_of(max_new_tokens, 500, 32000, 512, None).param == "max_tokens"
    assert status_of(max_new_tokens, 500, 32000, 512, None, 64).param == "max_tokens"


def test_admission_gate():
    gate = AdmissionGate(2)
    a, b = gate.acquire(), gate.acquire()
    err = status_of(gate.acquire)
    assert err.status == 429 and err.headers["Retry-After"] == "1" and gate.in_flight == 2
    a.release()
    a.release()  # idempotent
    assert gate.in_flight == 1
    c = gate.acquire()
    b.release()
    c.release()
    assert gate.in_flight == 0
    with pytest.raises(ValueError):
        AdmissionGate(0)


def samples(metrics):
    text = metrics.render()[0].decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_names_values_and_own_registry():
    m = ServerMetrics()
    m.attach(None, ledger=lambda: {"queried_tokens": 1200, "hit_tokens": 960})  # the manager's ledger
    m.observe_first_token(0.05)
    m.observe_inter_token(0.01)
    m.observe_finished("stop", 24, 1.5)
    m.observe_rejected(400)
    m.observe_short_hit("evicted", 64)
    m.observe_divergence("generation_prompt")
    m.observe_precompute(1040)
    got = samples(m)
    assert got[("radixcache:prefix_cache_queries_total", ())] == 1200
    assert got[("radixcache:prefix_cache_hits_total", ())] == 960
    assert got[("radixcache:prompt_tokens_total", ())] == 1200
    assert got[("radixcache:time_to_first_token_seconds_count", ())] == 1
    assert got[("radixcache:inter_token_latency_seconds_count", ())] == 1
    assert got[("radixcache:request_success_total", (("finish_reason", "stop"),))] == 1
    assert got[("radixcache:generation_tokens_total", ())] == 24
    assert got[("radixcache:requests_rejected_total", (("status", "400"),))] == 1
    assert got[("radixcache:prefix_cache_short_hits_total", (("reason", "evicted"),))] == 1
    assert got[("radixcache:prefix_cache_short_hit_tokens_total", (("reason", "evicted"),))] == 64
    assert got[("radixcache:history_divergence_total", (("reason", "generation_prompt"),))] == 1
    assert got[("radixcache:history_precompute_tokens_total", ())] == 1040
    assert got[("radixcache:num_requests_running", ())] == 0 and got[("radixcache:kv_cache_usage_perc", ())] == 0
    m.attach(lambda: EngineCounts(running=3, waiting=5, used_blocks=30, total_blocks=120))
    got = samples(m)
    assert got[("radixcache:num_requests_running", ())] == 3
    assert got[("radixcache:num_requests_waiting", ())] == 5
    assert got[("radixcache:kv_cache_usage_perc", ())] == 0.25
    assert m.render()[1].startswith("text/plain")
    # a second server in the same process has its own numbers, and the global registry has none
    assert samples(ServerMetrics())[("radixcache:prefix_cache_queries_total", ())] == 0
    assert not [f for f in prometheus_client.REGISTRY.collect() if f.name.startswith("radixcache")]
