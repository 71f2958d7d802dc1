"""A benchmarked server as a subprocess: started on a free loopback port, offline, until ready.

``ServerProcess(name, command, log_dir, startup_s)`` starts ``command`` (which names ``--port``)
with the hub switched off (``HF_HUB_OFFLINE=1``), writes its output to ``log_dir/NAME.log`` and
waits until ``GET /health`` answers 200; ``model`` is then the first name of ``GET /v1/models``.
It raises ``RuntimeError`` (with the reason and the process stopped) when the server exits, stays
unready past ``startup_s``, or says it has no generation engine. ``api_key``: the bearer key
``/v1/models`` needs (a server started with ``--api-key``). ``stop()`` terminates it (kills
it after 20 s).
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server started as a subprocess; ``model`` is the name it serves (from ``/v1/models``)."""

    def __init__(self, name: str, command: list[str], log_dir: Path, startup_s: float,
                 api_key: str | None = None):
        self.name, self.port = name, int(command[command.index("--port") + 1])
        self.api_key = api_key
        self.log = log_dir / f"{name}.log"
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
        self._log_file = open(self.log, "w")
        self.proc = subprocess.Popen(command, stdout=self._log_file, stderr=subprocess.STDOUT, env=env)
        self.base = f"http://127.0.0.1:{self.port}"
        try:
            self.model = self._wait_ready(startup_s)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, startup_s: float) -> str:
        import httpx

        deadline, last = time.monotonic() + startup_s, "no answer"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}: {self.tail()}")
            try:
                health = httpx.get(self.base + "/health", timeout=5)
                if health.status_code == 200:
                    headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
                    return httpx.get(self.base + "/v1/models", headers=headers, timeout=5).json()["data"][0]["id"]
                last = f"GET /health answered {health.status_code}: {health.text[:200]}"
                if "no generation engine" in health.text:  # up, but it cannot generate: no use waiting
                    break
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}"
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not ready ({last})")

    def tail(self, n: int = 800) -> str:
        return self.log.read_text(errors="replace")[-n:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=20)
        self._log_file.close()
