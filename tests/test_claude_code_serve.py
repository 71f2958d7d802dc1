"""Claude Code (the pinned binary, headless) against the real ``radixcache serve`` over Anthropic
Messages, in the loopback-only sandbox, as a two-call session: a call, then ``--continue``.

Trimmed (``--bare``, a one-line system prompt, only Bash) on the embedded SmolLM2, and untrimmed
(its own default system prompt, tools and reminders, about 12k tokens) on a tiny random model with
a 32k context and the embedded tokenizer (``write_hi_model``: its layers compute their K/V as any
model's, but write nothing into the residual stream, and its head answers "Hi" and then EOS, so
Claude Code gets a short reply that ends its turn rather than a random one cut at the cap). What
each request cost the cache is read from ``--log-token-ids``: every request after the first, the
``--continue`` call's included, must read from the cache the whole part of its prompt that earlier
requests already computed (prompt and reply), in whole blocks, and for the last one that is most
of its prompt. The missing binary fails these tests (``make agents``); it never skips them.
"""

import pytest
import json
import sys

from agent_sandbox import Sandbox, claude_argv, claude_env
from radixcache.integrations.serve.telemetry.token_log import read_token_log
from radixcache.tokens import common_prefix
from serve_helpers import write_model_dir

pytestmark = pytest.mark.agents  # `make test-all` (not `make test`)

BS = 16
PORT = 8000  # a fresh namespace has every port free


def write_hi_model(path):
    """A tiny random Llama (32k context, the embedded tokenizer) that says "Hi" and stops: the
    attention and MLP outputs are zeroed, so the logits depend on the current token only, and the
    head maps the generation prompt's last token to "Hi" and "Hi" to EOS (by far, at any
    temperature)."""
    import torch
    import transformers as tf

    from serve_helpers import embedded_tokenizer

    write_model_dir(path, max_positions=32768, weights=True)
    model = tf.LlamaForCausalLM.from_pretrained(path)
    tokenizer = embedded_tokenizer()
    opening = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False,
                                            add_generation_prompt=True)
    last = tokenizer(opening, add_special_tokens=False)["input_ids"][-1]
    hi = tokenizer("Hi", add_special_tokens=False)["input_ids"][0]
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        hidden = model.model.norm(model.model.embed_tokens.weight[[last, hi]])
        model.lm_head.weight.zero_()
        for source, target in ((0, hi), (1, tokenizer.eos_token_id)):
            model.lm_head.weight[target] = 60 * hidden[source] / hidden[source].norm() ** 2
    model.save_pretrained(path)
    return path


def ideal_hits(lines) -> list:
    """Per request after the first: the tokens of its prompt that an earlier request's prompt and
    output covered, in whole blocks, at most the prompt minus one token."""
    out = []
    for i, line in enumerate(lines[1:], 1):
        prompt = line["prompt_ids"]
        covered = max(common_prefix(prompt, e["prompt_ids"] + e["output_ids"][0]) for e in lines[:i])
        out.append(min(covered, len(prompt) - 1) // BS * BS)
    return out


def run_session(tmp_path, model_args, trimmed: bool, tool_search: bool = False, cap: int = 64):
    """Start the server (``cap``: its --max-output-tokens; a reply cut there makes Claude Code ask
    for more until it gives up), run the two calls; returns (runs, token-log lines, server log)."""
    work, tokens, log = tmp_path / "work", tmp_path / "tokens.jsonl", tmp_path / "server.log"
    work.mkdir()
    argv = [sys.executable, "-m", "radixcache.app.cli", "serve", *model_args, "--port", str(PORT),
            "--served-model-name", "smollm2", "--api-key", "test-key", "--max-output-tokens", str(cap),
            "--log-token-ids", tokens, "--log-level", "info"]
    with Sandbox() as sandbox:
        sandbox.start_server(argv, log, port=PORT, timeout=300)
        env = claude_env(tmp_path / "home", f"http://127.0.0.1:{PORT}", "smollm2", tool_search=tool_search)
        env["CLAUDE_CODE_MAX_RETRIES"] = "1"
        env["CLAUDE_CODE_EXTRA_BODY"] = json.dumps({"temperature": 0})  # greedy: the same reply every run
        runs = [sandbox.run(claude_argv(prompt, trimmed=trimmed, resume=resume), env=env, cwd=work,
                            timeout=600)
                for prompt, resume in [("Say hi.", False), ("What is 2 + 2?", True)]]
    return runs, read_token_log(tokens), log.read_text(errors="replace")


def check_session(runs, lines, server_log):
    for run in runs:
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:] + server_log[-3000:]
        result = json.loads(run.stdout)
        assert result["is_error"] is False, result
    assert len(lines) >= 2 and all(line["protocol"] == "anthropic" for line in lines)
    per_request = [(len(line["prompt_ids"]), line["cached_tokens"], ideal)
                   for line, ideal in zip(lines[1:], ideal_hits(lines))]
    for prompt, cached, ideal in per_request:
        assert cached >= ideal, per_request
    return per_request


def test_claude_code_trimmed_two_calls_on_the_embedded_model(tmp_path):
    # greedy in float32: the same short replies on every machine (bf16 rounds by the CPU's kernels)
    runs, lines, server_log = run_session(tmp_path, ["--max-cache-tokens", "16384", "--dtype", "float32"],
                                          trimmed=True, cap=256)
    per_request = check_session(runs, lines, server_log)
    prompt, cached, ideal = per_request[-1]
    assert cached >= ideal > prompt // 2, per_request  # most of the prompt was the first call's
    print("trimmed: (prompt, cached, ideal) per request after the first:", per_request)


def test_claude_code_untrimmed_two_calls_on_a_32k_model(tmp_path):
    model = write_hi_model(tmp_path / "tiny-32k")
    runs, lines, server_log = run_session(tmp_path, ["--model", str(model), "--max-cache-tokens", "98304"],
                                          trimmed=False, tool_search=True)
    per_request = check_session(runs, lines, server_log)
    assert len(lines[0]["prompt_ids"]) > 8000  # the whole default request was accepted
    prompt, cached, ideal = per_request[-1]
    assert cached >= ideal > prompt // 2, per_request
    print("untrimmed: (prompt, cached, ideal) per request after the first:", per_request)
