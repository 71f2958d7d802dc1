"""Paged attention on CPU that reads K/V in place: a small C++ kernel built at run time.

``paged_attention(query, k_pool, v_pool, table, segments, scale, window, softcap)``: ``query [T, H,
D]`` (packed new tokens), one layer's pool tensors ``[blocks, kv_heads, block_size, D]`` (and
``Dv``) in the query's dtype (float32, bfloat16 or float16), the step's block table ``[S, B]`` and
``segments [M, 4]`` (int64 rows ``q_start, q_len, kv_len, table row``) -> ``[T, H, Dv]``: each
segment's query token ``t`` attends causally over its keys ``0 .. kv_len - q_len + t`` (the last
``window`` of them when ``window > 0``; scores soft-capped when ``softcap > 0``), GQA by head groups,
softmax in float32. Rows of tokens in no segment are left unwritten. Only slots below a segment's
``kv_len`` are read: a partly written block's stale slots never are.

``kernel()`` builds the library once per process (``torch.utils.cpp_extension``: a C++ compiler
and ninja, about 10 s on 2 cores; cached under ``TORCH_EXTENSIONS_DIR`` across processes), loads it
as the op ``torch.ops.radixcache_paged_cpu.paged_attention`` and returns that namespace, or None
where it cannot be built, the reason logged once and kept in ``unavailable_reason()``.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from pathlib import Path

logger = logging.getLogger("radixcache")

SOURCE = Path(__file__).with_name("paged_cpu.cpp")
# vectorised float reductions, but infinities kept (the online softmax starts from -inf)
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math",
         "-fno-signed-zeros"]

_LOCK = threading.Lock()
_BUILT: dict = {}


def kernel():
    """The op namespace holding ``paged_attention``, or None where the kernel cannot be built here."""
    with _LOCK:
        if "module" not in _BUILT:
            _BUILT["module"], _BUILT["reason"] = _build()
            if _BUILT["module"] is None:
                logger.warning("radixcache: the in-place CPU paged attention is not available (%s); "
                               "attention gathers each context first", _BUILT["reason"])
        return _BUILT["module"]


def unavailable_reason() -> str | None:
    """Why ``kernel()`` returned None (None before it was tried or when it was built)."""
    return _BUILT.get("reason")


def _build():
    try:
        import torch
        from torch.utils.cpp_extension import load

        digest = hashlib.sha256((SOURCE.read_text() + " ".join(FLAGS)).encode()).hexdigest()[:12]
        name = f"radixcache_paged_cpu_{digest}"
        logger.info("radixcache: loading the in-place CPU paged attention (built on its first use on a "
                    "machine, about 10 s)")
        load(name=name, sources=[str(SOURCE)], extra_cflags=FLAGS, extra_ldflags=["-fopenmp"],
             is_python_module=False, verbose=False)
        ops = torch.ops.radixcache_paged_cpu
        ops.paged_attention  # noqa: B018 -- raises if the library registered nothing
    except Exception as exc:  # no compiler, no ninja, a build error: the gather path serves
        return None, f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else exc}"
    return ops, None

