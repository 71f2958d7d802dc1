"""Engine: continuous batching in one ragged forward per step, always on.

A front end adds requests at any time (``add``), calls ``step`` in a loop while ``has_work``, and
may ``abort`` a request at any time. Each step admits what fits (``Scheduler``), packs the new
tokens of every running sequence (prompt chunks and single-token decodes) into one forward through
the ``ModelRunner`` with a ``StepPlan``, chooses every next token at once (``choose``) and returns
the ``Event`` objects it produced. Whole blocks go into the tree as soon as they are computed, so
a request behind shares them at once; ``n > 1`` samples fork after the prompt. Rows of constrained
requests are masked by their grammars first (``radixcache.engine.grammar``); log-probabilities are
read from the raw logits, only for the rows of requests that ask for them.

Thread safety: ``add`` and ``abort`` may be called from any thread; ``step`` runs one at a time
(a second caller waits). An abort while no step runs releases the request's blocks at once; during
a step, at its end. Requests added between steps join the running batch at the next one. Events go
to whoever calls ``step``: one loop (e.g. the server's scheduler thread) should own the stepping
of an engine and route events by ``request_id``.
"""

from __future__ import annotations

import threading
import time
from array import array

import torch

from radixcache.attention.plan import StepPlan, device_tensor
from radixcache.engine import grammar
from radixcache.engine.inbox import Inbox
from radixcache.engine.packing import pack_batch
from radixcache.engine.request import (FINISH_ABORT, FINISH_ERROR, FINISH_LENGTH, FINISH_PREFILLED,
                                       FINISH_STOP, Event, Request, checked_prompt)
from radixcache.engine.runner import EngineMetrics, ModelRunner
from radixcache.engine.samples import fork_samples, new_leader
from radixcache.engine.sampling import Row, choose_step
from radixcache.engine.scheduler import Scheduler
from radixcache.engine.sequence import Live, Sequence


class Engine:
    """Continuous batching over one ``CacheManager``, KV pool, attention backend and model runner.

    ``max_running`` caps concurrent sequences (samples), ``max_step_tokens`` the tokens of one
    forward (longer prompts are computed in chunks); ``schedule`` ("lpm" or "fcfs") and
    ``starvation_rounds`` order admission (see ``radixcache.engine.scheduler``).
    """

    def __init__(self, manager, pool, runner: ModelRunner, backend, *, max_running: int = 64,
                 max_step_tokens: int = 2048, schedule: str = "lpm", starvation_rounds: int = 8):
        if not isinstance(runner, ModelRunner):
            raise TypeError(f"runner must be a ModelRunner, got {type(runner).__name__}")
        self.manager = manager
        self.pool = pool
        self.runner = runner
        self.backend = backend
        self.scheduler = Scheduler(manager, max_running=max_running, max_step_tokens=max_step_tokens,
                                   schedule=schedule, starvation_rounds=starvation_rounds)
        self.metrics = EngineMetrics()
        self._masks = grammar.GrammarMasks(runner.vocab_size)
        self._live: dict = {}  # request_id -> Live (added, not yet fully finished)
        self._samples: dict = {}  # request_id -> its Sequence objects (the leader first)
        self._inbox = Inbox()  # queued adds and aborts, and the request ids in use
        self._busy = threading.Lock()  # held by whoever mutates the running state
        self._pending: list[Event] = []  # events produced outside a step (aborts)
        self.last_error: BaseException | None = None  # the exception of the last failed forward
        self._arrivals = 0

    # ------------------------------------------------------------------ public
    @property
    def has_work(self) -> bool:
        """True while any added request has not delivered its final events."""
        return bool(self._inbox or self._pending)

    def check(self, request: Request) -> array:
        """Validate ``request`` for this engine without adding it; return its prompt as a new
        ``array('I')``.

        Raises ``TypeError``/``ValueError`` for a bad request, a prompt or stop token id outside
        the vocabulary, a constraint that is not a grammar compiled for this vocabulary or a
        request id already in use, and ``OutOfBlocks`` for a prompt the whole pool cannot hold.
        """
        tokens = checked_prompt(request, self.runner.vocab_size, self.manager.allocator.num_blocks,
                                self.manager.block_size)
        if request.constraint is not None:
            grammar.check_constraint(request.constraint, self.runner.vocab_size,
                                     f"request {request.request_id!r}")
        if self._inbox.in_use(request.request_id):
            raise ValueError(f"request id {request.request_id!r} is already in use")
        return tokens

    def add(self, request: Request) -> None:
        """Queue ``request`` (checked as by ``check``, nothing changes when that raises); it joins
        the running batch at the next step."""
        tokens = self.check(request)
        seed = request.params.seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,)))
        live = Live(request, (self.runner.model_id, request.cache_salt), seed)
        self._inbox.put_add(request.request_id, live, tokens)

    def abort(self, request_id, sample: int | None = None) -> bool:
        """Stop request ``request_id`` (or only its sample ``sample``, e.g. on a stop string) now:
        its blocks are released at once (what it computed stays cached), or at the end of a step
        running in another thread. Each sample stopped gets an ``"abort"`` event from the next
        ``step``. Returns False for an unknown or finished id (a no-op)."""
        if not self._inbox.put_abort(request_id, sample):
            return False
        if self._busy.acquire(blocking=False):
            try:
                with self.manager.mutex:
                    self._pending.extend(self._drain())
            finally:
                self._busy.release()
        return True

    def step(self) -> list[Event]:
        """Run one step; return the events it produced (empty when there was nothing to do).

        An exception from the model ends every request of the step with ``"error"`` events (what
        earlier steps computed stays cached, nothing stays held; ``last_error`` keeps the exception)
        and the engine stays usable; ``KeyboardInterrupt`` and the like do the same, then propagate.
        """
        with self._busy:
            with self.manager.mutex:
                events, self._pending = self._pending, []
                events.extend(self._drain())
                sched = self.scheduler
                if not (sched.waiting or sched.running):
                    return events
                started = time.perf_counter()
                sched.admit()
                batch, too_long = sched.schedule_step()
                for seq in too_long:
                    events.extend(self._finish(seq, FINISH_LENGTH, None))
                used = self.manager.allocator.num_blocks - self.manager.allocator.num_free
                self.metrics.peak_used_blocks = max(self.metrics.peak_used_blocks, used)
            if batch:
                logits = self._forward(batch, events)
                with self.manager.mutex:
                    if logits is not None:
                        events.extend(self._advance(batch, logits))
                    events.extend(self._drain())
                self.metrics.steps += 1
                self.metrics.step_tokens += sum(k for _, k in batch)
                self.metrics.step_s += time.perf_counter() - started
            return events

    @property
    def stalled(self) -> bool:
        """True when requests wait but none runs: blocks held outside this engine must come back."""
        return bool(self.scheduler.waiting) and not self.scheduler.running

    # ------------------------------------------------------------------ inbox
    def _drain(self) -> list[Event]:
        """Apply queued adds and aborts (manager lock held)."""
        events = []
        for item in self._inbox.take():
            if item[0] == "add":
                _, live, tokens = item
                self._enqueue(live, tokens)
            else:
                events.extend(self._abort(item[1], item[2]))
        return events

    def _enqueue(self, live: Live, tokens: array) -> None:
        request = live.request
        leader = new_leader(live, tokens, self._arrivals)
        self._arrivals += 1
        self._live[request.request_id] = live
        self._samples[request.request_id] = [leader]
        self.scheduler.waiting.append(leader)

    def _abort(self, request_id, sample=None) -> list[Event]:
        live = self._live.get(request_id)
        if live is None:
            return []
        n = live.request.num_samples
        stopped = [i for i in (range(n) if sample is None else [sample])
                   if 0 <= i < n and i not in live.finished]
        for seq in self._samples[request_id]:
            if seq.sample in stopped and seq.fork == 1:
                self.scheduler.finish(seq)  # a leader still to fork runs on for its samples
        live.finished.update(stopped)
        events = [Event(request_id, i, None, True, FINISH_ABORT, live.cached_tokens) for i in stopped]
        if len(live.finished) == n:
            for seq in self._samples[request_id]:
                self.scheduler.finish(seq)
            self._forget(request_id)
        return events

    def _forget(self, request_id) -> None:
        self._live.pop(request_id, None)
        self._samples.pop(request_id, None)
        self._inbox.release(request_id)

    # ------------------------------------------------------------------ the step
    def _forward(self, batch, events: list) -> torch.Tensor | None:
        tokens, positions, segments, keep = pack_batch(batch)
        began = time.perf_counter()
        try:
            plan = StepPlan(self.pool, segments, self.backend)
            logits = self.runner.forward(tokens, positions, plan, keep or [0])
        except BaseException as e:
            self.last_error = e
            with self.manager.mutex:
                events.extend(self._fail({seq.request.request_id for seq, _ in batch}, e))
            if not isinstance(e, Exception):
                raise
            return None
        finally:
            self.metrics.forward_s += time.perf_counter() - began
        return logits

    def _fail(self, request_ids, error: BaseException) -> list[Event]:
        """End ``request_ids`` after a failed forward: release everything, one "error" event per
        unfinished sample."""
        events = []
        why = f"{type(error).__name__}: {error}"
        for request_id in request_ids:
            live = self._live.get(request_id)
            if live is None:
                continue
            self.scheduler.back_out(self._samples[request_id])  # no retention hint for a failure
            n = live.request.num_samples
            events.extend(Event(request_id, i, None, True, FINISH_ERROR, live.cached_tokens, why)
                          for i in range(n) if i not in live.finished)
            self._forget(request_id)
        return events

    def _advance(self, batch, logits: torch.Tensor) -> list[Event]:
        """Record what the forward computed, choose the next tokens, finish what is done."""
        events: list[Event] = []
        choosers: list[tuple[Sequence, int]] = []
        row = 0
        for seq, k in batch:
            done = seq.computed + k
            self.manager.commit(seq.lease, seq.tokens, done)
            if done < len(seq.tokens):
                continue  # a prompt chunk: nothing to sample yet
            if seq.request.prefill_only:
                events.extend(self._finish(seq, FINISH_PREFILLED, None))
                continue
            if seq.fork > 1:
                children = self._fork(seq)
                if seq.sample in seq.live.finished:  # aborted before it forked: only the others
                    self.scheduler.finish(seq)
                else:
                    choosers.append((seq, row))
                choosers.extend((child, row) for child in children)
            else:
                choosers.append((seq, row))
            row += 1
        if not choosers:
            return events
        rows = [r for _, r in choosers]
        if rows != list(range(len(rows))):
            logits = logits[device_tensor(rows, logits.device)]
        seqs = [s for s, _ in choosers]
        # in place: ``logits`` is this step's own tensor (the runner's, or the gather above)
        tokens, logprobs = choose_step(logits, [Row(s.request.params, s.generator, s.seen, s.matcher)
                                                for s in seqs], self._masks)
        self.manager.record_generated(len(tokens))
        for seq, token, entry in zip(seqs, tokens, logprobs):
            seq.tokens.append(token)
            if seq.seen is not None:
                seq.seen.add(token)
            params = seq.request.params
            done = seq.matcher is not None and grammar.advance(seq.matcher, token)
            if done is None:
                events.extend(self._finish(seq, FINISH_ERROR, None, entry,
                                           f"the grammar rejected token {token}"))
            elif done or token in params.stop_token_ids:
                events.extend(self._finish(seq, FINISH_STOP, token, entry))
            elif len(seq.tokens) - seq.prompt_len >= params.max_new_tokens:
                events.extend(self._finish(seq, FINISH_LENGTH, token, entry))
            else:
                events.append(Event(seq.request.request_id, seq.sample, token, False, None,
                                    seq.live.cached_tokens, None, entry))
        return events

    def _fork(self, leader: Sequence) -> list[Sequence]:
        """Samples 1..n-1 of ``leader``'s request, right after its prompt."""
        children = fork_samples(leader)
        self._samples[leader.request.request_id].extend(children)
        leader.fork = 1
        return self.scheduler.fork(leader, children)

    def _finish(self, seq: Sequence, reason: str, token, logprobs=None, error=None) -> list[Event]:
        self.scheduler.finish(seq)
        live = seq.live
        live.finished.add(seq.sample)
        request_id = live.request.request_id
        n = live.request.num_samples
        if len(live.finished) == n:
            self._forget(request_id)
        return [Event(request_id, seq.sample, token, True, reason, live.cached_tokens, error, logprobs)]
