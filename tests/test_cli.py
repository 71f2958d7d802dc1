"""The ``radixcache`` command line."""

import json
import subprocess
import sys
import types

import pytest

from radixcache.app.cli import main
from radixcache.app.kv_size import PRESETS


def run_cli(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr().out
    return code, out


def table_lines(out):
    """The data lines of the printed table (after the title, header and rule; before any notes)."""
    lines = out.splitlines()[3:]
    return lines[:lines.index("")] if "" in lines else lines


def test_kv_size_single_preset_default_dtypes(capsys):
    code, out = run_cli(capsys, "kv-size", "--preset", "llama-3-8b")
    assert code == 0
    assert "8,192 tokens" in out
    lines = table_lines(out)
    assert [line.split()[5] for line in lines] == ["fp32", "bf16", "fp16", "fp8"]  # fp32: CPU's
    fp32, bf16 = lines[:2]
    assert "Llama-3-8B" in bf16 and "GQA" in bf16 and "131,072" in bf16 and "128 KiB" in bf16
    assert bf16.split()[-2:] == ["1", "GiB"]  # 8,192 tokens x 128 KiB, one sequence
    assert "262,144" in fp32 and fp32.split()[-2:] == ["2", "GiB"]
    assert "64 KiB" in lines[3]


def test_kv_size_defaults_to_every_preset_with_attention_kinds(capsys):
    code, out = run_cli(capsys, "kv-size")
    assert code == 0
    for name in PRESETS:
        assert name in out
    for kind in ("MHA", "GQA", "MQA", "MLA"):
        assert kind in out
    assert len(table_lines(out)) == 4 * len(PRESETS)
    assert "fp32" in table_lines(out)[0]  # the dtype the embedded model runs in on CPU


def test_kv_size_context_sequences_and_repeated_options(capsys):
    code, out = run_cli(capsys, "kv-size", "--preset", "LLaMA-7B", "--preset", "Mistral-7B",
                        "--context", "2048", "--sequences", "4", "--dtype", "fp16")
    assert code == 0
    llama, mistral = table_lines(out)
    assert "MHA" in llama and "524,288" in llama
    assert llama.split()[-4:] == ["1", "GiB", "4", "GiB"]
    assert mistral.split()[-4:] == ["256", "MiB", "1", "GiB"]


def test_kv_size_model_dir(tmp_path, capsys):
    model_dir = tmp_path / "tiny-llama"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64}))
    code, out = run_cli(capsys, "kv-size", "--model", str(model_dir), "--dtype", "fp32")
    assert code == 0
    (line,) = table_lines(out)
    assert line.startswith("tiny-llama") and "GQA" in line and f"{2 * 2 * 2 * 16 * 4:,}" in line


@pytest.mark.parametrize("argv", [
    ["kv-size", "--preset", "no-such-model"],
    ["kv-size", "--dtype", "int4"],
    ["kv-size", "--context", "0"],
    ["kv-size", "--sequences", "many"],
    ["kv-size", "--model", "/nonexistent/model/dir"],
    [],
])
def test_usage_errors_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err


def test_demo_passes_model_turns_and_out(monkeypatch):
    seen = []
    fake = types.ModuleType("radixcache.app.demo")
    fake.main = lambda args: seen.append(args) or 0
    monkeypatch.setitem(sys.modules, "radixcache.app.demo", fake)
    assert main(["demo"]) == 0
    assert (seen[0].model, seen[0].turns, seen[0].out) == (None, 6, "out/")
    assert main(["demo", "--model", "/m", "--turns", "2", "--out", "o"]) == 0
    assert (seen[1].model, seen[1].turns, seen[1].out) == ("/m", 2, "o")
    assert seen[0].compile is False
    assert main(["demo", "--compile"]) == 0 and seen[2].compile is True


def test_module_entry_point_runs_in_a_subprocess():
    result = subprocess.run([sys.executable, "-m", "radixcache.app.cli", "kv-size", "--preset", "llama-3-8b"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "Llama-3-8B" in result.stdout and "131,072" in result.stdout and "128 KiB" in result.stdout


def test_kv_size_memory_answers_how_many_sequences_fit(capsys):
    """The seeds' examples: 65 GiB at 8k context holds 65 GQA (Llama-3-8B) and 16 MHA (LLaMA-7B)
    sequences in bf16; every spelling of 65 GiB gives the same answer."""
    for memory in ("65G", "65GiB", "65", "65g", "66560M", "0.0634765625T"):
        code, out = run_cli(capsys, "kv-size", "--preset", "llama-3-8b", "--preset", "llama-7b",
                            "--context", "8k", "--dtype", "bf16", "--memory", memory)
        assert code == 0
        assert "8,192 tokens" in out and "fit in 65 GiB" in out, memory
        gqa, mha = table_lines(out)
        assert "GQA" in gqa and gqa.split()[-1] == "65", memory
        assert "MHA" in mha and mha.split()[-1] == "16", memory


def test_kv_size_context_binary_suffixes(capsys):
    """128k is 131,072 tokens: one 128k-context MHA request (LLaMA-7B, bf16) needs 64 GiB, where
    128,000 tokens would give 62.5 GiB."""
    code, out = run_cli(capsys, "kv-size", "--preset", "llama-7b", "--context", "128k", "--dtype", "bf16")
    assert code == 0
    assert "131,072 tokens" in out
    (line,) = table_lines(out)
    assert line.split()[-4:] == ["64", "GiB", "64", "GiB"]
    code, out = run_cli(capsys, "kv-size", "--preset", "llama-7b", "--context", "128000", "--dtype", "bf16")
    assert table_lines(out)[0].split()[-4:] == ["62.5", "GiB", "62.5", "GiB"]
    for text, tokens in (("8K", 8192), ("1M", 1 << 20), ("2Ki", 2048), ("0.5k", 512), ("1.5k", 1536)):
        code, out = run_cli(capsys, "kv-size", "--preset", "llama-3-8b", "--context", text)
        assert f"{tokens:,} tokens" in out, text


def test_kv_size_without_memory_has_no_fit_column(capsys):
    code, out = run_cli(capsys, "kv-size", "--preset", "llama-3-8b")
    assert "fit in" not in out


@pytest.mark.parametrize("argv", [
    ["kv-size", "--memory", "65GB"],           # decimal units are ambiguous: refused
    ["kv-size", "--memory", "0"],
    ["kv-size", "--memory", "lots"],
    ["kv-size", "--memory", "65X"],
    ["kv-size", "--memory", "-5G"],
    ["kv-size", "--memory", "0.3B"],           # not a whole number of bytes
    ["kv-size", "--context", "128kb"],
    ["kv-size", "--context", "1.0001k"],       # not a whole number of tokens
    ["kv-size", "--context", "0k"],
    ["kv-size", "--context", "-8k"],
    ["kv-size", "--context", "k"],
])
def test_bad_memory_and_context_exit_2_naming_the_problem(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "error" in err and argv[1] in err


@pytest.mark.parametrize("argv, message", [
    (["--context", "99999999999999999999k"], "at most 4,294,967,296"),
    (["--context", "4097M"], "at most 4,294,967,296"),
    (["--sequences", str(2**32 + 1)], "at most 4,294,967,296"),
    (["--memory", "2000000T"], "more than 1 EiB"),
    (["--preset", "llama-7b", "--context", "1M", "--sequences", "2000000"], "more than 1 EiB"),
])
def test_absurd_sizes_are_refused_with_a_message(argv, message, capsys):
    """Sizes no machine holds are usage errors, not "11920928955078.12 PiB"."""
    with pytest.raises(SystemExit) as exc:
        main(["kv-size", *argv])
    assert exc.value.code == 2
    captured = capsys.readouterr()
    assert message in captured.err and "PiB" not in captured.out


def test_the_largest_sizes_allowed_still_print(capsys):
    code, out = run_cli(capsys, "kv-size", "--preset", "llama-7b", "--context", "4096M", "--dtype", "fp8")
    assert code == 0 and table_lines(out)[0].split()[-4:] == ["1", "PiB", "1", "PiB"]


def test_kv_size_notes_a_sliding_window(tmp_path, capsys):
    """A sliding window is not ignored silently: the table counts every token (radixcache's pool
    keeps them all) and a note gives the cap a window-dropping cache would have."""
    configs = {
        "mistral-v0.1": dict(model_type="mistral", num_hidden_layers=32, num_attention_heads=32,
                             num_key_value_heads=8, hidden_size=4096, sliding_window=4096),
        "gemma-2-9b": dict(model_type="gemma2", num_hidden_layers=42, num_attention_heads=16,
                           num_key_value_heads=8, head_dim=256, hidden_size=3584, sliding_window=4096),
        "qwen2": dict(model_type="qwen2", num_hidden_layers=28, num_attention_heads=28,
                      num_key_value_heads=4, hidden_size=3584, sliding_window=32768,
                      use_sliding_window=False),
    }
    argv = ["kv-size", "--context", "32k", "--dtype", "bf16", "--dtype", "fp8"]
    for name, config in configs.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        argv += ["--model", str(tmp_path / name)]
    code, out = run_cli(capsys, *argv)
    assert code == 0
    notes = [line for line in out.splitlines() if line.startswith("note: ")]
    assert len(notes) == 2  # Qwen2's window is switched off
    mistral, gemma = notes
    assert "mistral-v0.1: a sliding window of 4,096 tokens on 32 of 32 layers" in mistral
    assert "at most 512 MiB bf16, 256 MiB fp8 per sequence" in mistral  # 4,096 of 32,768 tokens
    assert "on 21 of 42 layers" in gemma and "5.91 GiB bf16" in gemma  # (21 x 32k + 21 x 4k) / 42
    assert table_lines(out)[0].split()[-4:] == ["4", "GiB", "4", "GiB"]  # every token counted
    code, out = run_cli(capsys, "kv-size", "--model", str(tmp_path / "mistral-v0.1"), "--context", "4k")
    assert "does not cap sequences of 4,096 tokens" in out


def test_kv_size_mla_rows_count_expanded_k_and_v_and_note_the_latent(capsys):
    code, out = run_cli(capsys, "kv-size", "--preset", "deepseek-v3", "--dtype", "bf16")
    assert code == 0
    (row,) = table_lines(out)
    assert "MLA" in row and "192/128" in row and "4,997,120" in row
    assert "512+64 latent" in out and "68.62 KiB per token in bf16" in out
