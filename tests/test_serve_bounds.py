"""Issue 33 items 3 and 4: bounded input, events and metrics that leak nothing by accident.

A body over ``--max-request-bytes`` is a 413 in each protocol's own error shape, refused before it is
read whole (a declared length unread, a chunked body once it passes the bound), so the server's
memory does not grow by the body's size; too many messages, tools or stop strings are a 413 too.
KV events refuse a non-loopback endpoint without ``--kv-events-allow-remote``; ``/metrics`` can be
put behind the key.
"""

from __future__ import annotations

import json
import select
import socket
import time

import httpx
import pytest

from radixcache.integrations.serve.options import ServeOptions
from serve_helpers import Served, write_model_dir

LIMIT = 1 << 20
ROUTES = ["/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens", "/v1/responses"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    directory = write_model_dir(tmp_path_factory.mktemp("bounds") / "tiny-smol", max_positions=512, weights=True)
    server = Served(directory, max_request_bytes=LIMIT, max_messages=8, max_tools=4, max_stop=3)
    yield server
    server.stop()


def rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def chunked_post(port: int, path: str, total: int) -> tuple[int, dict, int]:
    """POST ``total`` bytes of a never-ending JSON string to ``path`` with chunked encoding, on a
    raw socket, stopping as soon as the server answers: ``(status, body, bytes sent)``."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 "Transfer-Encoding: chunked\r\n\r\n".encode())
    chunk = b'{"model": "tiny-smol", "prompt": "' + b"a" * (64 * 1024)
    sent, answer = 0, b""
    try:
        while sent < total:
            if select.select([sock], [], [], 0)[0]:
                break
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            sent += len(chunk)
            chunk = b"a" * (64 * 1024)
    except (BrokenPipeError, ConnectionResetError):
        pass
    deadline = time.monotonic() + 30
    while b"\r\n\r\n" not in answer or len(answer) < _expected(answer):
        assert time.monotonic() < deadline, answer
        data = sock.recv(65536)
        if not data:
            break
        answer += data
    sock.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body[:_length(head)]), sent


def _length(head: bytes) -> int:
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 0


def _expected(answer: bytes) -> int:
    head, _, _ = answer.partition(b"\r\n\r\n")
    return len(head) + 4 + _length(head)


@pytest.mark.parametrize("path", ROUTES)
def test_a_body_over_the_bound_is_413_in_the_protocols_shape_and_never_held(served, path):
    before = rss()
    status, body, sent = chunked_post(served.live.port, path, 64 << 20)
    assert status == 413
    assert sent < 16 << 20  # refused as soon as it passed the bound, not at its end
    assert rss() - before < 16 << 20  # the server did not keep it
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and body["error"]["type"] == "request_too_large"
        assert "--max-request-bytes" in body["error"]["message"]
    else:
        assert body["error"]["code"] == "request_too_large" and "--max-request-bytes" in body["error"]["message"]
    declared = httpx.post(served.base_url + path, content=b"{" + b" " * LIMIT + b"}", timeout=30,
                          headers={"content-type": "application/json"})
    assert declared.status_code == 413


@pytest.mark.parametrize("path, field, body", [
    ("/v1/chat/completions", "messages", {"messages": [{"role": "user", "content": "hi"}] * 9}),
    ("/v1/chat/completions", "tools", {"messages": [{"role": "user", "content": "hi"}],
                                       "tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(5)]}),
    ("/v1/messages", "stop_sequences", {"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}],
                                        "stop_sequences": ["a", "b", "c", "d"]}),
    ("/v1/responses", "input", {"input": [{"role": "user", "content": "hi"}] * 9}),
])
def test_too_many_messages_tools_or_stop_strings_are_413(served, path, field, body):
    r = httpx.post(served.base_url + path, json={"model": "tiny-smol", **body}, timeout=30)
    assert r.status_code == 413, r.text
    error = r.json()["error"]
    assert field in error["message"] and "--max-" in error["message"]


def test_requests_inside_the_bounds_are_served(served):
    r = httpx.post(served.base_url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny-smol", "messages": [{"role": "user", "content": "hi"}] * 8, "max_tokens": 2, "stop": ["x"]})
    assert r.status_code == 200, r.text


def test_kv_events_refuse_a_non_loopback_endpoint_without_the_flag(tmp_path):
    from radixcache.app.cli import build_parser
    from radixcache.kv_events import KVEventPublisher

    model = write_model_dir(tmp_path / "m")
    parse = build_parser().parse_args
    for endpoint in ("tcp://0.0.0.0:5557", "tcp://*:5557", "tcp://10.1.2.3:5557"):
        with pytest.raises(ValueError, match="--kv-events-allow-remote"):
            ServeOptions.from_args(parse(["serve", "--model", str(model), "--kv-events", endpoint]))
        with pytest.raises(ValueError, match="allow_remote"):
            KVEventPublisher(endpoint)
    allowed = ServeOptions.from_args(parse(["serve", "--model", str(model), "--kv-events", "tcp://0.0.0.0:5557",
                                            "--kv-events-allow-remote"]))
    assert allowed.kv_events_allow_remote
    for endpoint in ("tcp://127.0.0.1:5557", "tcp://localhost:5557", "tcp://[::1]:5557", f"ipc://{tmp_path}/kv"):
        ServeOptions.from_args(parse(["serve", "--model", str(model), "--kv-events", endpoint]))
    publisher = KVEventPublisher(f"ipc://{tmp_path}/events")
    publisher.close()


def test_metrics_can_be_put_behind_the_key(tmp_path):
    directory = write_model_dir(tmp_path / "tiny-smol", max_positions=512, weights=True)
    served = Served(directory, api_keys=("k1",), metrics_require_key=True)
    try:
        assert httpx.get(served.base_url + "/metrics", timeout=10).status_code == 401
        ok = httpx.get(served.base_url + "/metrics", headers={"Authorization": "Bearer k1"}, timeout=10)
        assert ok.status_code == 200 and "radixcache:" in ok.text
    finally:
        served.stop()
    with pytest.raises(ValueError, match="needs at least one --api-key"):
        from radixcache.app.cli import build_parser

        ServeOptions.from_args(build_parser().parse_args(["serve", "--model", str(directory),
                                                          "--metrics-require-key"]))


def test_the_default_body_bound_follows_the_context():
    assert ServeOptions().request_bytes(8192) == 4 << 20
    assert ServeOptions().request_bytes(1 << 20) == 32 << 20
    assert ServeOptions(max_request_bytes=1000).request_bytes(1 << 20) == 1000
