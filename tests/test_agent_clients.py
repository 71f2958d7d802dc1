"""The agent-client set-up: the loopback-only sandbox holds, and the pinned Claude Code and Codex
run in it against the recording server, each as a two-call session with a shell tool round trip.

What the clients send is asserted only as far as the server adapters depend on it (endpoint, auth
header, the tool result in the next request, the whole history again on the second call), so a
change of pinned version that moves these fails here first.
"""

import errno
import json
import socket
import subprocess
import sys

import pytest

import agent_sandbox
from agent_sandbox import Sandbox, claude_argv, claude_env, codex_argv, codex_env, codex_home, recording_server
from recording_server import REPLY_TEXT, read_log

pytestmark = pytest.mark.agents  # `make test-all` (not `make test`)

PROBE = r"""
import json, socket, sys, urllib.request
out = {}
for name, family, address in [("v4", socket.AF_INET, ("10.255.255.1", 80)), ("v6", socket.AF_INET6, ("2001:db8::1", 80))]:
    s = socket.socket(family, socket.SOCK_STREAM)
    s.settimeout(5)
    try:
        s.connect(address)
        out[name] = "connected"
    except OSError as e:
        out[name] = e.errno
    finally:
        s.close()
body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
request = urllib.request.Request(sys.argv[1] + "/v1/messages", body, {"content-type": "application/json"})
out["loopback"] = json.load(urllib.request.urlopen(request, timeout=10))["content"][0]["text"]
print(json.dumps(out))
"""


def test_the_sandbox_reaches_loopback_and_nothing_else(tmp_path):
    with Sandbox() as sandbox:
        _, url = recording_server(sandbox, tmp_path / "log.jsonl")
        links = sandbox.run(["ip", "-o", "link", "show"], timeout=30)
        probe = sandbox.run([sys.executable, "-c", PROBE, url], timeout=60)
        assert probe.returncode == 0, probe.stderr
        # the server's port on this machine's own loopback is someone else's (or no one's)
        outside = socket.socket()
        try:
            outside.settimeout(5)
            outside.connect(("127.0.0.1", int(url.rsplit(":", 1)[1])))
        except OSError:
            pass
        finally:
            outside.close()
    assert [line.split(":")[1].strip() for line in links.stdout.splitlines()] == ["lo"], links.stdout
    result = json.loads(probe.stdout)
    assert result == {"v4": errno.ENETUNREACH, "v6": errno.ENETUNREACH, "loopback": REPLY_TEXT}
    assert len(read_log(tmp_path / "log.jsonl")) == 1  # the probe's request, not the outside connect


def test_leaving_the_sandbox_ends_its_processes(tmp_path):
    with Sandbox() as sandbox:
        server, _ = recording_server(sandbox, tmp_path / "log.jsonl")
        holder = sandbox.holder
    assert server.poll() is not None and holder.poll() is not None


def test_a_namespace_that_cannot_be_made_fails_with_the_error(tmp_path, monkeypatch):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "unshare").write_text("#!/bin/sh\necho 'unshare: unshare failed: Operation not permitted' >&2\nexit 1\n")
    (fake / "unshare").chmod(0o755)
    monkeypatch.setattr(agent_sandbox, "SYSTEM_PATH", f"{fake}:{agent_sandbox.SYSTEM_PATH}")
    with pytest.raises(pytest.fail.Exception, match="loopback-only network namespace .*Operation not permitted"):
        with Sandbox():
            pass


def test_a_missing_client_binary_names_make_agents(tmp_path, monkeypatch):
    monkeypatch.setattr(agent_sandbox, "AGENTS_DIR", tmp_path)
    with pytest.raises(pytest.fail.Exception, match="run `make agents`"):
        agent_sandbox.claude_binary()
    with pytest.raises(pytest.fail.Exception, match="run `make agents`"):
        agent_sandbox.codex_binary()


def test_a_server_that_exits_or_stays_unready_fails_naming_its_log(tmp_path):
    with Sandbox() as sandbox:
        with pytest.raises(pytest.fail.Exception, match=r"exited \(3\) before it was ready; see .*server.log"):
            sandbox.start_server([sys.executable, "-c", "raise SystemExit(3)"], tmp_path / "server.log")
        with pytest.raises(pytest.fail.Exception, match=r"exited \(4\) before it was ready"):
            sandbox.start_server([sys.executable, "-c", "raise SystemExit(4)"], tmp_path / "server.log", port=8000)
        with pytest.raises(pytest.fail.Exception, match="was not ready after 1 s"):
            sandbox.start_server(["sleep", "30"], tmp_path / "server.log", timeout=1)


def test_a_server_on_a_fixed_port_is_ready_once_it_accepts(tmp_path):
    """A fresh namespace has every port free: a server with its own port (``radixcache serve
    --port 8000``) is waited for by connecting to it from inside."""
    (tmp_path / "page.txt").write_text("inside")
    with Sandbox() as sandbox:
        sandbox.start_server([sys.executable, "-m", "http.server", "8000", "--bind", "127.0.0.1",
                              "--directory", tmp_path], tmp_path / "server.log", port=8000)
        fetch = sandbox.run([sys.executable, "-c", "import urllib.request; print(urllib.request.urlopen("
                             "'http://127.0.0.1:8000/page.txt', timeout=10).read().decode())"], timeout=30)
    assert fetch.stdout.strip() == "inside", fetch.stderr


def _text(content) -> str:
    return content if isinstance(content, str) else "".join(b.get("text", "") for b in content)


def test_claude_code_two_calls_with_a_tool_round_trip(tmp_path):
    log, work = tmp_path / "log.jsonl", tmp_path / "work"
    work.mkdir()
    with Sandbox() as sandbox:
        _, url = recording_server(sandbox, log)
        env = claude_env(tmp_path / "home", url, "smollm2")
        first = sandbox.run(claude_argv("Please run: echo hi"), env=env, cwd=work, timeout=180)
        second = sandbox.run(claude_argv("Now say bye.", resume=True), env=env, cwd=work, timeout=180)
    for run in (first, second):
        assert run.returncode == 0, run.stdout + run.stderr
        assert json.loads(run.stdout)["result"] == REPLY_TEXT
    requests = read_log(log)
    assert [(r["method"], r["path"], r["query"]) for r in requests] == [("POST", "/v1/messages", "beta=true")] * 3
    headers = {k.lower(): v for k, v in requests[0]["headers"]}
    assert headers["x-api-key"] == "test-key" and headers["anthropic-version"] == "2023-06-01"
    bodies = [r["body"] for r in requests]
    assert all(b["stream"] is True and b["model"] == "smollm2" and b["max_tokens"] == 32000 for b in bodies)
    tool_use = bodies[1]["messages"][1]["content"][0]
    assert tool_use["type"] == "tool_use" and tool_use["input"]["command"] == "echo hi"
    result = bodies[1]["messages"][2]["content"][0]
    assert result["type"] == "tool_result" and result["tool_use_id"] == tool_use["id"] and result["content"] == "hi"
    # the --continue call resends the whole conversation, the first user turn now a plain string
    assert [m["role"] for m in bodies[2]["messages"]] == ["user", "assistant", "user", "assistant", "user"]
    assert bodies[2]["messages"][0]["content"] == "Please run: echo hi"
    assert _text(bodies[2]["messages"][3]["content"]) == REPLY_TEXT
    assert "Now say bye." in _text(bodies[2]["messages"][4]["content"])
    session = {json.loads(b["metadata"]["user_id"])["session_id"] for b in bodies}
    assert len(session) == 1


def test_codex_two_calls_with_a_tool_round_trip(tmp_path):
    log, work = tmp_path / "log.jsonl", tmp_path / "work"
    work.mkdir()
    with Sandbox() as sandbox:
        _, url = recording_server(sandbox, log)
        home = codex_home(tmp_path / "home", url, "smollm2")
        runs = [sandbox.run(codex_argv(prompt, home, resume=resume), env=codex_env(home), cwd=work,
                            stdin=subprocess.DEVNULL, timeout=180)
                for prompt, resume in [("Please run: echo hi", False), ("Now say bye.", True)]]
    for run in runs:
        assert run.returncode == 0, run.stdout + run.stderr
        events = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
        assert events[-1]["type"] == "turn.completed"
        assert any(e.get("item", {}).get("text") == REPLY_TEXT for e in events)
    requests = read_log(log)
    assert [(r["method"], r["path"]) for r in requests] == [("POST", "/v1/responses")] * 3
    headers = {k.lower(): v for k, v in requests[0]["headers"]}
    assert headers["authorization"] == "Bearer test-key"
    bodies = [r["body"] for r in requests]
    assert all(b["stream"] is True and b["store"] is False for b in bodies)
    assert len({b["prompt_cache_key"] for b in bodies}) == 1
    call, output = bodies[1]["input"][-2:]
    assert call["type"] == "function_call" and json.loads(call["arguments"]) == {"cmd": "echo hi"}
    assert output["type"] == "function_call_output" and output["call_id"] == call["call_id"]
    assert "hi" in output["output"]
    # exec resume --last resends every earlier item unchanged, the ids the server issued included
    assert bodies[2]["input"][:len(bodies[1]["input"])] == bodies[1]["input"]
    assert [i.get("role", i["type"]) for i in bodies[2]["input"][-2:]] == ["assistant", "user"]


def test_the_recording_server_answers_plain_requests(tmp_path):
    """Non-streamed Messages (Claude Code falls back to it), count_tokens, non-streamed Responses, a 404."""
    with Sandbox() as sandbox:
        _, url = recording_server(sandbox, tmp_path / "log.jsonl")
        script = (
            "import json, sys, urllib.request, urllib.error\n"
            "def post(path, body):\n"
            "    r = urllib.request.Request(sys.argv[1] + path, json.dumps(body).encode(), {'content-type': 'application/json'})\n"
            "    try:\n"
            "        return json.load(urllib.request.urlopen(r, timeout=10))\n"
            "    except urllib.error.HTTPError as e:\n"
            "        return e.code\n"
            "m = [{'role': 'user', 'content': 'run echo hi'}]\n"
            "print(json.dumps([post('/v1/messages', {'messages': m}), post('/v1/messages/count_tokens', {'messages': m}),\n"
            "                  post('/v1/responses', {'input': 'hi'}), post('/v1/elsewhere', {})]))\n")
        run = sandbox.run([sys.executable, "-c", script, url], timeout=60)
    assert run.returncode == 0, run.stderr
    message, count, response, missing = json.loads(run.stdout)
    assert message["stop_reason"] == "tool_use" and message["content"][0]["input"]["command"] == "echo hi"
    assert count["input_tokens"] > 0
    assert response["status"] == "completed" and response["output"][0]["content"][0]["text"] == REPLY_TEXT
    assert missing == 404
    assert [r["path"] for r in read_log(tmp_path / "log.jsonl")] == [
        "/v1/messages", "/v1/messages/count_tokens", "/v1/responses", "/v1/elsewhere"]

