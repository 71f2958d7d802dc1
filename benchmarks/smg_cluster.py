"""A cluster on loopback: ``radixcache serve`` replicas (optionally on one Redis) behind SMG.

Shared by ``benchmarks/cluster.py`` and the router tests. ``replica_command(model_dir, port,
...)`` is the ``radixcache serve`` command line of one replica; ``Router`` starts SGLang's model
gateway (``smg launch``, the ``smg`` PyPI wheel) in front of worker URLs with a policy, every
listener on 127.0.0.1 (its Prometheus one too: ``--prometheus-host``, a free port), checks that
start fast and fail over fast (health every second, loads polled every second, no shutdown grace),
and waits until it reports every worker healthy. ``Router.stop()`` terminates its process group.
``served_by(log_paths)`` maps each request id to the replica that served it, from the replicas'
``--log-token-ids`` files.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from server_process import free_port

FAST_CHECKS = ("--load-monitor-interval", "1", "--health-check-interval-secs", "1",
               "--health-failure-threshold", "2", "--health-check-timeout-secs", "1",
               "--worker-startup-check-interval", "1", "--shutdown-grace-period-secs", "0")


def smg_binary() -> str:
    """The ``smg`` launcher beside this interpreter (the venv's), else on PATH."""
    beside = Path(sys.executable).with_name("smg")
    found = str(beside) if beside.exists() else shutil.which("smg")
    if found is None:
        raise RuntimeError("smg is not installed: pip install 'smg==1.13.0' (in radixcache's [dev] extra)")
    return found


def replica_command(model_dir, port: int, *, store: str | None = None, token_log=None,
                    extra=()) -> list[str]:
    """``radixcache serve`` for one replica on 127.0.0.1:``port`` (``store``: a redis:// URL;
    ``token_log``: a ``--log-token-ids`` file)."""
    command = [sys.executable, "-m", "radixcache.app.cli", "serve", "--model", str(model_dir),
               "--host", "127.0.0.1", "--port", str(port), *extra]
    if store is not None:
        command += ["--store", store]
    if token_log is not None:
        command += ["--log-token-ids", str(token_log)]
    return command


class Router:
    """``smg launch`` on a free loopback port in front of ``worker_urls`` with ``policy``; ready
    (``/readiness`` counts every worker healthy) when constructed, else ``RuntimeError`` with its
    log. ``base_url`` is its root; ``api_key`` is given to SMG (it then requires it from clients
    and sends it to workers)."""

    def __init__(self, worker_urls, policy: str, log_path, *, api_key: str | None = None,
                 extra=(), startup_s: float = 60.0):
        self.port, self.prometheus_port = free_port(), free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.workers = list(worker_urls)
        self.api_key = api_key
        self.command = [smg_binary(), "launch", "--host", "127.0.0.1", "--port", str(self.port),
                        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.prometheus_port),
                        "--policy", policy, "--worker-urls", *self.workers, *FAST_CHECKS, *extra]
        if api_key is not None:
            self.command += ["--api-key", api_key]
        self.log_path = Path(log_path)
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True, env=dict(os.environ, NO_COLOR="1"))
        try:
            self._wait_ready(startup_s)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, startup_s: float) -> None:
        import httpx

        deadline, last = time.monotonic() + startup_s, "no answer"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"smg exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                r = httpx.get(self.base_url + "/readiness", timeout=2)
                last = r.text[:200]
                if r.status_code == 200 and r.json().get("healthy_workers") == len(self.workers):
                    return
            except (httpx.HTTPError, ValueError) as exc:
                last = type(exc).__name__
            time.sleep(0.2)
        raise RuntimeError(f"smg not ready after {startup_s:.0f} s ({last}): {self.log_tail()}")

    def get(self, path: str):
        """``GET path`` on the router (with its key when it has one)."""
        import httpx

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return httpx.get(self.base_url + path, headers=headers, timeout=10)

    def log_tail(self, n: int = 2000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-n:]

    def stop(self) -> None:
        """Terminate SMG's process group (killed after 10 s)."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
            except ProcessLookupError:
                pass
        self._log.close()


def served_by(log_paths) -> dict:
    """request id -> (index of the replica whose token log holds it, that log line)."""
    out = {}
    for index, path in enumerate(log_paths):
        path = Path(path)
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            if line.strip():
                entry = json.loads(line)
                out[entry["id"]] = (index, entry)
    return out
