"""Codex (the real pinned CLI, headless, in the loopback-only sandbox) against ``radixcache serve``.

A two-call session, ``codex exec`` then ``codex exec resume --last``: Codex speaks only the
Responses API, streams, sends ``store: false`` and resends every earlier item (its ids, our ids,
our arguments) on each request. Every request after the first must read its prompt from the cache
as far as an earlier request's prompt and output cover it (the ideal, from ``--log-token-ids``),
which for a stateless client means through each reply's history form.

- trimmed (one-line instructions, three function tools) on the embedded SmolLM2 (8k context); Codex
  sends no temperature, so SmolLM2 samples, and a turn may end at the server's output cap (Codex
  then reports the turn incomplete, and still resends that reply on the next call);
- untrimmed (Codex's own instructions, tools with a ``namespace`` and ``web_search``, about 9k
  tokens) on a tiny random model with a 32k context and the embedded tokenizer, whose every reply
  is an immediate end of turn (so each turn completes).

A missing binary or sandbox fails (``agent_sandbox``), never skips.
"""

import pytest
import json
import subprocess
import sys
from pathlib import Path

import torch
import transformers as tf

from agent_sandbox import Sandbox, codex_argv, codex_env, codex_home
from radixcache.integrations.serve.telemetry.token_log import ideal_cached, read_token_log
from serve_helpers import write_model_dir

pytestmark = pytest.mark.agents  # `make test-all` (not `make test`)

BS = 16
PORT = 8000
MODEL = "smollm2"


def serve_argv(log, *extra) -> list:
    return [sys.executable, "-m", "radixcache.app.cli", "serve", "--port", str(PORT), "--served-model-name", MODEL,
            "--api-key", "test-key", "--log-token-ids", str(log), "--block-size", str(BS), *map(str, extra)]


CAPPED = "Incomplete response returned, reason: max_output_tokens"


def two_calls(tmp_path, server_argv, trimmed: bool, prompts=("Say hi.", "Say bye."), capped_ok=False,
              read_only=False) -> list:
    """Run ``codex exec`` then ``codex exec resume --last`` against the server; the token log.
    Each turn must complete, or with ``capped_ok`` (a sampling model may talk up to the server's
    ``--max-output-tokens``) fail only because the reply reached that cap. ``read_only``: Codex's
    own sandbox keeps any command a sampling model makes up from writing anything."""
    log, work = tmp_path / "tokens.jsonl", tmp_path / "work"
    work.mkdir()
    with Sandbox() as sandbox:
        sandbox.start_server(server_argv, tmp_path / "server.log", port=PORT, timeout=300)
        home = codex_home(tmp_path / "home", f"http://127.0.0.1:{PORT}", MODEL)
        guard = ["-c", 'sandbox_mode="read-only"'] if read_only else []
        argvs = [codex_argv(prompt, home, trimmed=trimmed, resume=resume) for prompt, resume in zip(prompts, (False, True))]
        runs = [sandbox.run(argv[:-1] + guard + argv[-1:], env=codex_env(home), cwd=work, stdin=subprocess.DEVNULL,
                            timeout=600) for argv in argvs]
    server_log = (tmp_path / "server.log").read_text(errors="replace")
    for run in runs:
        events = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
        capped = capped_ok and events and events[-1] == {"type": "turn.failed", "error": {"message": CAPPED}}
        assert run.returncode == 0 or capped, run.stdout + run.stderr + server_log[-3000:]
        assert events[-1]["type"] == "turn.completed" or capped, run.stdout
    lines = read_token_log(log)
    assert lines and all(line["protocol"] == "responses" for line in lines)
    two_calls.events = [[json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")] for run in runs]
    return lines


def assert_each_request_hits_the_one_before(lines) -> None:
    """Codex resends our items as we issued them: each request reads the previous request's prompt
    and reply from the cache (through the reply's history form where the model's tokens differ
    from the template's text), in whole blocks."""
    for before, line in zip(lines, lines[1:]):
        computed = len(before["prompt_ids"]) + len(before["output_ids"][0]) - 1
        assert line["cached_tokens"] >= computed // BS * BS, (before["cached_tokens"], line["cached_tokens"], computed)


def report(lines) -> list:
    rows = [(len(line["prompt_ids"]), line["cached_tokens"], ideal) for line, ideal in zip(lines, ideal_cached(lines, BS))]
    print("prompt / cached / ideal per request:", rows)
    return rows


def test_codex_trimmed_on_smollm2_reads_the_second_call_from_the_cache(tmp_path):
    lines = two_calls(tmp_path, serve_argv(tmp_path / "tokens.jsonl", "--max-cache-tokens", 16384,
                                           "--max-output-tokens", 64), trimmed=True, capped_ok=True, read_only=True)
    rows = report(lines)
    assert len(rows) >= 2
    assert_each_request_hits_the_one_before(lines)
    for prompt, cached, ideal in rows[1:]:  # the target is 95 % of the ideal; the history form gives all
        assert cached >= ideal, rows
    # the resume call's first request carries the whole first call again: most of it is cached
    prompt, cached, _ = rows[-1]
    assert cached >= 0.8 * prompt, rows


def eos_model_dir(path):
    """A tiny random Llama (32k context, the embedded tokenizer) whose every next token is EOS: its
    layers add nothing to the residual (their K/V are still computed and cached), the final norm
    keeps one coordinate, and only EOS's output row reads it."""
    write_model_dir(path, max_positions=32768, weights=True)
    model = tf.LlamaForCausalLM.from_pretrained(path)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight[:, 0] = 1.0
        model.model.norm.weight.zero_()
        model.model.norm.weight[0] = 1.0
        model.lm_head.weight.zero_()
        model.lm_head.weight[2, 0] = 10.0
    model.save_pretrained(path)
    return path


def test_codex_untrimmed_on_a_32k_model_is_accepted_and_the_second_call_hits_the_first(tmp_path):
    model = eos_model_dir(tmp_path / "tiny-32k")
    lines = two_calls(tmp_path, serve_argv(tmp_path / "tokens.jsonl", "--model", model, "--max-cache-tokens", 65536,
                                           "--max-output-tokens", 16), trimmed=False)
    rows = report(lines)
    assert rows[0][0] > 8192, rows  # the whole untrimmed request, past an 8k context
    assert_each_request_hits_the_one_before(lines)
    for prompt, cached, ideal in rows[1:]:
        assert cached >= ideal and ideal >= 0.9 * rows[0][0], rows


def test_codex_tool_round_trip_on_a_scripted_model_hits_every_turn(tmp_path):
    """Codex runs the call the model makes (``exec_command``), sends its output back with our
    ``function_call`` echoed, and resumes: three requests, each reading all of the one before."""
    model = write_model_dir(tmp_path / "tiny-8k", max_positions=8192, weights=True)
    call = '<tool_call>{"name": "exec_command", "arguments": {"cmd": "echo hi"}}</tool_call>'
    argv = [sys.executable, Path(__file__).resolve().parent / "scripted_serve.py", "--model", model, "--port", PORT,
            "--log", tmp_path / "tokens.jsonl", "--rule", "Please run: echo hi", call,
            "--rule", "Process exited", "Done.", "--rule", "Now say bye.", "Bye."]
    lines = two_calls(tmp_path, list(map(str, argv)), trimmed=True, prompts=("Please run: echo hi", "Now say bye."))
    rows = report(lines)
    assert len(rows) == 3
    first, second = two_calls.events
    commands = [e["item"] for e in first if e["type"] == "item.completed" and e["item"].get("type") == "command_execution"]
    assert commands and "echo hi" in commands[0]["command"] and commands[0]["aggregated_output"].strip() == "hi"
    replies = [e["item"]["text"] for run in (first, second) for e in run
               if e["type"] == "item.completed" and e["item"].get("type") == "agent_message"]
    assert replies == ["Done.", "Bye."], replies
    assert_each_request_hits_the_one_before(lines)
    for prompt, cached, ideal in rows[1:]:
        assert cached >= ideal, rows
