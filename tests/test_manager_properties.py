"""Stateful property tests of CacheManager alone (pure Python: no model, no torch).

The machine plays the engine: it admits sequences, grows and "computes" them a few tokens at a
time, commits (now or later), extends them by generated tokens, forks parallel samples, preempts
(release with tokens, then admit again with count=False), aborts, finishes, evicts and clears,
all under a pool of a few blocks so OutOfBlocks and eviction happen often.

A content pool stands in for the K/V tensors: every block position records what it was computed
for, ``(namespace, token prefix up to and including that position)``; ``copy_block`` copies it.
After every step:

- ``check()`` (the tree's invariants and the manager's: reference counts = tree + leases; a lease's
  committed blocks are the tree's path to its locked node; no other block of it is the tree's);
- soundness: every computed position of every lease, and every position of every block the tree
  holds (tails included), holds the K/V of exactly the tokens it claims;
- copy on write: a position is only ever written in a block its writer holds alone;
- every failed call (OutOfBlocks from grow or fork, bad tokens at admit) changed nothing;
- every block offered to the (recording) store holds, when the store copies it, exactly the K/V
  of the tokens it is offered for, even when the offer was queued inside one hold of the lock in
  which the lease finished, the tree evicted and other sequences took and wrote blocks;
- a lease's token record is its path's tokens, and committing block by block keeps it shallow;
- completeness: a sequence committed since the last eviction is matched at least to its
  block-aligned common prefix;
- the ledger counts every admission with count=True exactly once;
- at teardown, after every release and clear(), every block is free.
"""

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radixcache import CacheError, OutOfBlocks
from radixcache.lifecycle.manager import CacheManager
from radixcache.tree.body import EXTEND_LIMIT

NUM_BLOCKS = 10
NAMESPACES = ((), ("tenant",))
SETTINGS = settings(max_examples=150, stateful_step_count=40, deadline=None, derandomize=True,
                    suppress_health_check=list(HealthCheck))


class ContentPool:
    """The K/V pool reduced to what matters here: what each position was computed for."""

    def __init__(self, num_blocks, block_size):
        self.cells = [[None] * block_size for _ in range(num_blocks)]

    def copy_block(self, src, dst):
        """Copy every position of block ``src`` into block ``dst``."""
        self.cells[dst] = list(self.cells[src])

    def export_blocks(self, blocks):
        """A copy of what every position of each block holds now."""
        return [list(self.cells[b]) for b in blocks]


class RecordingStore:
    """A shared store that keeps, for every offer, the tokens and the blocks' contents at the
    moment it copied them; it fetches nothing."""

    def __init__(self, block_size):
        self.block_size = block_size
        self.offered = []

    def fetch(self, namespace, tokens, start, limit):
        return []

    def offer(self, namespace, tokens, start, blocks, pool):
        end = (start + len(blocks)) * self.block_size
        assert len(tokens) >= end
        self.offered.append((namespace, tuple(tokens[:end]), start, pool.export_blocks(blocks)))
        return len(blocks)

    def stats(self):
        return {}

    def close(self, timeout=10.0):
        return {}


class Seq:
    """The machine's view of one running sequence."""

    def __init__(self, lease, tokens):
        self.lease = lease
        self.tokens = list(tokens)


class ManagerMachine(RuleBasedStateMachine):
    block_size = 2

    def __init__(self):
        super().__init__()
        self.bs = self.block_size
        self.pool = ContentPool(NUM_BLOCKS, self.bs)
        self.store = RecordingStore(self.bs)
        self.mgr = CacheManager(NUM_BLOCKS, self.bs, pool=self.pool, store=self.store)
        self.seqs: list[Seq] = []
        self.known = [(1, 2, 3, 4, 5)]
        self.sure: dict = {ns: set() for ns in NAMESPACES}  # committed since the last eviction
        self.evicted = 0
        self.kept: dict = {ns: set() for ns in NAMESPACES}  # paths finished with retention
        self.admitted = self.queried = self.hit = 0

    # ------------------------------------------------------------------ helpers
    def snapshot(self):
        mgr = self.mgr
        alloc = mgr.allocator
        return ([alloc.refcount(b) for b in range(NUM_BLOCKS)], mgr.tree.cached_blocks,
                mgr.tree.pinned_blocks, [(s.lease.computed, s.lease.committed, list(s.lease.blocks))
                                         for s in self.seqs], mgr.stats())

    def draw_tokens(self, data):
        base = data.draw(st.sampled_from(self.known), label="base")
        cut = data.draw(st.integers(0, len(base)), label="cut")
        ext = data.draw(st.lists(st.integers(1, 3), max_size=5), label="extension")
        tokens = tuple(base[:cut]) + tuple(ext)
        if not tokens:
            tokens = (1,)
        if tokens not in self.known:
            self.known = (self.known + [tokens])[-12:]
        return tokens

    def note_evictions(self):
        now = self.mgr.tree.stats.evicted_blocks
        if now != self.evicted:
            self.evicted = now
            self.sure = {ns: set() for ns in NAMESPACES}

    def write(self, seq, start, end):
        """'Compute' positions start..end-1 of seq into its blocks (only blocks it holds alone)."""
        bs, lease, alloc = self.bs, seq.lease, self.mgr.allocator
        for p in range(start, end):
            block = lease.blocks[p // bs]
            assert alloc.refcount(block) == 1 and not self.mgr.tree.holds(block), \
                f"writing position {p} into block {block}, which is shared"
            self.pool.cells[block][p % bs] = (lease.namespace, tuple(seq.tokens[:p + 1]))

    def remember_committed(self, seq):
        lease = seq.lease
        if lease.committed:
            self.sure[lease.namespace].add(tuple(seq.tokens[:lease.committed * self.bs]))

    def commit(self, seq, end, tokens=None):
        """``manager.commit`` and its growth contract: when the lease holds the only lock on a leaf
        below the root that was never retained and has no tail, the new blocks extend that node in
        place (a sequence committed block by block stays one node, however many commits it makes).
        A node that may be retained (its path is a prefix of a path finished with retention) is not
        checked."""
        lease = seq.lease
        tokens = seq.tokens if tokens is None else tokens
        node, before = lease.node, lease.committed
        path = self.path_of(node)
        sole_leaf = (node.parent is not None and not node.children and node.lock_ref == 1
                     and node.tail is None and len(node.blocks) < EXTEND_LIMIT
                     and not any(kept[:len(path)] == path for kept in self.kept[lease.namespace]))
        self.mgr.commit(lease, tokens, end)
        if sole_leaf and lease.committed > before:
            assert lease.node == node, "a commit by a leaf's only holder added a node below it"

    def path_of(self, node):
        path = ()
        while node is not None:
            path, node = tuple(node.key) + path, node.parent
        return path

    def lcp(self, a, b):
        n = 0
        for x, y in zip(a, b):
            if x != y:
                break
            n += 1
        return n // self.bs * self.bs

    # ------------------------------------------------------------------ rules
    @rule(data=st.data())
    def admit(self, data):
        """A new sequence (or a reader): match tokens[:-1], pin, hold, maybe copy a tail."""
        ns = data.draw(st.sampled_from(NAMESPACES), label="namespace")
        tokens = self.draw_tokens(data)
        count = data.draw(st.booleans(), label="count")
        floor = max((self.lcp(tokens[:-1], s) for s in self.sure[ns]), default=0)
        lease = self.mgr.admit(tokens, ns, count=count)
        self.note_evictions()
        assert lease.cached_tokens >= floor, f"matched {lease.cached_tokens} < {floor}"
        assert lease.cached_tokens < len(tokens) and lease.computed == lease.cached_tokens
        event(f"admit: {'hit' if lease.cached_tokens else 'miss'}"
              f"{', tail copied' if lease.cached_tokens % self.bs else ''}")
        if count:
            self.admitted += 1
            self.queried += len(tokens)
            self.hit += lease.cached_tokens
        self.seqs.append(Seq(lease, tokens))

    @rule(bad=st.sampled_from([(), (1, -2), (1, 2.5), "ab", [[1]]]))
    def admit_bad_tokens(self, bad):
        """Bad tokens raise before anything changes."""
        before = self.snapshot()
        with pytest.raises((TypeError, ValueError)):
            self.mgr.admit(bad)
        assert self.snapshot() == before

    @precondition(lambda self: any(s.lease.computed < len(s.tokens) for s in self.seqs))
    @rule(data=st.data())
    def compute(self, data):
        """Grow a sequence by a few tokens, compute them, and commit now or later."""
        seq = data.draw(st.sampled_from([s for s in self.seqs if s.lease.computed < len(s.tokens)]),
                        label="sequence")
        lease = seq.lease
        end = min(len(seq.tokens), lease.computed + data.draw(st.integers(1, 5), label="tokens"))
        before = self.snapshot()
        fits = self.mgr.can_grow(lease, end)
        try:
            self.mgr.grow(lease, end)
        except OutOfBlocks:
            assert not fits
            assert self.snapshot() == before, "a failed grow changed something"
            event("grow: OutOfBlocks")
            return
        assert fits
        self.note_evictions()
        event("compute")
        self.write(seq, lease.computed, end)
        if data.draw(st.booleans(), label="commit now"):
            self.commit(seq, end)
            self.remember_committed(seq)
        else:
            seq.pending = max(end, getattr(seq, "pending", None) or 0)

    @precondition(lambda self: any(getattr(s, "pending", None) for s in self.seqs))
    @rule(data=st.data())
    def commit_pending(self, data):
        seq = data.draw(st.sampled_from([s for s in self.seqs if getattr(s, "pending", None)]),
                        label="sequence")
        self.commit(seq, max(seq.pending, seq.lease.computed))
        seq.pending = None
        self.remember_committed(seq)

    @precondition(lambda self: any(s.lease.computed == len(s.tokens) for s in self.seqs))
    @rule(data=st.data(), token=st.integers(1, 3))
    def generate(self, data, token):
        """A sequence whose tokens are all computed gets one more (sampled) token."""
        seq = data.draw(st.sampled_from([s for s in self.seqs if s.lease.computed == len(s.tokens)]),
                        label="sequence")
        seq.tokens.append(token)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def fork(self, data):
        """A parallel sample sharing the sequence's whole blocks, with a copy of its partial one."""
        seq = data.draw(st.sampled_from(self.seqs), label="sequence")
        if getattr(seq, "pending", None):
            return  # forks happen right after a committed step
        before = self.snapshot()
        try:
            child = self.mgr.fork(seq.lease, seq.tokens)
        except OutOfBlocks:
            assert self.snapshot() == before, "a failed fork changed something"
            event("fork: OutOfBlocks")
            return
        self.note_evictions()
        self.remember_committed(seq)
        event(f"fork: {'copied a partial block' if child.computed % self.bs else 'whole blocks'}")
        assert child.computed == seq.lease.computed and child.blocks[:child.committed] == \
            seq.lease.blocks[:child.committed]
        self.seqs.append(Seq(child, seq.tokens))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), how=st.sampled_from(["finish", "preempt", "abort", "abort and keep"]))
    def end(self, data, how):
        """Finish (release with tokens), preempt (release with tokens, admit again uncounted), or
        abort (release without tokens, or with them)."""
        seq = data.draw(st.sampled_from(self.seqs), label="sequence")
        lease = seq.lease
        keep = how != "abort"
        computed = lease.computed
        self.mgr.release(lease, seq.tokens if keep else None)
        assert lease.released and not lease.blocks
        self.mgr.release(lease)  # a second release is a no-op
        self.seqs.remove(seq)
        if keep and computed >= self.bs:
            self.sure[lease.namespace].add(tuple(seq.tokens[:computed // self.bs * self.bs]))
        event(f"end: {how}")
        if how == "preempt":
            again = self.mgr.admit(seq.tokens, lease.namespace, count=False)
            self.note_evictions()
            assert again.cached_tokens >= min(computed, len(seq.tokens) - 1) // self.bs * self.bs \
                or self.evicted, "a preempted sequence lost what it had committed"
            self.seqs.append(Seq(again, seq.tokens))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), keep_s=st.sampled_from([None, 0.0, 30.0]), k=st.integers(0, NUM_BLOCKS),
          more=st.booleans())
    def finish_inside_one_hold_of_the_lock(self, data, keep_s, k, more):
        """Inside one ``with manager.mutex``: commit what is pending, ``finish`` a sequence (the
        blocks it adds are offered, the copies deferred until the lock is free), evict, and admit,
        grow and write another sequence, which may take blocks."""
        seq = data.draw(st.sampled_from(self.seqs), label="sequence")
        lease = seq.lease
        with self.mgr.mutex:
            if getattr(seq, "pending", None):
                self.commit(seq, max(seq.pending, lease.computed))
            computed = lease.computed
            if keep_s:
                self.kept[lease.namespace].add(tuple(seq.tokens))
            self.mgr.finish(lease, seq.tokens, keep_s)
            self.seqs.remove(seq)
            self.mgr.tree.evict(k)
            if more:
                tokens = self.draw_tokens(data)
                other = Seq(self.mgr.admit(tokens, lease.namespace, count=False), tokens)
                end = min(len(tokens), other.lease.computed + 4)
                if self.mgr.can_grow(other.lease, end):
                    self.mgr.grow(other.lease, end)
                    self.write(other, other.lease.computed, end)
                    self.commit(other, end)
                self.seqs.append(other)
        self.note_evictions()
        if computed >= self.bs and not self.evicted:
            self.sure[lease.namespace].add(tuple(seq.tokens[:computed // self.bs * self.bs]))
        event(f"finish in one hold{' with retention' if keep_s else ''}")

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def released_lease_is_refused(self, data):
        seq = data.draw(st.sampled_from(self.seqs), label="sequence")
        dead = self.mgr.admit(seq.tokens[:1], seq.lease.namespace, count=False)
        self.mgr.release(dead)
        for call in (lambda: self.mgr.grow(dead, 4), lambda: self.mgr.commit(dead, (1,), 0),
                     lambda: self.mgr.fork(dead, (1,))):
            with pytest.raises(CacheError):
                call()

    @rule(k=st.integers(0, NUM_BLOCKS), clear=st.booleans())
    def evict(self, k, clear):
        if clear:
            self.mgr.clear()
        else:
            self.mgr.tree.evict(k)
        self.note_evictions()

    # ------------------------------------------------------------------ after every step
    @invariant()
    def invariants_hold(self):
        mgr, bs = self.mgr, self.bs
        mgr.check()
        for seq in self.seqs:
            lease = seq.lease
            for p in range(lease.computed):
                cell = self.pool.cells[lease.blocks[p // bs]][p % bs]
                assert cell == (lease.namespace, tuple(seq.tokens[:p + 1])), \
                    f"position {p} of a lease holds {cell}"
        paths = {}
        for node in mgr.tree.nodes():
            above = paths.get(id(node.parent), ())
            path = paths[id(node)] = above + tuple(node.key)
            for j, p in enumerate(range(len(above), len(path))):
                block = node.blocks[j // bs] if len(node.key) >= bs else node.blocks[0]
                cell = self.pool.cells[block][p % bs]
                assert cell == (node.namespace, path[:p + 1]), f"tree position {p} holds {cell}"
        for ns, tokens, start, blocks in self.store.offered:
            for j, cells in enumerate(blocks):
                for o, cell in enumerate(cells):
                    p = (start + j) * bs + o
                    assert cell == (ns, tokens[:p + 1]), f"offered position {p} held {cell}"
        self.store.offered.clear()
        stats = mgr.stats()
        assert (stats["requests"], stats["queried_tokens"], stats["hit_tokens"]) == \
            (self.admitted, self.queried, self.hit)
        assert stats["running"] == len(self.seqs)

    def teardown(self):
        for seq in list(self.seqs):
            self.mgr.release(seq.lease, seq.tokens)
        self.mgr.clear()
        self.mgr.check()
        assert self.mgr.allocator.num_free == NUM_BLOCKS
        assert self.mgr.tree.leaks() == []


class TestManagerBlockSize2(ManagerMachine.TestCase):
    """The lifecycle keeps every invariant with block size 2 (tails of one token)."""

    settings = SETTINGS


class TestManagerBlockSize3(type("M3", (ManagerMachine,), {"block_size": 3}).TestCase):
    """The lifecycle keeps every invariant with block size 3."""

    settings = SETTINGS
