"""Fixtures: real redis-server processes on free loopback ports, stopped when their test ends.

Built on ``radixcache.integrations.redis_store.local.LocalRedis``. Without ``redis-server`` on PATH
every test that needs one fails, naming the install command.
"""

from __future__ import annotations

import subprocess
import time

import pytest

from radixcache.integrations.redis_store.local import INSTALL_COMMAND, LocalRedis, find_binary, free_port


def redis_binary(name: str = "redis-server") -> str:
    """Path of ``name``; fails the test with the install command when it is missing."""
    try:
        return find_binary(name)
    except RuntimeError:
        pytest.fail(f"{name} is not installed; the store tests need a real one: run `{INSTALL_COMMAND}`")


def start(directory, *args, **options) -> LocalRedis:
    """A started ``LocalRedis`` (the test fails, with the server's log, if it cannot start)."""
    redis_binary()
    try:
        return LocalRedis(directory, *args, **options).start()
    except RuntimeError as e:
        pytest.fail(str(e))


@pytest.fixture
def redis_server(tmp_path):
    """A fresh redis-server (no password) for one test."""
    server = start(tmp_path / "redis")
    yield server
    server.stop()


@pytest.fixture
def redis_auth_server(tmp_path):
    """A fresh redis-server with ``requirepass`` (``server.password``) for one test."""
    server = start(tmp_path / "redis-auth", password="s3cret-pass")
    yield server
    server.stop()


@pytest.fixture
def redis_servers(tmp_path):
    """A factory ``make(*args, **options) -> started LocalRedis`` whose servers stop with the test."""
    made = []

    def make(*args, **options):
        server = start(tmp_path / f"redis-{len(made)}", *args, **options)
        made.append(server)
        return server

    yield make
    for server in made:
        server.stop()


@pytest.fixture
def redis_cluster(redis_servers):
    """A 3-primary Redis Cluster on loopback (``redis-cli --cluster create``); yields its nodes."""
    nodes = [redis_servers("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                           "--cluster-node-timeout", "2000", port=free_port(below=55536))
             for _ in range(3)]  # a node also listens on its port + 10000
    result = subprocess.run([redis_binary("redis-cli"), "--cluster", "create",
                             *[f"127.0.0.1:{n.port}" for n in nodes], "--cluster-replicas", "0",
                             "--cluster-yes"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    deadline = time.monotonic() + 30
    states = []
    while time.monotonic() < deadline:
        states = [n.client().cluster("info").get("cluster_state") for n in nodes]
        if all(s == "ok" for s in states):
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"cluster did not become ok: {states}")
    yield nodes
