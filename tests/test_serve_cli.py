"""``radixcache serve`` as a user runs it: options, a real process on a free port, a clean stop."""

import argparse
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest

from radixcache.app.cli import build_parser
from radixcache.integrations.serve.options import ServeOptions
from radixcache.integrations.serve.server import build_state
from serve_helpers import DRIFT_GENERATION_THINK, ServeProcess, free_socket, write_model_dir


def parse(*argv) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def test_defaults_are_the_issues():
    options = ServeOptions.from_args(parse())
    assert (options.model, options.host, options.port, options.block_size) == (None, "127.0.0.1", 8000, 16)
    assert options.max_cache_tokens is None and options.chat_template is None and options.api_keys == ()
    assert options.max_queue >= 64 and options.max_in_flight == options.max_running + options.max_queue
    assert options.history_precompute and not options.share_cache_across_keys


def test_attention_takes_every_backend_name_and_refuses_others(capsys):
    from radixcache.attention.select import NAMES

    for name in NAMES:
        assert ServeOptions.from_args(parse("--attention", name)).attention == name
    assert ServeOptions.from_args(parse()).attention == "auto"
    with pytest.raises(SystemExit):
        parse("--attention", "inplace")
    assert "invalid choice: 'inplace'" in capsys.readouterr().err


def test_options_are_read_and_checked(tmp_path, monkeypatch):
    model = write_model_dir(tmp_path / "m")
    template = tmp_path / "t.jinja"
    template.write_text(DRIFT_GENERATION_THINK)
    options = ServeOptions.from_args(parse("--model", str(model), "--port", "9001", "--max-cache-tokens", "4096",
                                           "--block-size", "32", "--chat-template", str(template),
                                           "--served-model-name", "a", "b", "--api-key", "k1", "--api-key", "k2",
                                           "--share-cache-across-keys", "--max-running", "8", "--max-queue", "100",
                                           "--no-history-precompute", "--store", "redis://127.0.0.1:6390/2"))
    assert options.chat_template == DRIFT_GENERATION_THINK and options.api_keys == ("k1", "k2")
    assert options.served_model_names == ("a", "b") and options.max_in_flight == 108
    assert not options.history_precompute and options.share_cache_across_keys
    assert options.store == "redis://127.0.0.1:6390/2" and ServeOptions.from_args(parse()).store is None
    state = build_state(options)
    assert state.renderer.template == DRIFT_GENERATION_THINK  # --chat-template replaces the tokenizer's
    assert state.model_names == ("a", "b") and state.limits == (512, 4096, 32)
    monkeypatch.setenv("RADIXCACHE_API_KEY", "from-env")
    assert ServeOptions.from_args(parse()).api_keys == ("from-env",)
    bad = [(["--model", str(tmp_path)], "no config.json"), (["--chat-template", str(tmp_path / "none")], "chat-template"),
           (["--share-cache-across-keys"], "needs at least one --api-key"), (["--api-key", " "], "must not be empty"),
           (["--api-key", "k", "--isolate-cache-by-key", "--share-cache-across-keys"], "contradict"),
           (["--max-cache-tokens", "8"], "smaller than one block"), (["--store", "127.0.0.1:6379"], "redis://")]
    monkeypatch.delenv("RADIXCACHE_API_KEY")
    for argv, words in bad:
        with pytest.raises(ValueError, match=words):
            ServeOptions.from_args(parse(*argv))
    for argv in (["--port", "0"], ["--port", "70000"], ["--block-size", "x"], ["--max-queue", "-1"]):
        with pytest.raises(SystemExit):
            parse(*argv)


def test_radixcache_serve_runs_and_stops_on_ctrl_c(tmp_path):
    """The real command: loads the weights, answers a chat completion, stops cleanly on Ctrl-C."""
    model = write_model_dir(tmp_path / "tiny", weights=True)
    server = ServeProcess(model, "--max-cache-tokens", "4096", "--log-level", "warning")
    try:
        models = httpx.get(server.base_url + "/v1/models", timeout=5)
        assert models.json()["data"][0]["id"] == "tiny"
        with server.client() as client:
            reply = client.chat.completions.create(model="tiny", max_tokens=4, temperature=0,
                                                   messages=[{"role": "user", "content": "Hello"}])
        assert reply.usage.completion_tokens >= 1 and reply.usage.prompt_tokens_details.cached_tokens == 0
        server.proc.send_signal(signal.SIGINT)
        code = server.wait(timeout=30)
    finally:
        output = server.stop()
    assert code == 0, output
    assert "Traceback" not in output, output


def test_bad_options_exit_with_a_message(tmp_path):
    result = subprocess.run([sys.executable, "-m", "radixcache.app.cli", "serve", "--model", str(tmp_path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "no config.json" in result.stderr


def test_dtype_is_bfloat16_where_the_cpu_has_native_bf16_matrix_units(tmp_path):
    from radixcache import models

    amx = tmp_path / "amx"
    amx.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx512f avx512bw amx_bf16 amx_tile avx512_bf16\n\n")
    plain = tmp_path / "plain"
    plain.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512bw\n\n")
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd i8mm bf16 sve\n\n")
    assert models.cpu_bf16_flags(amx) == ("amx_bf16", "avx512_bf16")
    assert models.cpu_bf16_flags(arm) == ("bf16",)
    assert models.cpu_bf16_flags(plain) == () and models.cpu_bf16_flags(tmp_path / "none") == ()
    for cpuinfo, expected in ((amx, "bfloat16"), (arm, "bfloat16"), (plain, "float32"), (tmp_path / "none", "float32")):
        assert models.default_dtype("cpu", cpuinfo) == expected
    assert models.default_dtype("cuda", plain) == "bfloat16"
    # --dtype on serve and demo: auto unless told
    assert ServeOptions.from_args(parse()).dtype == "auto"
    assert ServeOptions.from_args(parse("--dtype", "float32")).dtype == "float32"
    assert build_parser().parse_args(["demo", "--dtype", "bfloat16"]).dtype == "bfloat16"
    with pytest.raises(SystemExit):
        parse("--dtype", "int8")


def serve_one_chat(model, *flags) -> tuple:
    """Start ``radixcache serve`` on ``model`` (one thread, a 2,048-token pool) with ``flags``, send
    one greedy chat completion and stop it: (what the server printed, the completion)."""
    server = ServeProcess(model, "--max-cache-tokens", "2048", "--threads", "1", *flags)
    try:
        with server.client() as client:
            reply = client.chat.completions.create(model="tiny", max_tokens=4, temperature=0,
                                                   messages=[{"role": "user", "content": "Tell me about rivers."}])
        return server.output, reply
    finally:
        server.stop()


def test_serve_runs_the_dtype_it_is_given_with_the_attention_auto_picks_for_it(tmp_path):
    """The real command in float32 and in bfloat16: it says which, and which attention "auto" picked
    (the gather in float32, where tokens equal plain generate's; in place in bfloat16 where the kernel
    builds), and answers in both."""
    from radixcache.attention import paged_cpu

    model = write_model_dir(tmp_path / "tiny", weights=True)
    in_place = "torch-inplace" if paged_cpu.kernel() is not None else "torch"
    for dtype, attention in (("float32", "torch"), ("bfloat16", in_place)):
        output, reply = serve_one_chat(model, "--dtype", dtype, "--log-level", "info")
        assert reply.usage.completion_tokens >= 1
        assert f"model: LlamaForCausalLM, {dtype} on cpu" in output, output
        assert f"sets it), {attention} attention" in output, output


def test_the_server_says_what_it_runs_and_one_line_per_request(tmp_path):
    """Issue 31 item 3: a start-up summary (model, dtype, device, threads, pool in tokens and bytes,
    block size, routes, store, keys) and, at info, one line per request with its cached tokens."""
    model = write_model_dir(tmp_path / "tiny", weights=True)
    server = ServeProcess(model, "--max-cache-tokens", "2048", "--dtype", "float32", "--threads", "1",
                          "--api-key", "k1")
    try:
        out = server.output
        for words in ("serving tiny as tiny on http://127.0.0.1:", "model: LlamaForCausalLM, float32 on cpu, 1 thread",
                      "KV pool: 2,048 tokens in blocks of 16", "MiB", "store: none", "API keys: 1, each its own tenant",
                      "routes: POST /v1/chat/completions", "/v1/messages", "/v1/responses"):
            assert words in out, (words, out)
        messages = [{"role": "user", "content": "Tell me a story about a very long river in the north. " * 3}]
        with server.client(api_key="k1") as client:
            for _ in range(2):
                client.chat.completions.create(model="tiny", max_tokens=4, temperature=0, messages=messages)
        server.wait_for_output("4 new", timeout=30)
        lines = [line for line in server.output.splitlines() if line.startswith("INFO") and "chat chatcmpl-" in line]
        assert len(lines) == 2, server.output
        assert "(0 cached)" in lines[0] and "(0 cached)" not in lines[1] and "TTFT" in lines[1]
        assert "finish length" in lines[1]
        assert "history form departs" not in server.output  # that one is for --log-level debug
    finally:
        server.stop()


def test_a_port_in_use_is_refused_before_the_model_loads(tmp_path):
    model = write_model_dir(tmp_path / "tiny", weights=True)
    with free_socket() as busy:
        busy.listen()
        port = busy.getsockname()[1]
        run = subprocess.run([sys.executable, "-m", "radixcache.app.cli", "serve", "--model", str(model),
                              "--port", str(port)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 1
    assert f"127.0.0.1:{port} is in use" in run.stderr and "--port" in run.stderr
    assert "Loading weights" not in run.stderr + run.stdout and "Traceback" not in run.stderr


def test_version_help_and_a_bad_model_without_a_traceback(tmp_path):
    version = subprocess.run([sys.executable, "-m", "radixcache.app.cli", "--version"], capture_output=True,
                             text=True, timeout=60)
    assert version.returncode == 0 and version.stdout.startswith("radixcache ")
    helped = subprocess.run([sys.executable, "-m", "radixcache.app.cli", "serve", "--help"], capture_output=True,
                            text=True, timeout=60)
    for route in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/v1/models",
                  "/v1/loads", "/health", "/metrics", "--threads"):
        assert route in helped.stdout
    for command in (["serve", "--model", str(tmp_path / "nonexistent")], ["demo", "--model", str(tmp_path / "nonexistent")],
                    ["demo", "--model", str(tmp_path)]):
        run = subprocess.run([sys.executable, "-m", "radixcache.app.cli", *command], capture_output=True, text=True,
                             timeout=120)
        assert run.returncode in (1, 2), (command, run.stderr)
        assert "Traceback" not in run.stderr + run.stdout, (command, run.stderr)
        assert "nonexistent" in run.stderr or "config.json" in run.stderr or "not a directory" in run.stderr


def test_serve_compile_compiles_at_start_up_and_says_how_long(tmp_path):
    """Issue 32 item 3: --compile compiles the engine's step before the port answers, prints the
    time it took, and the server answers as the eager one does."""
    model = write_model_dir(tmp_path / "tiny", weights=True)
    messages = [{"role": "user", "content": "Tell me about rivers."}]
    replies = []
    for flags in ((), ("--compile",)):
        # two threads: the scheduler's count differs from the loading thread's (serial)
        server = ServeProcess(model, "--max-cache-tokens", "2048", "--dtype", "float32", "--threads", "2", *flags,
                              env={"TORCH_LOGS": "recompiles"})
        try:
            compiled = re.search(r"compile: the engine's step compiled in ([0-9.]+) s", server.output)
            assert (compiled is not None) == bool(flags), server.output
            started = len(server.output)
            with server.client() as client:
                for n in (1, 2):  # one sequence, then two at once: every shape class
                    chats = [client.chat.completions.create(model="tiny", max_tokens=6, temperature=0, n=n,
                                                            messages=messages)]
                replies.append(chats[0].choices[0].message.content)
            time.sleep(0.5)
            assert "Recompiling" not in server.output[started:], server.output[started:]  # never on a request
        finally:
            server.stop()
    assert replies[0] == replies[1]


def test_serve_quantize_logs_the_greedy_agreement_and_serves(tmp_path):
    """Issue 32 item 5: --quantize int8 quantizes before the engine starts, logs how far greedy
    tokens still agree with the unquantized model, and serves."""
    pytest.importorskip("torchao")  # in the dev extra
    output, reply = serve_one_chat(write_model_dir(tmp_path / "tiny", weights=True), "--dtype", "float32",
                                   "--quantize", "int8")
    assert re.search(r"quantize: int8 weight-only \(torchao, \d+ linear layers\); greedy agrees with the "
                     r"unquantized model on the first \d+ of 32 probe tokens", output), output
    assert reply.usage.completion_tokens >= 1


def test_serve_attention_overrides_what_auto_would_pick(tmp_path):
    """--attention torch-inplace reads the pool in place in float32 too, and --attention torch
    gathers in bfloat16: the start-up summary names the backend, and a chat completes."""
    from radixcache.attention import paged_cpu

    if paged_cpu.kernel() is None:
        pytest.skip(f"no in-place kernel here: {paged_cpu.unavailable_reason()}")
    model = write_model_dir(tmp_path / "tiny", weights=True)
    for dtype, attention in (("float32", "torch-inplace"), ("bfloat16", "torch")):
        output, reply = serve_one_chat(model, "--dtype", dtype, "--attention", attention)
        assert f"sets it), {attention} attention" in output, output
        assert reply.usage.completion_tokens >= 1
