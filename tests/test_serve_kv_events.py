"""``radixcache serve --kv-events ENDPOINT --kv-events-topic T``: the real command publishes its
blocks to a real ZMQ SUB subscriber on loopback. A request's whole blocks arrive as
``BlockStored`` named by the chained digests of ``radixcache.store.keys.chain_digests`` (the
store's own function, from the tree namespace ``(model identity, salt)``), evicting them sends
``BlockRemoved`` with the same names, and Ctrl-C closes the publisher after sending what it queued.
A bad endpoint stops the command with a message."""

import signal
import subprocess
import sys
import time

import httpx
import pytest

from kv_event_subscriber import Subscriber
from radixcache.integrations.hf.identity import model_identity
from radixcache.store.keys import chain_digests, token_bytes, tree_namespace_digest
from serve_helpers import ServeProcess, free_socket, write_model_dir

BS = 16
TOPIC = "replica-a"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model_dir(tmp_path_factory.mktemp("model") / "tiny-events", max_positions=1024, weights=True)


def event_names(model_dir, tokens):
    """The event hash of each whole block of ``tokens`` as the server must name it."""
    from radixcache.models import load_model

    model, _ = load_model(model_dir, dtype="float32")
    ns = tree_namespace_digest((model_identity(model), None), BS)
    return [int.from_bytes(d[:8], "big", signed=True) for d in chain_digests(ns, b"", token_bytes(tokens), BS)]


def events_of(sub, kind):
    return [e for _, events in sub.batches for e in events if e[0] == kind]


def complete(server, tokens):
    r = httpx.post(server.base_url + "/v1/completions", timeout=120,
                   json={"model": "tiny-events", "prompt": tokens, "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text


def receive_while(sub, condition, timeout=30.0):
    deadline = time.monotonic() + timeout
    while condition():
        assert time.monotonic() < deadline, f"events did not arrive: {sub.batches[-3:]}"
        if sub.socket.poll(200):
            sub.receive_one()


def test_serve_publishes_stored_and_removed_blocks(model_dir):
    with free_socket() as sock:
        endpoint = f"tcp://127.0.0.1:{sock.getsockname()[1]}"
    sub = Subscriber(endpoint, BS, topic=TOPIC)  # connects before the server binds; ZMQ retries
    server = ServeProcess(model_dir, "--dtype", "float32", "--block-size", str(BS), "--max-cache-tokens", "512",
                          "--no-history-precompute", "--kv-events", endpoint, "--kv-events-topic", TOPIC)
    try:
        assert f"KV events: {endpoint}" in server.output
        for i in range(20):  # until the subscription is live (a SUB joining late misses what came before)
            complete(server, [300 + i] * 40)
            if sub.socket.poll(500):
                break
        else:
            pytest.fail("no KV event reached the subscriber")
        prompt = list(range(1000, 1100))  # 6 whole blocks and a tail of 4
        names = event_names(model_dir, prompt)
        assert len(names) == 6
        complete(server, prompt)
        stored = lambda: {h for e in events_of(sub, "BlockStored") for h in e[1]}  # noqa: E731
        receive_while(sub, lambda: not set(names) <= stored())
        first = next(e for e in events_of(sub, "BlockStored") if names[0] in e[1])
        assert first[2] is None and first[3][:BS] == prompt[:BS] and first[4] == BS and first[6] == "GPU"
        for k in range(5):  # 5 more prompts of 7 blocks: a pool of 32 blocks evicts the first one's
            complete(server, list(range(2000 + 200 * k, 2100 + 200 * k)))
        removed = lambda: {h for e in events_of(sub, "BlockRemoved") for h in e[1]}  # noqa: E731
        receive_while(sub, lambda: not set(names) <= removed())
        server.proc.send_signal(signal.SIGINT)
        assert server.wait(timeout=60) == 0, server.output
        while sub.socket.poll(500):  # what was queued at the signal is sent before the socket closes
            sub.receive_one()
        sent = int(server.output.split("KV events closed: ")[1].split()[0])
        assert sent == sub.last_seq + 1, server.output
    finally:
        server.stop()
        sub.close()


def test_serve_refuses_a_bad_kv_events_endpoint(model_dir):
    run = subprocess.run([sys.executable, "-m", "radixcache.app.cli", "serve", "--model", str(model_dir),
                          "--kv-events", "127.0.0.1:5557"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "--kv-events 127.0.0.1:5557: expected a ZMQ endpoint" in run.stderr
    with free_socket() as sock:  # a port another socket holds cannot be bound
        sock.listen()
        port = sock.getsockname()[1]
        run = subprocess.run([sys.executable, "-m", "radixcache.app.cli", "serve", "--model", str(model_dir),
                              "--dtype", "float32", "--kv-events", f"tcp://127.0.0.1:{port}"],
                             capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and f"cannot bind 'tcp://127.0.0.1:{port}'" in run.stderr, run.stderr
