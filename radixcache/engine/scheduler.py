"""Which sequences run in the next step, and what they hold: admission, growth and preemption.

Every cache operation goes through the ``CacheManager`` (admit / grow / commit / fork / release),
with its lock held by the caller (``Engine.step``).

- Admission (waiting -> running): by effective priority (lower first; prefill-only requests last
  unless promoted), then a request passed over ``starvation_rounds`` times, then the longest cached
  prefix (``"lpm"``) or arrival (``"fcfs"``). A request admits only when its first chunk's blocks
  can be had (evicting LRU leaves if need be); otherwise admission stops for this step, so no
  small request overtakes a large one forever. A request whose prompt shares uncached blocks with
  a prompt being computed, or with a prefill-only request still waiting, waits for it (and promotes
  a prefill-only one to its own priority) and then matches those blocks from the tree: the same
  blocks are never computed twice, and the waiting request counts them as cached.
- A step takes every decode (one token each) and then prompt chunks within ``max_step_tokens``,
  in priority order; each sequence's blocks grow to cover its new tokens. When even eviction cannot
  supply them, the lowest-priority, most recently admitted sequence is preempted: what it computed
  goes into the tree, it releases its blocks and waits again with its tokens (re-admitted without
  counting its prompt twice). A sequence that would need more blocks than the whole pool finishes
  with ``"length"``.
"""

from __future__ import annotations

import math

from radixcache.engine.sequence import Sequence
from radixcache.tokens import common_prefix
from radixcache.errors import OutOfBlocks


class Scheduler:
    """The waiting and running sequences of one engine and the rules above."""

    def __init__(self, manager, *, max_running: int, max_step_tokens: int, schedule: str,
                 starvation_rounds: int):
        if schedule not in ("lpm", "fcfs"):
            raise ValueError(f"schedule must be 'lpm' or 'fcfs', got {schedule!r}")
        for name, value in (("max_running", max_running), ("max_step_tokens", max_step_tokens),
                            ("starvation_rounds", starvation_rounds)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self.manager = manager
        self.block_size = manager.block_size
        self.max_running = max_running
        self.max_step_tokens = max_step_tokens
        self.schedule = schedule
        self.starvation_rounds = starvation_rounds
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self._admissions = 0

    # ------------------------------------------------------------------ admission
    def admit(self) -> list[Sequence]:
        """Move what fits from waiting to running; return the admitted sequences."""
        if not self.waiting:
            return []
        tree = self.manager.tree
        starved = lambda s: s.passed_over >= self.starvation_rounds  # noqa: E731
        if self.schedule == "lpm":
            cached = {id(s): tree.peek(s.tokens[:-1], s.live.namespace) for s in self.waiting}
            key = lambda s: (s.live.priority, not starved(s), -cached[id(s)], s.arrival)  # noqa: E731
        else:
            key = lambda s: (s.live.priority, not starved(s), s.arrival)  # noqa: E731
        prefilling = [s for s in self.running if s.in_prompt]
        queued_prefills = self._promote_queued_prefills()
        admitted = []
        for seq in sorted(self.waiting, key=key):
            if len(self.running) >= self.max_running:
                break
            blocker = self._pending_prefill(seq, prefilling)
            if blocker is None and not seq.request.prefill_only:
                blocker = self._pending_prefill(seq, [p for p in queued_prefills if p in self.waiting])
            if blocker is not None:
                if blocker.request.prefill_only:
                    blocker.live.boost = min(blocker.live.boost, seq.live.priority)
                continue
            have = cached[id(seq)] if self.schedule == "lpm" else tree.peek(seq.tokens[:-1], seq.live.namespace)
            if self._surely_too_big(seq, have):
                break  # decided without admitting: no split, eviction, tail copy or count
            lease = self.manager.admit(seq.tokens, seq.live.namespace, count=False)
            first = min(len(seq.tokens) - lease.computed, self.max_step_tokens)
            if not self.manager.can_grow(lease, lease.computed + first):
                self.manager.release(lease)  # back out fully: nothing computed, nothing counted
                break
            self.manager.grow(lease, lease.computed + first)
            if not seq.resumed and seq.sample == 0:
                self.manager.record_admission(lease, seq.prompt_len)
                seq.live.cached_tokens = lease.cached_tokens
            seq.live.admitted = True
            seq.lease = lease
            seq.resumed = False
            seq.admitted = self._admissions
            self._admissions += 1
            self.waiting.remove(seq)
            self.running.append(seq)
            prefilling.append(seq)
            admitted.append(seq)
        for seq in self.waiting:
            seq.passed_over += 1
        return admitted

    def _surely_too_big(self, seq: Sequence, have: int) -> bool:
        """Whether ``seq``'s first chunk cannot get its blocks even if ``have`` of its tokens are
        cached: a lower bound on what ``admit`` + ``grow`` would take against what the pool could
        free now (``have`` may be stale, from before this round's admissions: a larger ``have``
        only lowers the bound, so the answer stays safe)."""
        bs = self.manager.block_size
        end = min(len(seq.tokens), have + self.max_step_tokens)
        return -(-end // bs) - have // bs > self.manager.freeable_blocks()

    def _promote_queued_prefills(self) -> list[Sequence]:
        """The prefill-only sequences still waiting; each that shares uncached whole blocks with a
        waiting normal request is promoted to that request's priority first, so it is admitted
        ahead of it and the normal request waits for it (and counts its blocks as cached) instead
        of computing them itself."""
        queued = [s for s in self.waiting if s.request.prefill_only]
        if queued:
            for seq in self.waiting:
                if not seq.request.prefill_only:
                    blocker = self._pending_prefill(seq, queued)
                    if blocker is not None:
                        blocker.live.boost = min(blocker.live.boost, seq.live.priority)
        return queued

    def _pending_prefill(self, seq: Sequence, prefilling: list[Sequence]) -> Sequence | None:
        """A running sequence whose prompt, still being computed, shares with ``seq`` at least one
        whole block more than the tree holds now; None when there is none."""
        if not prefilling:
            return None
        ns = seq.live.namespace
        have = None
        for other in prefilling:
            if other.live.namespace != ns:
                continue
            common = common_prefix(seq.tokens[:-1], other.tokens[:other.prompt_len])
            common = common // self.block_size * self.block_size
            if common == 0:
                continue
            if have is None:
                have = self.manager.tree.peek(seq.tokens[:-1], ns)
            if common > have:
                return other
        return None

    # ------------------------------------------------------------------ one step
    def schedule_step(self) -> tuple[list[tuple[Sequence, int]], list[Sequence]]:
        """The step's ``(sequence, new tokens)`` pairs (blocks grown to cover them) and the
        sequences that must finish with ``"length"`` because they outgrew the whole pool."""
        budget = self.max_step_tokens
        batch: dict[Sequence, int] = {}
        too_long = []
        order = sorted(self.running, key=lambda s: (s.computed < len(s.tokens) - 1, s.live.priority,
                                                    s.admitted))
        for seq in order:
            if seq not in self.running or budget <= 0:
                continue
            take = min(len(seq.tokens) - seq.computed, budget)
            if take < 1:
                continue
            length = seq.computed + take
            if math.ceil(length / self.block_size) > self.manager.allocator.num_blocks:
                too_long.append(seq)
                continue
            while not self.manager.can_grow(seq.lease, length):
                victim = max(self.running, key=lambda s: (s.live.priority, s.admitted))
                budget += batch.pop(victim, 0)
                self.preempt(victim)
                if victim is seq:
                    break
            else:
                self.manager.grow(seq.lease, length)
                batch[seq] = take
                budget -= take
        return list(batch.items()), too_long

    def preempt(self, seq: Sequence) -> None:
        """Commit what ``seq`` computed, release its lease and put it first in line again."""
        self.manager.release(seq.lease, seq.tokens)
        self.manager.record_preemption()
        seq.lease = None
        seq.resumed = True
        seq.passed_over = self.starvation_rounds
        self.running.remove(seq)
        self.waiting.insert(0, seq)

    def fork(self, leader: Sequence, children: list[Sequence]) -> list[Sequence]:
        """Give each child a lease sharing ``leader``'s blocks (a copy of its partial block); a
        child that gets no block for the copy waits to be re-admitted. Returns the running ones."""
        started = []
        for child in children:
            try:
                child.lease = self.manager.fork(leader.lease, leader.tokens)
            except OutOfBlocks:
                child.resumed = True  # re-admitted later: matches the prompt from the tree
                self.waiting.append(child)
                continue
            child.admitted = leader.admitted
            self.running.append(child)
            started.append(child)
        return started

    def finish(self, seq: Sequence, retain: bool = True) -> None:
        """Commit what ``seq`` computed and release everything it holds (running or waiting); with
        ``retain`` and the request's ``retain_s``, its committed path is retained that long."""
        if seq.lease is not None:
            retain_s = seq.request.retain_s
            if retain and retain_s is not None:
                self.manager.commit(seq.lease, seq.tokens, seq.lease.computed)
                self.manager.retain(seq.lease, retain_s)
            self.manager.release(seq.lease, seq.tokens)
            seq.lease = None
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def back_out(self, seqs) -> None:
        """After a failed forward: ``seqs`` keep only what earlier steps computed."""
        for seq in seqs:
            self.finish(seq, retain=False)
