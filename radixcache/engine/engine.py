"""Engine: continuous batching in one ragged forward per step, always on.

A front end adds requests at any time (``add``), calls ``step`` in a loop while ``has_work``, and
may ``abort`` a request at any time. Each step admits what fits (``Scheduler``), packs the new
tokens of every running sequence (prompt chunks and single-token decodes) into one forward through
the ``ModelRunner`` with a ``StepPlan`` (``pack_batch`` lays a step's sequences end to end: for each
its next ``k`` tokens at their positions, one attention ``Segment``, and the packed rows whose
logits the step needs), chooses every next token at once (``choose``) and returns the ``Event``
objects it produced. Whole blocks go into the tree as soon as they are computed, so a request
behind shares them at once; ``n > 1`` samples fork after the prompt. Rows of constrained
requests are masked by their grammars first (``radixcache.engine.grammar``); log-probabilities are
read from the raw logits, only for the rows of requests that ask for them.

Failures stay with their request. A forward that raises is run again in halves (by request) until
the requests whose input makes it fail are alone: they end with ``"error"``, every other request
of the step goes on with the tokens it would have had. A logits row with NaN or +inf, or with no
allowed token left, ends its sample with ``"error"`` (``radixcache.engine.sampling``); anything that
raises while a sample's token is recorded ends that sample's request. No failure leaves a block
held or a token outside the vocabulary.

Thread safety: ``add`` and ``abort`` may be called from any thread and only queue (they take the
inbox's lock, never the manager's, and never wait on a step); ``step`` runs one at a time (a
second caller waits) and applies what was queued. ``flush`` applies queued aborts at once when no
step runs (their blocks are released; the events come from the next ``step``). Requests added
between steps join the running batch at the next one. Events go to whoever calls ``step``: one
loop (e.g. the server's scheduler thread) should own the stepping of an engine and route events by
``request_id``.
"""

from __future__ import annotations

import logging
import threading
import time
from array import array

import torch

from radixcache.attention.plan import Segment, StepPlan, device_tensor
from radixcache.engine import grammar
from radixcache.engine.inbox import Inbox
from radixcache.engine.request import (FINISH_ABORT, FINISH_ERROR, FINISH_LENGTH, FINISH_PREFILLED,
                                       FINISH_STOP, Event, Request, ValidRequest, request_namespace,
                                       validated_prompt)
from radixcache.engine.runner import EngineMetrics, ModelRunner
from radixcache.engine.sampling import Row, choose_step
from radixcache.engine.scheduler import Scheduler
from radixcache.engine.sequence import Live, Sequence, fork_samples, new_leader


def pack_batch(batch) -> tuple[list, list, list, list]:
    """``(tokens, positions, segments, logits_rows)`` of ``batch`` (a list of ``(Sequence, k)``):
    the packed token ids and their positions, one ``Segment`` per sequence (its offset in the
    packed tokens, ``k``, its K/V length after the step, its blocks), and the packed indices whose
    logits are needed, in batch order (empty when no sequence needs one)."""
    tokens, positions, segments, logits_rows = [], [], [], []
    for seq, k in batch:
        start = seq.computed
        segments.append(Segment(len(tokens), k, start + k, tuple(seq.lease.blocks)))
        tokens.extend(seq.tokens[start:start + k])
        positions.extend(range(start, start + k))
        if start + k == len(seq.tokens) and not seq.request.prefill_only:
            logits_rows.append(len(tokens) - 1)
    return tokens, positions, segments, logits_rows


logger = logging.getLogger("radixcache.engine")
OUTGREW_POOL = "the sequence outgrew the whole KV pool (raise max_cache_tokens / --max-cache-tokens)"


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
        self._pending: list[Event] = []  # events produced outside a step (flushed aborts)
        self.last_error: BaseException | None = None  # the exception of the last failure
        self._arrivals = 0

    # ------------------------------------------------------------------ public
    @property
    def has_work(self) -> bool:
        """True while any added request has not delivered its final events."""
        return bool(self._inbox or self._pending)

    def namespace(self, cache_salt: str | None = None) -> tuple:
        """The tree namespace of requests with ``cache_salt``: ``request_namespace`` of this
        engine's model (what a store fetch for them must name)."""
        return request_namespace(self.runner.model_id, cache_salt)

    def validate(self, request: Request) -> ValidRequest:
        """``request`` validated for this engine, without adding it: its prompt as a new
        ``array('I')`` (the sequence the engine extends), which ``add`` takes as it is.

        Raises ``TypeError``/``ValueError`` for a bad request, a prompt or stop token id outside
        the vocabulary, a constraint that is not a grammar compiled for this vocabulary or a
        request id already in use, and ``OutOfBlocks`` for a prompt the whole pool cannot hold.
        """
        tokens = validated_prompt(request, self.runner.vocab_size, self.manager.allocator.num_blocks,
                                  self.manager.block_size)
        if request.constraint is not None:
            grammar.validate_constraint(request.constraint, self.runner.vocab_size,
                                        f"request {request.request_id!r}")
        if self._inbox.in_use(request.request_id):
            raise ValueError(f"request id {request.request_id!r} is already in use")
        return ValidRequest(request, tokens, self)

    def add(self, request: Request | ValidRequest, fetched=None) -> None:
        """Queue ``request`` (validated as by ``validate`` unless it is this engine's
        ``ValidRequest`` already; nothing changes when that raises); it joins the running batch at
        the next step. ``fetched``: what ``manager.fetch`` read from the shared store for its
        prompt, loaded into the tree (``manager.load``) by the step that admits it, on the
        stepping thread."""
        valid = request if isinstance(request, ValidRequest) and request.engine is self else \
            self.validate(request)
        request = valid.request
        seed = request.params.seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,)))
        live = Live(request, self.namespace(request.cache_salt), seed)
        self._inbox.put_add(request.request_id, live, valid.prompt, fetched)

    def abort(self, request_id, sample: int | None = None) -> bool:
        """Queue a stop of request ``request_id`` (or only of its sample ``sample``, e.g. on a stop
        string); the next ``step`` (or ``flush``) releases its blocks (what it computed stays
        cached) and returns an ``"abort"`` event for each sample stopped. Never waits: it takes only
        the inbox's lock. Returns False for an unknown or finished id (a no-op)."""
        return self._inbox.put_abort(request_id, sample)

    def flush(self) -> bool:
        """Apply the queued adds and aborts now, when no step runs (aborted requests' blocks are
        released; their events come from the next ``step``). Returns False, changing nothing, while
        another thread steps: that step applies them at its end. For callers that own the stepping
        and stop stepping (``BatchRun.close``); a server's loop never calls it."""
        if not self._busy.acquire(blocking=False):
            return False
        try:
            with self.manager.mutex:
                self._pending.extend(self._drain())
        finally:
            self._busy.release()
        return True

    def step(self) -> list[Event]:
        """Run one step; return the events it produced (empty when there was nothing to do).

        A forward that raises is retried in halves until only the requests that make it fail are
        left; they end with ``"error"`` events (what earlier steps computed stays cached, nothing
        stays held; ``last_error`` keeps the exception) and the engine stays usable.
        ``KeyboardInterrupt`` and the like end every request of the step that way, then propagate.
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
                    events.extend(self._finish(seq, FINISH_LENGTH, None, note=OUTGREW_POOL))
                used = self.manager.allocator.num_blocks - self.manager.allocator.num_free
                self.metrics.peak_used_blocks = max(self.metrics.peak_used_blocks, used)
            if batch:
                for part, logits in self._forward(batch, events):
                    with self.manager.mutex:
                        events.extend(self._advance(part, logits))
                with self.manager.mutex:
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
                _, live, tokens, fetched = item
                if fetched is not None:
                    self._load(live, fetched)
                self._enqueue(live, tokens)
            else:
                events.extend(self._abort(item[1], item[2]))
        return events

    def _load(self, live: Live, fetched) -> None:
        """Put the store's blocks fetched for ``live``'s prompt into the tree; a failure is a miss."""
        try:
            loaded = self.manager.load(fetched)
        except Exception:  # noqa: BLE001 - a store problem is a miss, never a failed request
            logger.exception("request %s: loading the store's blocks failed", live.request.request_id)
            return
        if loaded:
            logger.debug("request %s: %d prompt tokens loaded from the store", live.request.request_id, loaded)

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
    def _forward(self, batch, events: list) -> list[tuple[list, torch.Tensor]]:
        """The step's ``(part, logits)`` pairs: one for the whole ``batch`` when its forward runs.
        When it raises, its two halves (by request: a request's samples stay together) run again on
        their own, down to single requests, which then end with ``"error"`` (into ``events``):
        one request whose input breaks the model fails alone. A ``BaseException`` that is not an
        ``Exception`` (``KeyboardInterrupt``) ends every request of ``batch`` and propagates."""
        try:
            return [(batch, self._run(batch))]
        except BaseException as e:
            self.last_error = e
            ids = list(dict.fromkeys(seq.request.request_id for seq, _ in batch))
            if not isinstance(e, Exception) or len(ids) == 1:
                with self.manager.mutex:
                    events.extend(self._fail(ids, e))
                if not isinstance(e, Exception):
                    raise
                logger.warning("request %s failed in the model: %s: %s", ids[0], type(e).__name__, e)
                return []
            logger.debug("a forward of %d requests failed (%s: %s): running its halves alone",
                         len(ids), type(e).__name__, e)
            first = set(ids[:len(ids) // 2])
            return (self._forward([(s, k) for s, k in batch if s.request.request_id in first], events)
                    + self._forward([(s, k) for s, k in batch if s.request.request_id not in first], events))

    def _run(self, batch) -> torch.Tensor:
        """The logits of one forward over ``batch``; may raise (nothing is committed before it)."""
        tokens, positions, segments, logits_rows = pack_batch(batch)
        began = time.perf_counter()
        try:
            plan = StepPlan(self.pool, segments, self.backend)
            return self.runner.forward(tokens, positions, plan, logits_rows or [0])
        finally:
            self.metrics.forward_s += time.perf_counter() - began

    def _fail(self, request_ids, error: BaseException) -> list[Event]:
        """End ``request_ids`` after a failed forward: release everything, one "error" event per
        unfinished sample."""
        events = []
        why = f"{type(error).__name__}: {error}"
        for request_id in request_ids:
            live = self._live.get(request_id)
            if live is None:
                continue
            for seq in self._samples[request_id]:
                try:
                    self.scheduler.back_out(seq)  # no retention hint for a failure
                except Exception:  # noqa: BLE001 - the lease is let go even so (CacheManager.release)
                    logger.exception("request %s: backing out sample %d failed", request_id, seq.sample)
            n = live.request.num_samples
            events.extend(Event(request_id, i, None, True, FINISH_ERROR, live.cached_tokens, why)
                          for i in range(n) if i not in live.finished)
            self._forget(request_id)
        return events

    def _advance(self, batch, logits: torch.Tensor) -> list[Event]:
        """Record what the forward computed, choose the next tokens, finish what is done. Whatever
        raises for one sequence (its commit, fork, grammar, ...) ends that sequence's request
        alone; a row without a valid token ends its sample with ``"error"``."""
        events: list[Event] = []
        choosers: list[tuple[Sequence, int]] = []
        row = -1
        for seq, k in batch:
            done = seq.computed + k
            wants_row = done == len(seq.tokens) and not seq.request.prefill_only  # as pack_batch's logits_rows
            row += wants_row
            if not self._serving(seq):
                continue  # its request failed earlier in this step
            try:
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
            except Exception as e:  # noqa: BLE001 - contained to this request
                events.extend(self._fail_one(seq, e))
        choosers = [(s, r) for s, r in choosers if self._serving(s)]
        if not choosers:
            return events
        for part, choice in self._choose(choosers, logits, events):
            self.manager.record_generated(sum(e is None for e in choice.errors))
            for seq, token, entry, error in zip(part, choice.tokens, choice.logprobs, choice.errors):
                if not self._serving(seq):
                    continue
                if error is not None:
                    events.extend(self._finish(seq, FINISH_ERROR, None, None, error))
                    continue
                try:
                    events.extend(self._record(seq, token, entry))
                except Exception as e:  # noqa: BLE001 - contained to this request
                    events.extend(self._fail_one(seq, e))
        return events

    def _choose(self, choosers, logits: torch.Tensor, events: list):
        """``(sequences, StepChoice)`` for the rows of ``choosers``: one batched choice, or, when
        that raises (a grammar matcher that fails), one per row, so that only the request whose row
        raises fails (into ``events``)."""
        rows = [r for _, r in choosers]
        seqs = [s for s, _ in choosers]
        if rows != list(range(len(rows))):
            logits = logits[device_tensor(rows, logits.device)]
        # in place: ``logits`` is this step's own tensor (the runner's, or the gather above)
        try:
            return [(seqs, choose_step(logits, [self._row(s) for s in seqs], self._masks, self.runner.vocab_size))]
        except Exception as e:  # noqa: BLE001 - found row by row below
            logger.debug("a step's batched choice failed (%s: %s): choosing row by row", type(e).__name__, e)
        out = []
        for i, seq in enumerate(seqs):
            try:
                out.append(([seq], choose_step(logits[i:i + 1], [self._row(seq)], self._masks,
                                               self.runner.vocab_size)))
            except Exception as e:  # noqa: BLE001 - contained to this request
                events.extend(self._fail_one(seq, e))
        return out

    @staticmethod
    def _row(seq: Sequence) -> Row:
        return Row(seq.request.params, seq.generator, seq.seen, seq.matcher)

    def _record(self, seq: Sequence, token: int, entry) -> list[Event]:
        """Append ``token`` (with its logprobs ``entry``) to ``seq``; its event, final when done."""
        seq.tokens.append(token)
        if seq.seen is not None:
            seq.seen.add(token)
        params = seq.request.params
        done = seq.matcher is not None and grammar.advance(seq.matcher, token)
        if done is None:
            return self._finish(seq, FINISH_ERROR, None, entry, f"the grammar rejected token {token}")
        if done or token in params.stop_token_ids:
            return self._finish(seq, FINISH_STOP, token, entry)
        if len(seq.tokens) - seq.prompt_len >= params.max_new_tokens:
            return self._finish(seq, FINISH_LENGTH, token, entry)
        return [Event(seq.request.request_id, seq.sample, token, False, None,
                      seq.live.cached_tokens, None, entry)]

    def _serving(self, seq: Sequence) -> bool:
        """``seq``'s request is still served (it has not failed or finished)."""
        return self._live.get(seq.request.request_id) is seq.live

    def _fail_one(self, seq: Sequence, error: BaseException) -> list[Event]:
        """End ``seq``'s request after ``error`` raised while it was advanced."""
        self.last_error = error
        logger.warning("request %s failed: %s: %s", seq.request.request_id, type(error).__name__, error)
        return self._fail([seq.request.request_id], error)

    def _fork(self, leader: Sequence) -> list[Sequence]:
        """Samples 1..n-1 of ``leader``'s request, right after its prompt."""
        children = fork_samples(leader)
        self._samples[leader.request.request_id].extend(children)
        leader.fork = 1
        return self.scheduler.fork(leader, children)

    def _finish(self, seq: Sequence, reason: str, token, logprobs=None, error=None, note=None) -> list[Event]:
        """End ``seq`` with ``reason``: its final event carries ``token`` and ``error`` (a failure:
        no retention hint) or ``note`` (why a "length" came early)."""
        if error is not None:
            self.last_error = RuntimeError(error)
        self.scheduler.finish(seq, retain=error is None)
        live = seq.live
        live.finished.add(seq.sample)
        request_id = live.request.request_id
        n = live.request.num_samples
        if len(live.finished) == n:
            self._forget(request_id)
        return [Event(request_id, seq.sample, token, True, reason, live.cached_tokens, error or note, logprobs)]
