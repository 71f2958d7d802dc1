"""Ctrl-C on a busy ``radixcache serve``: the real command as a subprocess, the real ``openai`` client.

With a stream and a non-streamed request generating (``max_tokens=2000``), SIGINT aborts both at
once: the stream ends with an error event saying the server is shutting down (the client raises it),
the non-streamed request gets a 503 saying the same, the store is flushed, and the process exits
with status 0 well before the requests could have finished. A second SIGINT exits at once.
"""

import signal
import threading
import time

import openai
import pytest

from serve_helpers import ServeProcess, metric, write_model_dir

BS = 16
MESSAGES = [{"role": "system", "content": "You are a careful assistant. " * 8},
            {"role": "user", "content": "Write a very long essay about caches."}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model_dir(tmp_path_factory.mktemp("model") / "tiny", max_positions=4096, weights=True)


class Running:
    """One long request in a thread: streamed (``content`` grows chunk by chunk) or not."""

    def __init__(self, server: ServeProcess, stream: bool):
        self.stream, self.chunks, self.content, self.error, self.body = stream, 0, "", None, None
        self.thread = threading.Thread(target=self._run, args=(server,), daemon=True)
        self.thread.start()

    def _run(self, server):
        try:
            with server.client(timeout=120) as client:
                if not self.stream:
                    self.body = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2000,
                                                               temperature=0)
                    return
                for chunk in client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2000,
                                                            temperature=0, stream=True):
                    self.chunks += 1
                    self.content += (chunk.choices[0].delta.content or "") if chunk.choices else ""
        except Exception as exc:  # noqa: BLE001 - what the client raised is what the test checks
            self.error = exc

    def join(self, timeout=60.0):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the client never heard back"


def wait_until(condition, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def running_requests(server) -> float:
    import httpx

    return metric(httpx.get(server.base_url + "/metrics", timeout=10).text, "num_requests_running")


def test_ctrl_c_aborts_a_stream_and_a_request_flushes_the_store_and_exits(model_dir, redis_server):
    server = ServeProcess(model_dir, "--max-cache-tokens", "8192", "--store", redis_server.url,
                          "--log-level", "info")
    try:
        stream, plain = Running(server, stream=True), Running(server, stream=False)
        wait_until(lambda: stream.chunks >= 5 and running_requests(server) == 2)
        server.proc.send_signal(signal.SIGINT)
        stream.join()
        plain.join()
        code = server.wait(timeout=60)
    finally:
        output = server.stop()
    assert code == 0, output  # not the bound's status 1: it stopped by itself
    assert "Traceback" not in output, output
    # the stream ended with the server's reason, short of its 2,000 tokens
    assert isinstance(stream.error, openai.APIError) and "shutting down" in stream.error.message, stream.error
    assert stream.chunks < 2000 and stream.content
    # the non-streamed request got a 503 saying the same
    assert isinstance(plain.error, openai.InternalServerError), (plain.error, plain.body)
    assert plain.error.status_code == 503 and plain.error.code == "server_shutting_down"
    assert "shutting down" in plain.error.message
    # the store was flushed before the exit: every whole block of the shared prompt is in Redis
    assert "store flushed" in output and ", 0 dropped" in output, output
    prompt_blocks = len(MESSAGES[0]["content"]) // 8 // BS  # well under the prompt's whole blocks
    assert redis_server.client().dbsize() >= prompt_blocks


def stalled_upload(server):
    """A client that sends the headers of a request and part of its body, then nothing: its response
    never starts, so uvicorn's shutdown waits for it (up to its grace) after the first signal."""
    import socket

    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 1000\r\n\r\n{")
    return sock


def test_a_second_ctrl_c_exits_at_once(model_dir):
    server = ServeProcess(model_dir, "--max-cache-tokens", "8192", "--log-level", "warning")
    try:
        stream = Running(server, stream=True)
        wait_until(lambda: stream.chunks >= 5)
        with stalled_upload(server):
            server.proc.send_signal(signal.SIGINT)
            server.wait_for_output("SIGINT: aborting the running requests")
            stream.join()  # the first signal aborted the stream; the stalled upload holds the exit
            assert server.proc.poll() is None
            server.proc.send_signal(signal.SIGINT)
            code = server.wait(timeout=10)
    finally:
        output = server.stop()
    assert code == 128 + signal.SIGINT, output
    assert "second SIGINT: exiting now" in output, output
    assert "shutting down" in stream.error.message and stream.chunks < 2000


def test_a_client_that_never_finishes_delays_the_exit_by_the_grace_only(model_dir):
    from radixcache.integrations.serve.server import BOUND_S

    server = ServeProcess(model_dir, "--max-cache-tokens", "8192", "--log-level", "warning")
    try:
        with stalled_upload(server):
            server.proc.send_signal(signal.SIGINT)
            code = server.wait(timeout=BOUND_S + 30)
    finally:
        output = server.stop()
    # uvicorn gave up on the upload after its grace, then the usual shutdown: not the bound's status 1
    assert code == 0, output
    assert "timeout graceful shutdown exceeded" in output, output
