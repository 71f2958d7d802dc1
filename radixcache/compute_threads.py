"""Which thread of a process runs torch's parallel CPU kernels.

On Linux, torch's intra-op parallelism is libgomp's OpenMP. libgomp gives every thread that runs a
parallel region a pool of worker threads of its own, kept for the life of that thread. Once more
of those workers exist than CPUs, every pool throttles its spin-wait: the workers sleep between
parallel regions, and every kernel pays for waking them. Measured on a 2-core machine: a
``[1, 576] @ [576, 1536]`` matmul takes 40 us on the first thread that made a pool and 130-160 us
on any thread that makes one after it; a SmolLM2 decode step through the engine 60 ms against
90 ms.

So a process that computes on a thread other than the one that loads the model (the server's
scheduler thread) keeps every other thread serial: ``serial_here()`` on the loading thread before
its first torch op, and on helper threads that touch tensors; ``parallel_here(n)`` on the compute
thread, with the ``n`` that ``serial_here`` returned. A process that loads and computes on one
thread (``wrap(model).generate`` in a script) needs neither.

``default_threads()`` is the thread count ``radixcache serve`` and ``radixcache demo`` use without
``--threads``: ``OMP_NUM_THREADS`` when it is set, else ``available_cpus()``, how many CPUs this
process may use (its affinity, capped by a cgroup CPU quota).
``os.cpu_count()`` counts the machine's CPUs, which a container or a ``taskset`` may not allow;
threads beyond what the process may use only wait for each other.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch


def serial_here() -> int:
    """From now on, this thread runs torch's CPU kernels alone (no OpenMP pool is made for it).
    Returns the thread count torch had chosen for it before, which ``parallel_here`` takes."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    return threads


def parallel_here(threads: int) -> None:
    """From now on, this thread runs torch's CPU kernels on ``threads`` threads (>= 1), in its own
    OpenMP pool. Threads started afterwards inherit that count until they set their own."""
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise ValueError(f"threads must be an int >= 1, got {threads!r}")
    torch.set_num_threads(threads)


def default_threads() -> tuple[int, str]:
    """``(threads, why)``: ``OMP_NUM_THREADS`` when it is a positive integer, else
    ``available_cpus()``; ``why`` says which, for the start-up line."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    if value.isdigit() and int(value) >= 1:
        return int(value), "OMP_NUM_THREADS"
    return available_cpus(), "the CPUs this process may use"


def available_cpus(cgroup_root: str | os.PathLike = "/sys/fs/cgroup") -> int:
    """CPUs this process may use: its scheduler affinity (``os.sched_getaffinity``; the machine's
    count where that is not known), capped by a cgroup CPU quota (cgroup v2 ``cpu.max``, v1
    ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``, rounded up); at least 1."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    quota = _cgroup_quota(Path(cgroup_root))
    if quota is not None:
        cpus = min(cpus, max(1, math.ceil(quota)))
    return max(1, cpus)


def _cgroup_quota(root: Path) -> float | None:
    """CPUs a cgroup quota allows (None: no quota, or none readable)."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return None if quota <= 0 or period <= 0 else quota / period
    except (OSError, ValueError):
        return None
