"""Real redis-server processes on free loopback ports for the store tests (and their fixtures).

Every server runs with ``--save '' --appendonly no`` (nothing on disk but a scratch directory),
``--enable-debug-command local`` (the slow-server tests use ``DEBUG SLEEP``) and is stopped when its
test ends. Without ``redis-server`` on PATH every test that needs one fails, naming the install
command.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
import redis

INSTALL = "apt-get update && apt-get install -y redis-server"
START_TIMEOUT = 10.0


def free_port(below: int = 65536) -> int:
    """A TCP port on 127.0.0.1, under ``below``, that nothing listens on right now."""
    for _ in range(1000):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < below:
            return port
    pytest.fail(f"no free loopback port below {below}")


def redis_binary(name: str = "redis-server") -> str:
    """Path of ``name``; fails the test with the install command when it is missing."""
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed; the store tests need a real one: run `{INSTALL}`")
    return path


class RedisServer:
    """One redis-server on 127.0.0.1: ``start``, ``kill`` (SIGKILL), ``stop``; ``url``, ``client()``."""

    def __init__(self, directory: Path, *args: str, password: str | None = None,
                 port: int | None = None, tls: dict | None = None):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.args, self.password, self.tls = list(args), password, tls
        self.port = port or free_port()
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """``redis://[:password@]127.0.0.1:port/0`` (``rediss://`` with TLS, no CA option)."""
        auth = f":{self.password}@" if self.password else ""
        return f"{'rediss' if self.tls else 'redis'}://{auth}127.0.0.1:{self.port}/0"

    def command(self) -> list[str]:
        cmd = [redis_binary(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
               "--dir", str(self.directory), "--enable-debug-command", "local"]
        if self.tls:
            cmd += ["--port", "0", "--tls-port", str(self.port), "--tls-auth-clients", "no",
                    "--tls-cert-file", self.tls["cert"], "--tls-key-file", self.tls["key"],
                    "--tls-ca-cert-file", self.tls["ca"]]
        else:
            cmd += ["--port", str(self.port)]
        if self.password:
            cmd += ["--requirepass", self.password]
        return cmd + self.args

    def start(self) -> RedisServer:
        """Start it and wait until it answers PING (fails the test with its log if it does not)."""
        log = open(self.directory / "redis.log", "ab")
        self.process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                break
            try:
                with self.client(socket_timeout=0.5) as c:
                    if c.ping():
                        return self
            except (redis.RedisError, OSError):
                time.sleep(0.02)
        self.stop()
        text = (self.directory / "redis.log").read_text(errors="replace")
        pytest.fail(f"redis-server on port {self.port} did not start:\n{text[-2000:]}")

    def client(self, **options) -> redis.Redis:
        """A plain redis-py client of this server (db 0)."""
        if self.tls:
            options.setdefault("ssl", True)
            options.setdefault("ssl_ca_certs", self.tls["ca"])
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password, **options)

    def kill(self) -> None:
        """SIGKILL the server (a crash: no shutdown)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)

    def stop(self) -> None:
        """Terminate the server and wait for it."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


@pytest.fixture
def redis_server(tmp_path):
    """A fresh redis-server (no password) for one test."""
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


@pytest.fixture
def redis_auth_server(tmp_path):
    """A fresh redis-server with ``requirepass`` (``server.password``) for one test."""
    server = RedisServer(tmp_path / "redis-auth", password="s3cret-pass").start()
    yield server
    server.stop()


@pytest.fixture
def redis_servers(tmp_path):
    """A factory ``make(*args, **kw) -> started RedisServer`` whose servers stop with the test."""
    made = []

    def make(*args, **kw):
        server = RedisServer(tmp_path / f"redis-{len(made)}", *args, **kw)
        made.append(server)
        return server.start()

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
    while time.monotonic() < deadline:
        states = [n.client().cluster("info").get("cluster_state") for n in nodes]
        if all(s == "ok" for s in states):
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"cluster did not become ok: {states}")
    yield nodes
