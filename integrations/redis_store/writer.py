"""A background writer behind a queue bounded in bytes: the request path only ever enqueues.

The caller reserves room first (``reserve``), snapshots only what fit, then enqueues it (``put``),
so a full queue costs nothing but a counter. One daemon thread takes batches of jobs and hands
them to ``send`` (which talks to the store and does its own counting).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import NamedTuple

logger = logging.getLogger("radixcache.store")


class WriteJob(NamedTuple):
    """Blocks ``start .. start+len(blocks)-1`` of ``tokens`` (a tuple or ``array('I')`` of its own,
    covering them) in namespace ``ns``."""

    ns: bytes
    tokens: object
    start: int
    blocks: list
    nbytes: int  # bytes reserved for it in the queue


class BlockWriter:
    """One daemon thread sending queued ``WriteJob`` batches through ``send(jobs)``.

    ``send`` must count what it writes or drops; if it raises, the batch is dropped and
    ``on_failure(blocks)`` is called. ``max_bytes`` bounds the reserved bytes; ``batch_bytes`` bounds
    one call of ``send``.
    """

    def __init__(self, send, on_failure, *, max_bytes: int, batch_bytes: int):
        if max_bytes < 1 or batch_bytes < 1:
            raise ValueError("max_bytes and batch_bytes must be positive")
        self.max_bytes, self.batch_bytes = max_bytes, batch_bytes
        self._send, self._on_failure = send, on_failure
        self._jobs: collections.deque[WriteJob] = collections.deque()
        self._used = 0  # reserved bytes: queued, being snapshotted, or in flight
        self._in_flight = 0  # blocks being sent
        self._closing = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="radixcache-store-writer", daemon=True)
        self._thread.start()

    @property
    def queued_bytes(self) -> int:
        """Bytes reserved right now."""
        with self._cond:
            return self._used

    def reserve(self, count: int, each: int) -> int:
        """Reserve room for up to ``count`` items of ``each`` bytes; returns how many fit (0 once closing)."""
        with self._cond:
            if self._closing:
                return 0
            n = max(0, min(count, (self.max_bytes - self._used) // each))
            self._used += n * each
            return n

    def unreserve(self, nbytes: int) -> None:
        """Give back room reserved for a job that will not be put."""
        with self._cond:
            self._used -= nbytes
            self._cond.notify_all()

    def put(self, job: WriteJob) -> None:
        """Queue a job whose ``nbytes`` were reserved."""
        with self._cond:
            self._jobs.append(job)
            self._cond.notify_all()

    def close(self, timeout: float) -> int:
        """Stop taking jobs, wait up to ``timeout`` s for the queue to drain; returns blocks left unsent."""
        deadline = time.monotonic() + max(0.0, timeout)
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            while (self._jobs or self._in_flight) and time.monotonic() < deadline:
                self._cond.wait(deadline - time.monotonic())
            unsent = self._in_flight + sum(len(job.blocks) for job in self._jobs)
            self._jobs.clear()
            self._cond.notify_all()
        self._thread.join(max(0.0, deadline - time.monotonic()))
        return unsent

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._closing:
                    self._cond.wait()
                if not self._jobs:
                    return  # closing and drained
                batch, size = [], 0
                while self._jobs and (not batch or size + self._jobs[0].nbytes <= self.batch_bytes):
                    job = self._jobs.popleft()
                    batch.append(job)
                    size += job.nbytes
                self._in_flight = sum(len(job.blocks) for job in batch)
            try:
                self._send(batch)
            except Exception as e:  # noqa: BLE001 - the writer must outlive any failure of one batch
                logger.warning("radixcache store: a write batch failed (%s: %s); dropped",
                               type(e).__name__, e)
                self._on_failure(sum(len(job.blocks) for job in batch))
            with self._cond:
                self._used -= size
                self._in_flight = 0
                self._cond.notify_all()
