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
"""

from __future__ import annotations

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
