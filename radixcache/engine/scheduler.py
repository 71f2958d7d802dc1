"""Which sequences run in the next step, and what they hold: admission, growth and preemption.

Every cache operation goes through the ``CacheManager`` (admit / grow / commit / fork / finish /
release), with its lock held by the caller (``Engine.step``).

- Admission (waiting -> running): by effective priority (lower first; prefill-only requests last
  unless promoted), then a request passed over ``starvation_rounds`` times, then the longest cached
  prefix (``"lpm"``) or arrival (``"fcfs"``). A request admits only when its first chunk's blocks
  can be had (evicting LRU leaves if need be); otherwise admission stops for this step, so no
  small request overtakes a large one forever. A request whose prompt shares uncached blocks with
  a prompt being computed waits for it (and promotes a prefill-only one to its own priority) and
  then matches those blocks from the tree: the same blocks are never computed twice, and the
  waiting request counts them as cached. A prefill-only request that has not started yet holds no
  normal request back: the normal one computes the shared blocks itself, and the prefill-only one,
  admitted after it, waits for it and then finds them cached (background work such as a reply's
  history form never costs a client a step). ``PromptIndex`` answers "which prompt being computed
  shares blocks with this one" with one dictionary lookup: it files each member's prompt under the
  chained hash of every prefix of whole blocks (``Sequence.block_hashes``), then compares the
  candidate's tokens exactly (a hash collision cannot make it answer wrongly).
- A step takes every decode (one token each) and then prompt chunks within ``max_step_tokens``,
  in priority order; each sequence's blocks grow to cover its new tokens. When even eviction cannot
  supply them, the lowest-priority, most recently admitted sequence is preempted: what it computed
  goes into the tree, it releases its blocks and waits again with its tokens (re-admitted without
  counting its prompt twice). A sequence that would need more blocks than the whole pool finishes
  with ``"length"``.
"""

from __future__ import annotations

from bisect import bisect_right
from heapq import heapify, heappop, heappush

from radixcache.engine.sequence import Sequence
from radixcache.errors import OutOfBlocks


class PromptIndex:
    """Member sequences, filed under the chained hash of their namespace and every prefix of whole
    blocks of their prompts (``tokens[:prompt_len]``). A key names one member, or a list of them
    (oldest first) where prompts share blocks: no container per block, so filing a prompt does not
    wake the garbage collector."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._members: dict[Sequence, list] = {}  # member -> its keys
        self._by_key: dict[int, Sequence | list] = {}  # key -> the member, or members

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, seq: Sequence) -> bool:
        return seq in self._members

    def add(self, seq: Sequence) -> None:
        """File ``seq``'s prompt (a no-op when it is a member)."""
        if seq in self._members:
            return
        n = seq.prompt_len // self.block_size
        keys = seq.block_hashes(n, self.block_size)[:n]
        by_key = self._by_key
        for key in keys:
            held = by_key.setdefault(key, seq)
            if held is not seq:
                if type(held) is list:
                    held.append(seq)
                else:
                    by_key[key] = [held, seq]
        self._members[seq] = keys

    def discard(self, seq: Sequence) -> None:
        """Forget ``seq`` (a no-op when it is not a member)."""
        keys = self._members.pop(seq, None)
        by_key = self._by_key
        for key in keys or ():
            held = by_key[key]
            if held is seq:
                del by_key[key]
            else:
                held.remove(seq)
                if len(held) == 1:
                    by_key[key] = held[0]

    def sync(self, members) -> None:
        """Make the members exactly ``members`` (each added or dropped once in its life)."""
        wanted = dict.fromkeys(members)
        for seq in [s for s in self._members if s not in wanted]:
            self.discard(seq)
        for seq in wanted:
            self.add(seq)

    def sharing(self, seq: Sequence, blocks: int) -> Sequence | None:
        """The first member other than ``seq`` in its namespace whose prompt starts with the first
        ``blocks`` whole blocks of ``seq.tokens[:-1]``, or None."""
        bs = self.block_size
        if not self._members or blocks < 1 or blocks > (len(seq.tokens) - 1) // bs:
            return None
        held = self._by_key.get(seq.block_hashes(blocks, bs)[blocks - 1])
        if held is None:
            return None
        bucket = held if type(held) is list else (held,)
        end = blocks * bs
        mine = seq.tokens[:end]
        return next((other for other in bucket if other is not seq and other.live.namespace ==
                     seq.live.namespace and other.tokens[:end] == mine), None)


class Scheduler:
    """The waiting and running sequences of one engine and the rules above.

    Per step it costs O(W + R) list, heap and dictionary operations and a tree ``peek`` only for
    the waiting sequences that the tree's changes since their last peek may have changed, and that
    the admission reaches (see ``_in_order``); nothing at all for admission while every slot is
    taken. Which prompts being computed share blocks with a waiting one is looked up in a
    ``PromptIndex``, never compared pairwise.
    """

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
        self._prefilling = PromptIndex(self.block_size)  # running sequences still in their prompt
        self._synced = -1  # the tree epoch the waiting sequences' peeks were last carried to

    # ------------------------------------------------------------------ admission
    def admit(self) -> list[Sequence]:
        """Move what fits from waiting to running; return the admitted sequences."""
        if not self.waiting:
            return []
        if len(self.running) >= self.max_running:  # nobody can be admitted: nothing to rank
            for seq in self.waiting:
                seq.passed_over += 1
            return []
        self._prefilling.sync(s for s in self.running if s.in_prompt)
        admitted = []
        for seq in self._in_order():
            if len(self.running) >= self.max_running:
                break
            blocker = self._pending_prefill(seq, self._prefilling)
            if blocker is not None:
                if blocker.request.prefill_only:
                    blocker.live.boost = min(blocker.live.boost, seq.live.priority)
                continue
            if self._surely_too_big(seq, self.cached(seq)):
                break  # decided without admitting: no split, eviction, tail copy or count
            lease = self.manager.admit(seq.tokens, seq.live.namespace, count=False)
            first = min(len(seq.tokens) - lease.computed, self.max_step_tokens)
            if not self.manager.can_grow(lease, lease.computed + first):
                self.manager.release(lease)  # back out fully: nothing computed, nothing counted
                break
            self.manager.grow(lease, lease.computed + first)
            if not seq.resumed and seq.sample == 0:
                if not seq.request.prefill_only:  # background work, not a query of the cache
                    self.manager.record_admission(lease, seq.prompt_len)
                seq.live.cached_tokens = lease.cached_tokens
            seq.live.admitted = True
            seq.lease = lease
            seq.resumed = False
            seq.admitted = self._admissions
            self._admissions += 1
            self.running.append(seq)
            if seq.in_prompt:
                self._prefilling.add(seq)
            admitted.append(seq)
        if admitted:
            gone = set(admitted)
            self.waiting[:] = [s for s in self.waiting if s not in gone]
        for seq in self.waiting:
            seq.passed_over += 1
        return admitted

    def _in_order(self):
        """The waiting sequences in admission order (module docstring), lazily. For ``"lpm"``
        they are ranked by a bound on their cached prefix that only the tree's evictions can have
        made too high; the first in line is peeked exactly and goes back in line if it now ranks
        lower, so the order is exact while only the sequences it reaches are peeked."""
        rounds = self.starvation_rounds
        if self.schedule == "fcfs":
            yield from sorted(self.waiting, key=lambda s: (s.live.priority, s.passed_over < rounds,
                                                           s.arrival))
            return
        self._sync_peeks()
        heap = [((s.live.priority, s.passed_over < rounds, -self._bound(s), s.arrival, i), s)
                for i, s in enumerate(self.waiting)]
        heapify(heap)
        while heap:
            key, seq = heappop(heap)
            exact = -self.cached(seq)
            if exact != key[2]:
                key = key[:2] + (exact,) + key[3:]
                if heap and key > heap[0][0]:
                    heappush(heap, (key, seq))
                    continue
            yield seq

    def cached(self, seq: Sequence) -> int:
        """Tokens of ``seq.tokens[:-1]`` the tree holds now (``peek``): peeked again only when
        the tree evicted something since, or inserted something that could extend it (see
        ``_sync_peeks``)."""
        tree, changes = self.manager.tree, self.manager.tree.changes
        exact_at, synced, n, have, _ = seq.peeked
        if synced == changes.epoch and exact_at >= changes.evicted_epoch and n == len(seq.tokens):
            return have
        tokens, bs = seq.tokens, self.block_size
        have = tree.peek(tokens[:-1], seq.live.namespace)
        first_missing = tokens[have:have + bs].tobytes()
        seq.peeked = (changes.epoch, changes.epoch, len(tokens), have, first_missing)
        return have

    def _bound(self, seq: Sequence) -> int:
        """At least ``cached(seq)``: the last peek, if only evictions can have changed it since."""
        _, synced, n, have, _ = seq.peeked
        if synced == self._synced and n == len(seq.tokens):
            return have
        return self.cached(seq)

    def _sync_peeks(self) -> None:
        """Carry every waiting sequence's last peek forward to the tree's epoch unless an insert
        since (``radixcache.tree.body``) began with one of its blocks at or before the first one
        the peek did not find: only those can have grown."""
        changes = self.manager.tree.changes
        epoch, old = changes.epoch, self._synced
        if epoch == old:
            return
        self._synced = epoch
        inserts = changes.inserted_since(old)
        if inserts is None:
            return  # too much happened: every sequence is peeked again when it is ranked
        bs = self.block_size
        at: dict[int, set] = {}  # block index -> the first new blocks inserted there
        for j, block in inserts:
            at.setdefault(j, set()).add(block)
        where = sorted(at)
        for seq in self.waiting:
            exact_at, synced, n, have, first_missing = seq.peeked
            if synced != old or n != len(seq.tokens):
                continue
            frontier = have // bs
            reach = bisect_right(where, frontier)  # inserts at or before its first missing block
            if reach:
                if where[reach - 1] == frontier and first_missing in at[frontier]:
                    continue
                tokens = seq.tokens
                if any(tokens[j * bs:(j + 1) * bs].tobytes() in at[j] for j in where[:reach]
                       if j != frontier):
                    continue
            seq.peeked = (exact_at, epoch, n, have, first_missing)

    def _surely_too_big(self, seq: Sequence, have: int) -> bool:
        """Whether ``seq``'s first chunk cannot get its blocks even if ``have`` of its tokens are
        cached: a lower bound on what ``admit`` + ``grow`` would take against what the pool could
        free now."""
        bs = self.manager.block_size
        end = min(len(seq.tokens), have + self.max_step_tokens)
        return -(-end // bs) - have // bs > self.manager.freeable_blocks()

    def _pending_prefill(self, seq: Sequence, index: PromptIndex) -> Sequence | None:
        """A member of ``index`` (a prompt still being computed) that shares with ``seq`` at least
        one whole block more than the tree holds now; None when there is none."""
        if not index:
            return None
        return index.sharing(seq, self.cached(seq) // self.block_size + 1)

    # ------------------------------------------------------------------ one step
    def schedule_step(self) -> tuple[list[tuple[Sequence, int]], list[Sequence]]:
        """The step's ``(sequence, new tokens)`` pairs (blocks grown to cover them) and the
        sequences that must finish with ``"length"`` because they outgrew the whole pool."""
        budget = self.max_step_tokens
        batch: dict[Sequence, int] = {}
        too_long = []
        bs, pool_blocks = self.block_size, self.manager.allocator.num_blocks
        order = sorted(self.running, key=lambda s: (s.lease.computed < len(s.tokens) - 1,
                                                    s.live.priority, s.admitted))
        preempted = set()
        for seq in order:
            if budget <= 0:
                break
            if seq in preempted:
                continue
            lease = seq.lease
            take = min(len(seq.tokens) - lease.computed, budget)
            if take < 1:
                continue
            length = lease.computed + take
            if length > len(lease.blocks) * bs:  # needs blocks (most decodes do not)
                if -(-length // bs) > pool_blocks:
                    too_long.append(seq)
                    continue
                while not self.manager.can_grow(lease, length):
                    victim = max(self.running, key=lambda s: (s.live.priority, s.admitted))
                    budget += batch.pop(victim, 0)
                    self.preempt(victim)
                    preempted.add(victim)
                    if victim is seq:
                        break
                else:
                    self.manager.grow(lease, length)
                if seq in preempted:
                    continue
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
        ``retain`` and the request's ``keep_s``, its committed path is retained that long."""
        if seq.lease is not None:
            lease, seq.lease = seq.lease, None
            self.running.remove(seq)
            self.manager.finish(lease, seq.tokens, seq.request.keep_s if retain else None)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def back_out(self, seq: Sequence) -> None:
        """After a failure: ``seq`` ends keeping only what was committed before (no retention
        hint). Its lease is let go even when this raises."""
        self.finish(seq, retain=False)
