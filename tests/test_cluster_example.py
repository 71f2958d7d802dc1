"""``examples/cluster.sh`` as a user runs it: 2 replicas (a tiny random Llama) on one redis-server
behind SMG on free loopback ports, with an API key (``SERVE_ARGS`` and ``SMG_ARGS``); a chat
request through the router succeeds, the replicas
publish KV events, and Ctrl-C (SIGINT to the script's process group, as a terminal sends it) stops
every process it started."""

import pytest
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import zmq

from serve_helpers import write_model_dir

sys.path.append(str(Path(__file__).resolve().parent.parent / "benchmarks"))
from server_process import free_port  # noqa: E402

pytestmark = pytest.mark.cluster  # `make test-all` (not `make test`)

KEY = "sk-example"
SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "cluster.sh"


def group_alive(pgid):
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def test_cluster_script_serves_and_stops(tmp_path):
    model_dir = write_model_dir(tmp_path / "tiny-example", max_positions=1024, weights=True)
    ports = {name: free_port() for name in ("ROUTER_PORT", "METRICS_PORT", "REDIS_PORT")}
    base, events = free_port(), free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
               SERVE_ARGS=f"--model {model_dir} --dtype float32 --max-cache-tokens 4096 --api-key {KEY}",
               SMG_ARGS=f"--api-key {KEY}",
               BASE_PORT=str(base), EVENTS_PORT=str(events), **{k: str(v) for k, v in ports.items()})
    log = open(tmp_path / "cluster.log", "w")
    proc = subprocess.Popen(["bash", str(SCRIPT), "2"], env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    router = f"http://127.0.0.1:{ports['ROUTER_PORT']}"
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    try:
        deadline = time.monotonic() + 240
        while "behind SMG" not in (tmp_path / "cluster.log").read_text():
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "cluster.log").read_text()
            time.sleep(0.5)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        for i in range(2):
            sub.connect(f"tcp://127.0.0.1:{events + i}")
        client = openai.OpenAI(base_url=router + "/v1", api_key=KEY, max_retries=0, timeout=120)
        for _ in range(10):  # until the subscription is live, then one event batch has arrived
            reply = client.chat.completions.create(model="tiny-example", max_tokens=4, temperature=0,
                                                   messages=[{"role": "user", "content": "Hello " * 40}])
            assert reply.choices[0].finish_reason in ("stop", "length")
            if sub.poll(1000):
                break
        else:
            raise AssertionError("no KV event from either replica")
        assert sub.recv_multipart()[0] == b"kv"
        assert httpx.get(router + "/readiness", timeout=5).json()["healthy_workers"] == 2
        unkeyed = httpx.post(router + "/v1/chat/completions", timeout=30,  # SMG wants the key
                             json={"model": "tiny-example", "messages": [{"role": "user", "content": "Hi"}]})
        assert unkeyed.status_code == 401, unkeyed.text
    finally:
        sub.close(linger=0)
        context.term()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
        try:
            code = proc.wait(timeout=60)
        finally:
            deadline = time.monotonic() + 30
            while group_alive(proc.pid) and time.monotonic() < deadline:
                time.sleep(0.2)
            left = group_alive(proc.pid)
            if left:
                os.killpg(proc.pid, signal.SIGKILL)
            log.close()
    output = (tmp_path / "cluster.log").read_text()
    assert not left, f"processes survived Ctrl-C:\n{output}"
    assert "cluster: stopping" in output and code in (0, 130), output
