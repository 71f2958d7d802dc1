"""A batch of prompts run on an engine until every sample is done: the loop behind generate_batch.

``BatchRun`` adds one request per prompt and steps its engine (events of other requests on the
same engine are ignored). Iterate
it for ``StreamToken`` tuples as tokens appear, or call ``result()`` for a ``BatchOutput``. It is a
context manager: leaving the ``with`` block, ``close()``, or dropping the last reference to it
(e.g. breaking out of a ``for`` loop over ``generate_batch(..., stream=True)``) aborts what is
still running, which releases its blocks (what was computed stays cached).
"""

from __future__ import annotations

import time
import weakref
from typing import NamedTuple

from radixcache.engine.request import FINISH_ERROR, ValidRequest
from radixcache.errors import OutOfBlocks

STALL_SLEEP_S = 0.001  # wait for blocks held outside the engine (another thread's generate)


class StreamToken(NamedTuple):
    """One generated token of a ``generate_batch(..., stream=True)`` run."""

    prompt: int
    sample: int
    token: int


class BatchOutput(list):
    """Per prompt, ``n`` lists of generated token ids (the prompt not repeated, a stop token
    included). ``cached_tokens[i]``: prompt tokens of prompt i served from the cache;
    ``finish_reasons[i][j]``: why sample j of prompt i ended ("stop", "length", "abort")."""

    def __init__(self, samples, cached_tokens, finish_reasons):
        super().__init__(samples)
        self.cached_tokens = cached_tokens
        self.finish_reasons = finish_reasons


def _abandon(engine, unfinished: set) -> None:
    for request_id in list(unfinished):
        engine.abort(request_id)
    unfinished.clear()
    engine.flush()  # their blocks now, unless another thread steps (its step applies the aborts)


class BatchRun:
    """``requests`` (``Request``s, or ``engine``'s ``ValidRequest``s; ids unique on ``engine``;
    prompt i is ``requests[i]``) running on ``engine``; see the module docstring.

    ``progress``: a tqdm-like bar (``update``, ``close``) advanced by one per finished sample;
    ``fetched``: per request, what ``manager.fetch`` read for it from a shared store (or None).
    """

    def __init__(self, engine, requests: list, progress=None, fetched=None):
        fetched = fetched or [None] * len(requests)
        requests = [r if isinstance(r, ValidRequest) else engine.validate(r) for r in requests]
        valid, requests = requests, [r.request for r in requests]
        self.engine = engine
        self.samples = [[[] for _ in range(r.params.n)] for r in requests]
        self.reasons = [[None] * r.params.n for r in requests]
        self.cached = [0] * len(requests)
        self._left = sum(r.params.n for r in requests)
        self._buffer: list[StreamToken] = []
        self._progress = progress
        self._index = {r.request_id: i for i, r in enumerate(requests)}
        self._unfinished = set(self._index)
        self._finalizer = weakref.finalize(self, _abandon, engine, self._unfinished)
        try:
            for r, got in zip(valid, fetched):
                engine.add(r, got)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ iteration
    def __iter__(self):
        return self

    def __next__(self) -> StreamToken:
        while not self._buffer:
            if not self._unfinished:
                self.close()
                raise StopIteration
            self._step()
        return self._buffer.pop(0)

    def result(self) -> BatchOutput:
        """Run to completion and return every sample."""
        try:
            while self._unfinished:
                self._step()
                self._buffer.clear()
        finally:
            self.close()
        return BatchOutput(self.samples, self.cached, self.reasons)

    def _step(self) -> None:
        try:
            events = self.engine.step()
        except BaseException:
            self.close()
            raise
        if not events and self.engine.stalled:
            self._wait_for_blocks()
        for ev in events:
            p = self._index.get(ev.request_id)
            if p is None:
                continue
            if ev.finish_reason == FINISH_ERROR:
                self.close()
                raise self.engine.last_error if self.engine.last_error is not None else RuntimeError(ev.error)
            self.cached[p] = ev.cached_tokens
            if ev.token is not None:
                self.samples[p][ev.sample].append(ev.token)
                self._buffer.append(StreamToken(p, ev.sample, ev.token))
            if ev.finished:
                self.reasons[p][ev.sample] = ev.finish_reason
                self._left -= 1
                if self._progress is not None:
                    self._progress.update(1)
                if all(r is not None for r in self.reasons[p]):
                    self._unfinished.discard(ev.request_id)

    def _wait_for_blocks(self) -> None:
        """Nothing could run: others hold the blocks this batch needs. Raise when nobody does."""
        manager = self.engine.manager
        with manager.mutex:
            if manager.freeable_blocks() >= manager.allocator.num_blocks:
                self.close()
                raise OutOfBlocks("no waiting prompt of this batch fits in the KV pool even when "
                                  "empty: raise max_cache_tokens")
        time.sleep(STALL_SLEEP_S)

    # ------------------------------------------------------------------ ending
    def close(self) -> None:
        """Abort whatever is still running (its blocks are released); idempotent. A closed run
        yields nothing more."""
        self._finalizer()
        self._buffer.clear()
        if self._progress is not None:
            self._progress.close()
            self._progress = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
