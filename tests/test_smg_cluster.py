"""Two ``radixcache serve`` replicas (a tiny random Llama) on one real redis-server, behind a real
SGLang model gateway (``smg launch``, pinned in the ``[dev]`` extra), every process on loopback.

- ``cache_aware`` (keys on, so SMG's load polls carry the bearer): 16 concurrent sessions of 3
  turns through SMG with the ``openai`` client; every session stays on one replica (from the
  replicas' ``--log-token-ids`` files, by response id), every turn after the first hits the whole
  blocks it shares with the previous prompt, each replica takes at least 25 % of the queried
  prompt tokens (read from ``vllm:prefix_cache_queries_total`` in SMG's ``/engine_metrics``), and
  SMG's ``/get_loads`` shows both replicas' ``/v1/loads``.
- ``round_robin`` with a 1 s pause between turns: a turn that lands on the other replica is served
  the session's blocks from Redis.
- A replica killed mid-run: every request sent after that succeeds through the router.

SMG rewrites bodies before forwarding them (``logprobs: false``, ``stream``, ``tool_choice``);
the replicas accept them as sent. Every process started here is stopped by its fixture.
"""

import sys
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

import redis_servers
from radixcache.tokens import common_prefix
from serve_helpers import write_model_dir

sys.path.append(str(Path(__file__).resolve().parent.parent / "benchmarks"))
from cluster_sessions import run_sessions  # noqa: E402
from server_process import ServerProcess, free_port  # noqa: E402
from smg_cluster import Router, replica_command, served_by  # noqa: E402

pytestmark = pytest.mark.cluster  # `make test-all` (not `make test`)

KEY = "sk-cluster"
BS = 16
POOL = 16384
MODEL = "tiny-cluster"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model_dir(tmp_path_factory.mktemp("model") / MODEL, max_positions=2048, weights=True)


@pytest.fixture(scope="module")
def redis(tmp_path_factory):
    server = redis_servers.start(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


class Replicas:
    """``n`` replicas, each with a token log, optionally on ``store`` and behind ``key``."""

    def __init__(self, model_dir, log_dir, n=2, store=None, key=None):
        self.logs = [log_dir / f"tokens-{i}.jsonl" for i in range(n)]
        extra = ["--dtype", "float32", "--block-size", str(BS), "--max-cache-tokens", str(POOL),
                 "--max-running", "16"] + (["--api-key", key] if key else [])
        self.procs = []
        try:
            for i in range(n):
                command = replica_command(model_dir, free_port(), store=store, token_log=self.logs[i], extra=extra)
                self.procs.append(ServerProcess(f"replica-{i}", command, log_dir, 180, api_key=key))
        except BaseException:
            self.stop()
            raise
        self.urls = [p.base for p in self.procs]

    def served(self, turns, timeout_s=30.0):
        """``served_by`` the replicas' token logs once they hold every one of ``turns``: a replica
        writes a request's line when it closes the request, which can be just after the client
        has read the whole reply."""
        deadline = time.monotonic() + timeout_s
        while True:
            served = served_by(self.logs)
            missing = [t.id for t in turns if t.id not in served]
            if not missing:
                return served
            assert time.monotonic() < deadline, f"no replica logged {missing} within {timeout_s} s"
            time.sleep(0.05)

    def stop(self):
        for proc in self.procs:
            proc.stop()


@pytest.fixture(scope="module")
def replicas(model_dir, redis, tmp_path_factory):
    group = Replicas(model_dir, tmp_path_factory.mktemp("replicas"), store=redis.url, key=KEY)
    yield group
    group.stop()


def worker_metric(router, name):
    """``name`` per worker URL, from SMG's ``/engine_metrics`` (the workers' /metrics, labelled)."""
    r = router.get("/engine_metrics")
    assert r.status_code == 200, r.text
    return {s.labels["worker_addr"]: s.value for f in text_string_to_metric_families(r.text)
            for s in f.samples if s.name == name}


def sessions_of(turns):
    out = {}
    for turn in turns:
        out.setdefault(turn.session, []).append(turn)
    return out


def assert_hits_previous_turn(previous, current):
    """The cached tokens of ``current`` cover every whole block it shares with ``previous``."""
    shared = common_prefix(previous["prompt_ids"], current["prompt_ids"])
    assert current["cached_tokens"] >= shared // BS * BS, (shared, current["cached_tokens"])


def test_cache_aware_keeps_sessions_on_one_replica(replicas, tmp_path):
    router = Router(replicas.urls, "cache_aware", tmp_path / "smg.log", api_key=KEY)
    try:
        queried_before = worker_metric(router, "vllm:prefix_cache_queries_total")
        turns = run_sessions(router.base_url, MODEL, sessions=16, turns=3, stagger_s=0.1, api_key=KEY)
        served = replicas.served(turns)
        for session, its_turns in sessions_of(turns).items():
            homes = {served[t.id][0] for t in its_turns}
            assert len(homes) == 1, f"session {session} moved between replicas {homes}"
            for previous, current in zip(its_turns, its_turns[1:]):
                assert_hits_previous_turn(served[previous.id][1], served[current.id][1])
                assert current.cached_tokens == served[current.id][1]["cached_tokens"] > 0
        queried = worker_metric(router, "vllm:prefix_cache_queries_total")
        ours = worker_metric(router, "radixcache:prefix_cache_queries_total")
        assert queried == ours  # the alias reads the same counter
        taken = {url: queried[url] - queried_before.get(url, 0) for url in replicas.urls}
        total = sum(taken.values())
        assert total == sum(t.prompt_tokens for t in turns)
        assert all(v >= 0.25 * total for v in taken.values()), taken
        deadline = time.monotonic() + 10  # SMG polls /v1/loads every second, with the bearer key
        while True:
            loads = {entry["worker"]: entry for entry in router.get("/get_loads").json()["loads"]}
            if set(loads) == set(replicas.urls) and all(e["cache_hit_rate"] > 0 for e in loads.values()):
                break
            assert time.monotonic() < deadline, loads
            time.sleep(0.5)
        assert all(e["max_total_num_tokens"] == POOL and e["max_running_requests"] == 16 for e in loads.values())
    finally:
        router.stop()


def test_round_robin_serves_the_other_replica_from_redis(replicas, tmp_path):
    router = Router(replicas.urls, "round_robin", tmp_path / "smg.log", api_key=KEY)
    try:
        hits_before = sum(worker_metric(router, "radixcache:store_hit_tokens_total").values())
        turns = []
        for k in range(2):  # one session at a time: round_robin then alternates at every turn
            turns += run_sessions(router.base_url, MODEL, sessions=1, turns=3, pause_s=1.0, api_key=KEY,
                                  first_session=100 + k)
        served = replicas.served(turns)
        moved = 0
        for its_turns in sessions_of(turns).values():
            for previous, current in zip(its_turns, its_turns[1:]):
                if served[previous.id][0] != served[current.id][0]:
                    moved += 1
                    assert_hits_previous_turn(served[previous.id][1], served[current.id][1])
        assert moved >= 3, f"round_robin moved only {moved} of 4 turns"
        hits = sum(worker_metric(router, "radixcache:store_hit_tokens_total").values()) - hits_before
        assert hits > 0
    finally:
        router.stop()


def test_a_killed_replica_fails_over(model_dir, tmp_path):
    group = Replicas(model_dir, tmp_path, n=2)
    router = None
    try:
        router = Router(group.urls, "cache_aware", tmp_path / "smg.log")
        run_sessions(router.base_url, MODEL, sessions=2, turns=1)
        group.procs[1].proc.kill()
        group.procs[1].proc.wait(timeout=30)
        with pytest.raises(httpx.HTTPError):
            httpx.get(group.urls[1] + "/health", timeout=2)
        turns = run_sessions(router.base_url, MODEL, sessions=6, turns=2, first_session=200)
        served = group.served(turns)
        assert {served[t.id][0] for t in turns} == {0}
    finally:
        if router is not None:
            router.stop()
        group.stop()
