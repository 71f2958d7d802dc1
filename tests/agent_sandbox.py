"""The real agent clients (Claude Code, Codex) and the loopback-only sandbox they run in.

``make agents`` (a prerequisite of ``make test``) puts the pinned binaries in ``.venv/agents/``;
``claude_binary()`` / ``codex_binary()`` find them and fail the test, naming that command, when
they are missing.

Both clients try to reach their vendors (telemetry, updates, their own APIs), so they run only
inside a ``Sandbox``: a fresh network namespace whose only interface is loopback, brought up. A
holder process (``unshare -n``, then ``ip link set lo up``) keeps the namespace alive; every
process a test starts in it (the server first, then the clients) joins it with ``nsenter``, so the
server is the only thing a client can reach. Root makes the namespace directly; anyone else gets
it inside a new user namespace (``unshare --map-root-user``), where the kernel allows those. When
neither works (plain ``unshare -n`` as non-root says ``unshare failed: Operation not permitted``)
the test fails with the command's error.

``claude_env`` / ``claude_argv`` and ``codex_home`` / ``codex_env`` / ``codex_argv`` build the
clients' headless invocations, trimmed (a one-line system prompt and only a shell tool, so a
request fits an 8k context) or untrimmed (their own defaults), with a fresh HOME (and CODEX_HOME)
per run and telemetry and auto-updates switched off.
"""

from __future__ import annotations

import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
AGENTS_DIR = ROOT / ".venv" / "agents"
SYSTEM_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/local/sbin", "/usr/sbin", "/sbin"])
TRIMMED_SYSTEM_PROMPT = "You are a terse test agent."
_DISABLED_CODEX_FEATURES = ["multi_agent", "goals", "plugins", "apps", "image_generation", "skill_search",
                            "view_image", "tool_suggest", "browser_use", "computer_use", "hooks"]


def _binary(name: str) -> Path:
    path = AGENTS_DIR / name
    if not os.access(path, os.X_OK):
        pytest.fail(f"{path} is missing; the agent tests need the real client: run `make agents`")
    return path


def claude_binary() -> Path:
    """The pinned Claude Code binary (the one bundled in ``claude-agent-sdk``)."""
    return _binary("claude")


def codex_binary() -> Path:
    """The pinned Codex CLI binary (the static build of ``@openai/codex``'s linux-x64 package)."""
    return _binary("codex")


def _tool(name: str) -> str:
    found = shutil.which(name, path=SYSTEM_PATH)
    if not found:
        pytest.fail(f"{name} is not installed; the agent sandbox needs it: run `make netns` "
                    "(as root: apt-get install -y util-linux iproute2)")
    return found


class Sandbox:
    """A network namespace with only loopback up; a context manager (leaving it ends every
    process started in it and the namespace). ``popen`` / ``run`` start a command inside."""

    def __init__(self):
        self.holder = None
        self._children: list[subprocess.Popen] = []

    def __enter__(self) -> "Sandbox":
        unshare, ip = _tool("unshare"), _tool("ip")
        self._nsenter = _tool("nsenter")
        self.as_root = os.geteuid() == 0
        flags = ["--net"] if self.as_root else ["--net", "--map-root-user"]
        script = f"{ip} link set lo up && echo up && exec sleep infinity"
        self.holder = subprocess.Popen([unshare, *flags, "--", "sh", "-c", script], stdin=subprocess.DEVNULL,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        if self.holder.stdout.readline() != b"up\n":
            error = self.holder.communicate(timeout=10)[1].decode(errors="replace").strip()
            who = "root" if self.as_root else "a non-root user (with a user namespace)"
            pytest.fail(f"could not make a loopback-only network namespace as {who}: {error}")
        return self

    def argv(self, argv: list) -> list:
        """``argv`` prefixed to run inside the namespace."""
        ns = f"/proc/{self.holder.pid}/ns"
        joins = [f"--net={ns}/net"] if self.as_root else [f"--user={ns}/user", f"--net={ns}/net", "--preserve-credentials"]
        return [self._nsenter, *joins, "--", *map(str, argv)]

    def popen(self, argv: list, **kwargs) -> subprocess.Popen:
        """A process started inside the namespace (ended on leaving the sandbox)."""
        process = subprocess.Popen(self.argv(argv), **kwargs)
        self._children.append(process)
        return process

    def run(self, argv: list, timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
        """Run ``argv`` inside the namespace to completion (text output captured unless overridden)."""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run(self.argv(argv), timeout=timeout, **kwargs)

    def start_server(self, argv: list, log_path, port: int | None = None, timeout: float = 120) -> subprocess.Popen:
        """Start a server inside and return it once it is ready: with ``port``, once
        127.0.0.1:``port`` accepts connections inside; without, once it prints its first stdout
        line (then in ``process.ready_line``; the recording server prints ``listening PORT``).
        Everything else it writes goes to ``log_path``; a server that exits or stays unready for
        ``timeout`` seconds fails the test."""
        log = open(log_path, "ab")
        process = self.popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log)
        process.drained = True  # the thread below owns its stdout
        first: queue.Queue = queue.Queue()
        threading.Thread(target=_drain, args=(process.stdout, log, first), daemon=True).start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if port is None:
                try:
                    process.ready_line = first.get(timeout=0.2)
                    return process
                except queue.Empty:
                    pass
            elif self.run([sys.executable, "-c", _PORT_PROBE, str(port)], timeout=30).returncode == 0:
                return process
            if process.poll() is not None:
                pytest.fail(f"the server {argv[:3]} exited ({process.returncode}) before it was ready; see {log_path}")
            time.sleep(0.1)
        pytest.fail(f"the server {argv[:3]} was not ready after {timeout} s; see {log_path}")

    def __exit__(self, *exc) -> None:
        for process in [*self._children, self.holder]:
            if process is not None and process.poll() is None:
                process.kill()
            if process is not None:
                process.wait(timeout=30)
                for stream in (process.stdout, process.stderr):
                    if stream and not getattr(process, "drained", False):
                        stream.close()


_PORT_PROBE = "import socket, sys; socket.create_connection(('127.0.0.1', int(sys.argv[1])), timeout=1).close()"


def _drain(stream, log, first: queue.Queue) -> None:
    """Copy a server's stdout to its log until it ends, handing its first line to ``first``."""
    with stream, log:
        for n, raw in enumerate(iter(stream.readline, b"")):
            if n == 0:
                first.put(raw.decode(errors="replace").strip())
            log.write(raw)
            log.flush()


def recording_server(sandbox: Sandbox, log_path, omit=()) -> tuple[subprocess.Popen, str]:
    """``tests/recording_server.py`` started in ``sandbox``; returns it and its base URL."""
    argv = [sys.executable, ROOT / "tests" / "recording_server.py", "--log", log_path]
    argv += [arg for event in omit for arg in ("--omit", event)]
    process = sandbox.start_server(argv, Path(log_path).with_suffix(".stderr"))
    return process, f"http://127.0.0.1:{process.ready_line.split()[1]}"


def _base_env(home: Path) -> dict:
    """A minimal environment: nothing of the caller's but PATH and the locale; HOME is ``home``."""
    home.mkdir(parents=True, exist_ok=True)
    return {"PATH": SYSTEM_PATH, "LANG": os.environ.get("LANG", "C.UTF-8"), "HOME": str(home),
            "TMPDIR": os.environ.get("TMPDIR", "/tmp"), "NO_COLOR": "1"}


def claude_env(home, base_url: str, model: str, api_key: str = "test-key", bearer: bool = False,
               billing_header: bool = True, tool_search: bool = False) -> dict:
    """Claude Code's environment: ``base_url`` without ``/v1``, every model alias set to ``model``,
    the key sent as ``x-api-key`` (or, with ``bearer``, ``Authorization: Bearer``). Without
    ``billing_header`` it leaves out its ``x-anthropic-billing-header`` system block. With
    ``tool_search`` (its default) an untrimmed run defers most tool schemas behind a ToolSearch
    tool (about 12k prompt tokens instead of about 19k)."""
    env = _base_env(Path(home))
    env.update({"ANTHROPIC_BASE_URL": base_url, "ANTHROPIC_MODEL": model,
                "ANTHROPIC_DEFAULT_HAIKU_MODEL": model, "ANTHROPIC_DEFAULT_SONNET_MODEL": model,
                "ANTHROPIC_DEFAULT_OPUS_MODEL": model, "ANTHROPIC_SMALL_FAST_MODEL": model,
                "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1",
                "DISABLE_TELEMETRY": "1", "DISABLE_ERROR_REPORTING": "1", "CLAUDE_CODE_DISABLE_THINKING": "1"})
    if not tool_search:
        env["ENABLE_TOOL_SEARCH"] = "false"
    env["ANTHROPIC_AUTH_TOKEN" if bearer else "ANTHROPIC_API_KEY"] = api_key
    if not billing_header:
        env["CLAUDE_CODE_ATTRIBUTION_HEADER"] = "0"
    return env


def claude_argv(prompt: str, trimmed: bool = True, resume: bool = False, max_turns: int = 3) -> list:
    """``claude -p PROMPT`` headless with JSON output; ``resume`` continues the newest session of
    the working directory (``--continue``); ``trimmed`` keeps only a one-line system prompt and Bash."""
    argv = [str(claude_binary()), "-p", prompt, "--output-format", "json", "--max-turns", str(max_turns),
            "--allowedTools", "Bash(echo:*)"]
    if trimmed:
        argv += ["--bare", "--system-prompt", TRIMMED_SYSTEM_PROMPT, "--tools", "Bash", "--disable-slash-commands",
                 "--strict-mcp-config", "--setting-sources", ""]
    return argv + (["--continue"] if resume else [])


def codex_home(home, base_url: str, model: str) -> Path:
    """A fresh CODEX_HOME (``home``) whose ``config.toml`` points Codex at ``base_url`` (with
    ``/v1``) through the Responses API, key from ``LOCAL_API_KEY``, no approvals, no sandbox
    (the network namespace is the sandbox); also ``instructions.md``, the trimmed instructions."""
    home = Path(home)
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text(
        f'model = "{model}"\nmodel_provider = "local"\napproval_policy = "never"\n'
        'sandbox_mode = "danger-full-access"\ncheck_for_update_on_startup = false\n\n'
        '[analytics]\nenabled = false\n\n'
        f'[model_providers.local]\nname = "local"\nbase_url = "{base_url}/v1"\n'
        'env_key = "LOCAL_API_KEY"\nwire_api = "responses"\n')
    (home / "instructions.md").write_text(TRIMMED_SYSTEM_PROMPT + "\n")
    return home


def codex_env(home, api_key: str = "test-key") -> dict:
    """Codex's environment for a ``codex_home``: HOME and CODEX_HOME both ``home``."""
    env = _base_env(Path(home))
    env.update({"CODEX_HOME": str(home), "LOCAL_API_KEY": api_key, "RUST_LOG": "error"})
    return env


def codex_argv(prompt: str, home, trimmed: bool = True, resume: bool = False) -> list:
    """``codex exec --json PROMPT`` (``resume``: ``codex exec resume --last``); run it with stdin
    closed or it waits for more input. ``trimmed`` uses the one-line instructions and turns off
    every optional tool and context block."""
    argv = [str(codex_binary()), "exec", *(["resume", "--last"] if resume else []), "--skip-git-repo-check", "--json"]
    if trimmed:
        argv += ["-c", f"model_instructions_file={Path(home) / 'instructions.md'}",
                 "-c", "include_permissions_instructions=false", "-c", "include_environment_context=false",
                 "-c", "web_search=disabled", "-c", "skills.bundled.enabled=false"]
        argv += [arg for feature in _DISABLED_CODEX_FEATURES for arg in ("--disable", feature)]
    return argv + [prompt]
