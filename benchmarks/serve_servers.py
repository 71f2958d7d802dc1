"""The servers ``benchmarks/serve.py`` drives: command lines, each for a free loopback port.

``SERVERS`` maps a name to ``build(model_dir, port, run) -> list[str]`` (``run``: a ``Run`` with the
dtype and the most sessions at once), ``DEFAULT_SERVERS`` is the order of the tables and
``unavailable(name, model_dir)`` says why a server cannot run here (None: it can):

- ``radixcache``: ``radixcache serve`` at ``--dtype``; ``radixcache+compile``, ``radixcache+int8``
  and ``radixcache+compile+int8`` add ``--compile`` and / or ``--quantize int8``,
  ``radixcache+gather`` ``--attention torch`` (the gather + SDPA reference; ``auto``, the default,
  reads a half-precision pool in place on CPU) (each its own row);
- ``transformers`` and ``transformers-cb``: ``transformers serve`` (without and with
  ``--continuous-batching``) at ``--dtype``;
- ``llama-server``: llama.cpp's server, when ``llama-server`` is on PATH, on the GGUF file the
  embedded model was converted from (``radixcache.models.find_default_gguf``; Q4_1 weights, so its
  precision is not the others'), started anew for every phase (``PER_PHASE``) with one slot per
  session sharing one unified KV pool of 4,096 tokens per slot (a session needs about 2,300), or
  for one session as a user with one agent starts it (``-np 1 -c 8192``), prompt caching on (its
  default) and ``--no-repack`` (its repacked AMX path crashes on some CPUs with AMX).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import NamedTuple

LLAMA_CONTEXT_PER_SLOT = 4096  # a session of the workload needs about 2,300
LLAMA_CONTEXT_ONE_SLOT = 8192  # one agent session: the set-up a user with one agent picks


class Run:
    """What every server of one benchmark run shares."""

    def __init__(self, dtype: str, max_sessions: int):
        self.dtype, self.max_sessions = dtype, max_sessions


class Source(NamedTuple):
    """The GGUF file a converted model directory came from, and its quantization (from the name)."""

    path: Path
    quantization: str


def _exe(name: str) -> str | None:
    beside = Path(sys.executable).with_name(name)
    return str(beside) if beside.exists() else shutil.which(name)


def threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def gguf_source(model_dir) -> Source | None:
    """The GGUF the embedded model was converted from, when ``model_dir`` is that conversion."""
    from radixcache.models import SOURCE_FILE, find_default_gguf

    marker = Path(model_dir) / SOURCE_FILE
    try:
        name = json.loads(marker.read_text())["gguf"]
        gguf = find_default_gguf()
    except (OSError, ValueError, KeyError, RuntimeError):
        return None
    if gguf.name != name:
        return None
    return Source(gguf, gguf.stem.rsplit(".", 1)[-1])


def radixcache_command(model_dir, port: int, run: Run, *options: str) -> list[str]:
    return [_exe("radixcache") or "radixcache", "serve", "--model", str(model_dir), "--host", "127.0.0.1",
            "--port", str(port), "--log-level", "warning", "--dtype", run.dtype, *options]


def radixcache_configured(*options: str):
    """A builder of ``radixcache serve`` with ``options`` (``--compile``, ``--quantize int8``,
    ``--attention torch``)."""
    return lambda model_dir, port, run: radixcache_command(model_dir, port, run, *options)


def transformers_command(model_dir, port: int, run: Run) -> list[str]:
    return [_exe("transformers") or "transformers", "serve", str(model_dir), "--host", "127.0.0.1",
            "--port", str(port), "--dtype", run.dtype]


def transformers_cb_command(model_dir, port: int, run: Run) -> list[str]:
    return transformers_command(model_dir, port, run) + ["--continuous-batching"]


def llama_server_command(model_dir, port: int, run: Run) -> list[str]:
    source = gguf_source(model_dir)
    slots = max(1, run.max_sessions)
    pool = ["-np", "1", "-c", str(LLAMA_CONTEXT_ONE_SLOT)] if slots == 1 else \
        ["-np", str(slots), "-kvu", "-c", str(slots * LLAMA_CONTEXT_PER_SLOT)]
    return [_exe("llama-server"), "-m", str(source.path), "-a", Path(model_dir).name, "--host", "127.0.0.1",
            "--port", str(port), "--no-repack", *pool, "-t", str(threads()), "--no-webui"]


SERVERS = {"radixcache": radixcache_command, "radixcache+compile": radixcache_configured("--compile"),
           "radixcache+int8": radixcache_configured("--quantize", "int8"),
           "radixcache+compile+int8": radixcache_configured("--compile", "--quantize", "int8"),
           "radixcache+gather": radixcache_configured("--attention", "torch"),
           "transformers": transformers_command, "transformers-cb": transformers_cb_command,
           "llama-server": llama_server_command}
DEFAULT_SERVERS = ("radixcache", "transformers", "transformers-cb", "llama-server")
PER_PHASE = {"llama-server"}  # started anew for each number of sessions, sized for it
COMPILING = {"radixcache+compile", "radixcache+compile+int8"}  # start-up compiles: minutes


def unavailable(name: str, model_dir) -> str | None:
    """Why server ``name`` cannot run on ``model_dir`` here, or None."""
    if name == "llama-server":
        if _exe("llama-server") is None:
            return "llama-server is not on PATH"
        if gguf_source(model_dir) is None:
            return f"{Path(model_dir).name} was not converted from the embedded GGUF"
    return None


def precision(name: str, model_dir, dtype: str) -> str:
    """What the server computes in: the dtype, or the GGUF's quantization for llama-server."""
    if name == "llama-server":
        source = gguf_source(model_dir)
        return f"{source.quantization} GGUF" if source else "-"
    return f"{dtype} (int8 weights)" if name.endswith("+int8") else dtype
