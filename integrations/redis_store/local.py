"""A throwaway redis-server on a free loopback port, for tests, benchmarks and demos.

It keeps nothing on disk (``--save '' --appendonly no``; its scratch directory holds only its log)
and allows ``DEBUG`` from loopback clients (``--enable-debug-command local``: the slow-server tests
use ``DEBUG SLEEP``). Never for production: run Redis as a service there (docs/shared-tier.md).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis

INSTALL_COMMAND = "apt-get update && apt-get install -y redis-server"
START_TIMEOUT = 10.0


def find_binary(name: str = "redis-server") -> str:
    """Path of ``name`` on PATH; ``RuntimeError`` naming the install command when it is missing."""
    path = shutil.which(name)
    if path is None:
        raise RuntimeError(f"{name} is not installed; install it with: {INSTALL_COMMAND}")
    return path


def free_port(below: int = 65536) -> int:
    """A TCP port on 127.0.0.1, under ``below``, that nothing listens on right now."""
    for _ in range(1000):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < below:
            return port
    raise RuntimeError(f"no free loopback port below {below}")


class LocalRedis:
    """One redis-server on 127.0.0.1: ``start()``, ``kill()`` (SIGKILL), ``stop()``; ``url``, ``client()``.

    ``args`` are extra server options; ``password`` sets ``requirepass``; ``tls`` (a dict of
    ``ca``/``cert``/``key`` PEM paths) serves TLS only on ``port``.
    """

    def __init__(self, directory, *args: str, password: str | None = None, port: int | None = None,
                 tls: dict | None = None):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.args, self.password, self.tls = list(args), password, tls
        self.port = port or free_port()
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """``redis://[:password@]127.0.0.1:port/0`` (``rediss://`` with TLS, without a CA option)."""
        auth = f":{self.password}@" if self.password else ""
        return f"{'rediss' if self.tls else 'redis'}://{auth}127.0.0.1:{self.port}/0"

    def command(self) -> list[str]:
        """The server's command line."""
        cmd = [find_binary(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
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

    def start(self) -> LocalRedis:
        """Start it and wait until it answers PING; ``RuntimeError`` with its log if it does not."""
        command = self.command()
        with open(self.directory / "redis.log", "ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline and self.process.poll() is None:
            try:
                with self.client(socket_timeout=0.5) as c:
                    if c.ping():
                        return self
            except (redis.RedisError, OSError):
                time.sleep(0.02)
        self.stop()
        text = (self.directory / "redis.log").read_text(errors="replace")
        raise RuntimeError(f"redis-server on port {self.port} did not start:\n{text[-2000:]}")

    def client(self, **options) -> redis.Redis:
        """A plain redis-py client of this server (db 0 unless ``db=`` is given)."""
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

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
