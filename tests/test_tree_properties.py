"""Stateful property tests: RadixCache driven by random request sequences against a plain model.

The machine plays the caller. A request matches its tokens, optionally locks the matched node and
retains the matched blocks ("reuse") or recomputes everything ("fresh"), allocates blocks for the
rest (evicting when short), records for every block it allocates the exact (namespace, token
prefix) it was "written" for, inserts (sometimes with a partial tail block for its last, partial
block), and releases its references now or later (live holders). Readers match, lock and hold
blocks without inserting. Evictions and resets happen in between.

After every step the tree's invariants (docs/architecture.md's invariants and ``RadixCache``'s
docstrings) are checked:

1. every block's count == (1 if the tree holds it) + the machine's live references on it;
   num_free + used == num_blocks; the tree holds exactly the blocks the model says it holds;
2. soundness by content: every block on every tree path (partial tails included), and every block
   any match returns, was recorded for exactly the (namespace, prefix) it sits at; a match's tail
   block holds at least the tail tokens it claims, right after the matched prefix;
3. completeness: match length lies between the longest block-aligned prefix shared with a sequence
   that surely is cached (inserted since the last eviction, or locked) and with one that may be
   cached (inserted since everything unpinned was last dropped): exact while nothing was evicted;
4. every locked path still matches in full, with the same blocks, also after evicting everything;
5. ``evict(k)`` drops exactly ``min(k, evictable_blocks)`` blocks, none pinned: the ``k`` first in
   the order of the block-level LRU model (``test_tree_lru.BlockLRU``, fed every match and insert:
   least recently used first, deepest first among blocks used together, blocks under live
   retention last); after every step a copy of the tree is also evicted one block at a time and
   must follow that whole order;
6. at teardown (everything unlocked and released, then ``reset()``) every block is free.

A rule plays vLLM's ``test_evict`` scenario at random: a request continues a cached sequence into
the middle of one of its blocks (the tree offers that block, or a partial tail, to copy from), then
runs (locked, holding its prefix) or aborts at once (released without inserting).

Retention (``keep(node, until)``) runs on a clock the machine drives: a rule advances it, another
retains a locked node or a freshly matched one until a deadline that may already have passed. The
model keeps each retained path, cut back to what is still cached after every eviction; a block on a
live retained path is evicted only after every evictable block without one, and with no live
retention (never retained, or every deadline passed) the order is exactly that of plain LRU.

The checks that call ``match``/``evict`` after every step run on a deep copy of the tree so they do
not disturb the recency order under test; ``peek`` (side-effect free) runs on the real tree and must
agree with ``match``.
"""

import copy
import itertools
from collections import Counter

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixcache import BlockAllocator, OutOfBlocks, RadixCache
from test_tree_lru import BlockLRU, eviction_order

NUM_BLOCKS = 24
MAX_SEQ_BLOCKS = 6       # longest sequence, in blocks (before the ignored tail)
MAX_SEQS = 24            # sequences remembered for building new ones and for the per-step checks
NAMESPACES = ((), ("model-x", "tenant-b"))
HUGE = 10**9

SETTINGS = settings(max_examples=200, stateful_step_count=30, deadline=None, derandomize=True,
                    suppress_health_check=list(HealthCheck))


def block_pattern(j: int, bs: int) -> tuple:
    """Three block contents over a vocabulary of 2-3 tokens; for bs > 1, patterns 0 and 1 differ only
    in their last token (a mismatch inside a block) and 2 in its first."""
    if bs == 1:
        return (j,)
    return ((0,) * bs, (0,) * (bs - 1) + (1,), (1,) + (0,) * (bs - 1))[j]


class ManualClock:
    """The tree's clock in the machine: seconds that only a rule moves forward."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Request:
    """What the machine, as a caller, holds for one request or reader."""

    def __init__(self, namespace, tokens):
        self.ns = namespace
        self.tokens = tokens
        self.blocks: list = []       # references the caller holds (one each)
        self.tail_block = None       # one of blocks: the partial last block, offered to the tree
        self.node = None             # locked handle, if any
        self.locks = 0               # how many times node is locked by this request
        self.lock_tokens = ()        # tokens of the locked path
        self.lock_blocks = ()        # blocks of the locked path (as matched)
        self.inserted = False


class CacheMachine(RuleBasedStateMachine):
    """Random insert / match / lock / unlock / evict / release / reset against a reference model."""

    block_size = 1

    def __init__(self):
        super().__init__()
        self.bs = self.block_size
        self.alloc = BlockAllocator(NUM_BLOCKS)
        self.clock = ManualClock()
        self.tree = RadixCache(self.alloc, block_size=self.bs, clock=self.clock)
        self.retentions: list = []   # [namespace, retained path (cut to what is cached), until]
        self.seqs = [()]
        self.content: dict = {}      # block -> (namespace, token prefix) it was written for
        self.holders = Counter()     # block -> live references held by the machine
        self.in_tree: set = set()    # blocks the tree holds a reference on
        self.reqs: list = []
        self.sure = {ns: set() for ns in NAMESPACES}   # inserted since the last eviction
        self.maybe = {ns: set() for ns in NAMESPACES}  # inserted since all unpinned was dropped
        self.lru = BlockLRU()        # the last use of every block the tree holds
        self.queried = self.hit = self.inserted_tokens = 0

    # ------------------------------------------------------------------ model helpers
    def lcp(self, a, b) -> int:
        """Longest common block-aligned prefix of two token tuples."""
        n = 0
        for x, y in zip(a, b):
            if x != y:
                break
            n += 1
        return n // self.bs * self.bs

    def locked(self):
        return [r for r in self.reqs if r.locks]

    def pinned_set(self) -> set:
        return {b for r in self.locked() for b in r.lock_blocks}

    def bounds(self, tokens, ns):
        """(lower, upper) bound of what match(tokens, ns).length may be, from the model."""
        locked = {r.lock_tokens for r in self.locked() if r.ns == ns}
        lo = max((self.lcp(tokens, s) for s in self.sure[ns] | locked), default=0)
        hi = max((self.lcp(tokens, s) for s in self.maybe[ns] | locked), default=0)
        return lo, hi

    def observe_tree(self) -> set:
        """Blocks the tree must hold, read from the counts: count - machine's references is 0 or 1."""
        held = set()
        for b in range(NUM_BLOCKS):
            extra = self.alloc.refcount(b) - self.holders[b]
            assert extra in (0, 1), f"block {b}: count {self.alloc.refcount(b)}, " \
                                    f"machine holds {self.holders[b]}"
            if extra:
                held.add(b)
        return held

    def path_blocks(self, ns, tokens) -> list:
        """The tree's blocks for the path of ``tokens`` (found by recorded content)."""
        by_content = {self.content[b]: b for b in self.in_tree}
        bs = self.bs
        return [by_content[(ns, tokens[:(i + 1) * bs])] for i in range(len(tokens) // bs)]

    def check_match(self, m, tokens, ns):
        """Invariants 2 and 3 on one match result."""
        bs = self.bs
        tokens = tuple(tokens)
        assert m.length % bs == 0 and m.length <= len(tokens), (m.length, len(tokens))
        assert len(m.blocks) == m.length // bs, (m.length, m.blocks)
        for i, b in enumerate(m.blocks):
            assert self.content.get(b) == (ns, tokens[:(i + 1) * bs]), \
                f"block {b} at {i} holds {self.content.get(b)}, match claims {(ns, tokens[:(i + 1) * bs])}"
            assert b in self.in_tree, f"match returned block {b} that the tree does not hold"
        lo, hi = self.bounds(tokens, ns)
        assert lo <= m.length <= hi, f"match length {m.length} outside [{lo}, {hi}] for {tokens} in {ns}"
        if m.tail_block is None:
            assert m.tail_length == 0
        else:
            t = m.tail_length
            assert 1 <= t < bs and m.length + t <= len(tokens), (m.length, t, len(tokens))
            assert m.tail_block in self.in_tree, f"tail block {m.tail_block} is not the tree's"
            owner, written = self.content[m.tail_block]
            assert owner == ns and len(written) >= m.length + t and \
                written[:m.length + t] == tokens[:m.length + t], \
                f"tail block {m.tail_block} holds {written}, match claims {tokens[:m.length + t]}"
        return lo == hi

    def clone(self) -> RadixCache:
        """A deep copy of the tree (with its allocator) sharing only its clocks, so matching and
        evicting on it leaves the real tree's recency untouched (shared clocks only move forward)."""
        memo = {id(v): v for v in vars(self.tree.body).values() if isinstance(v, itertools.count)}
        memo[id(self.clock)] = self.clock
        return copy.deepcopy(self.tree, memo)

    def remember(self, tokens):
        if tokens not in self.seqs:
            self.seqs.append(tokens)
            if len(self.seqs) > MAX_SEQS:
                del self.seqs[1]

    def draw_tokens(self, data, label, ns):
        """A sequence built from a known one (mostly one that may be cached in ``ns``), kept whole or
        cut (at a block boundary or anywhere), then extended with 0-3 blocks and a short tail, so that
        prefixes collide often."""
        bs = self.bs
        cached = sorted(self.maybe[ns])
        if cached and data.draw(st.sampled_from([True, True, False]), label=f"{label} from cached"):
            pool = cached
        else:
            pool = self.seqs
        base = data.draw(st.sampled_from(pool), label=f"{label} base")
        how = data.draw(st.sampled_from(["whole", "whole", "blocks", "tokens"]), label=f"{label} cut")
        if how == "blocks":
            base = base[:data.draw(st.integers(0, len(base) // bs), label=f"{label} keep blocks") * bs]
        elif how == "tokens":
            base = base[:data.draw(st.integers(0, len(base)), label=f"{label} keep tokens")]
        ext = data.draw(st.lists(st.integers(0, 2), max_size=3), label=f"{label} blocks")
        tail = data.draw(st.lists(st.integers(0, 1), max_size=bs - 1), label=f"{label} tail")
        body = base + tuple(t for j in ext for t in block_pattern(j, bs))
        tokens = body[:MAX_SEQ_BLOCKS * bs] + tuple(tail)
        self.remember(tokens)
        return tokens

    # ------------------------------------------------------------------ operations with checks
    def do_match(self, tokens, ns):
        m = self.tree.match(tokens, ns)
        exact = self.check_match(m, tokens, ns)
        event(f"match: {'exact' if exact else 'bounded'}, {'hit' if m.length else 'miss'}")
        self.queried += len(tokens)
        self.hit += m.length
        kept_tail = None  # a partial tail kept at the matched node is used; a child's block is not
        if m.tail_block is not None:
            kept_tail = m.tail_block if len(self.content[m.tail_block][1]) % self.bs else None
            event(f"match: tail from {'a kept tail' if kept_tail is not None else 'a child'}")
        self.lru.use(m.blocks, kept_tail)
        return m

    def retained_set(self) -> set:
        """Blocks on a retained path whose deadline is still ahead."""
        out = set()
        for ns, tokens, until in self.retentions:
            if until > self.clock.now:
                out.update(self.path_blocks(ns, tokens))
        return out

    def cut_retentions(self):
        """After blocks were dropped: each retained path keeps only its prefix that is still cached
        (what comes back later is new content, not retained)."""
        cached = {self.content[b] for b in self.in_tree}
        kept = []
        for ns, tokens, until in self.retentions:
            n = 0
            while n + self.bs <= len(tokens) and (ns, tokens[:n + self.bs]) in cached:
                n += self.bs
            if n:
                kept.append([ns, tokens[:n], until])
        self.retentions = kept

    def eviction_order(self) -> list:
        """Every evictable block in the order the model says ``evict`` takes them."""
        pinned = self.pinned_set()
        return self.lru.order(self.in_tree - pinned, self.retained_set() - pinned)

    def do_evict(self, k):
        """evict(k) with invariant 5: exactly the k first blocks of the model's order."""
        tree = self.tree
        ev = tree.evictable_blocks
        pinned = self.pinned_set()
        assert ev == len(self.in_tree) - len(pinned)
        retained = self.retained_set() - pinned
        expected = self.eviction_order()[:k]
        dropped = tree.evict(k)
        assert dropped == min(k, ev), f"evict({k}) dropped {dropped}, evictable was {ev}"
        now = self.observe_tree()
        gone = self.in_tree - now
        assert now <= self.in_tree and len(gone) == dropped
        assert not gone & pinned, f"evict dropped pinned blocks {gone & pinned}"
        assert gone == set(expected), \
            f"evict({k}) dropped {sorted(gone)}, the {k} least recently used are {expected} " \
            f"(of {self.eviction_order()}, last uses {self.lru.last})"
        if dropped:
            event("evict: exact LRU order checked")
            if retained:
                event("evict: with live retention" + (", took retained blocks" if gone & retained else ""))
        self.lru.forget(gone)
        self.in_tree = now
        if dropped:
            self.forget(self.sure)
            self.cut_retentions()
        if dropped == ev:
            assert now == pinned and tree.cached_blocks == tree.pinned_blocks
            self.forget(self.maybe)
        return dropped

    def forget(self, which):
        """After blocks were dropped: only the locked paths are still known to be (or may be) cached.
        They stay in the set even once unlocked, until the next eviction."""
        for ns in NAMESPACES:
            which[ns] = {r.lock_tokens for r in self.locked() if r.ns == ns and r.lock_tokens}

    def take(self, n):
        """Allocate n blocks for the caller, evicting when short; None (and nothing changed) if the
        pool is still short."""
        if n > self.alloc.num_free:
            self.do_evict(n - self.alloc.num_free)
        if n > self.alloc.num_free:
            before = [self.alloc.refcount(b) for b in range(NUM_BLOCKS)]
            event("allocate: OutOfBlocks after evicting")
            with pytest.raises(OutOfBlocks):
                self.alloc.allocate(n)
            assert [self.alloc.refcount(b) for b in range(NUM_BLOCKS)] == before
            return None
        got = self.alloc.allocate(n)
        assert len(set(got)) == n and not any(self.holders[b] or b in self.in_tree for b in got)
        self.holders.update(got)
        return got

    def do_insert(self, req):
        bs = self.bs
        tokens, ns = req.tokens, req.ns
        nblocks = len(tokens) // bs
        lo, hi = self.bounds(tokens, ns)
        whole = req.blocks[:nblocks]
        if req.tail_block is None:
            cached = self.tree.insert(tokens, whole, ns)
        else:
            got = self.tree.adopt(tokens, whole, ns, tail_block=req.tail_block)
            cached = got.cached
        assert cached % bs == 0 and lo <= cached <= hi, f"insert returned {cached}, not in [{lo}, {hi}]"
        adopted = set(whole[cached // bs:])
        kind = "new" if not cached else "all cached" if cached == nblocks * bs else "partly cached"
        event(f"insert: {kind}{' with tail' if req.tail_block is not None else ''}")
        assert not adopted & self.in_tree
        now = self.observe_tree()
        added, dropped = now - self.in_tree, self.in_tree - now
        assert added - {req.tail_block} == adopted, "insert adopted other blocks than the new positions'"
        for b in dropped:  # only partial tails replaced or covered at this very node
            owner, written = self.content[b]
            assert owner == ns and len(written) % bs and written[:len(written) // bs * bs] in (
                tokens[:nblocks * bs], tokens[:cached]), f"insert dropped {b}"
        if req.tail_block in added:
            event("insert: tail kept")
        if dropped:
            event("insert: tail replaced or covered")
            self.lru.forget(dropped)
        self.in_tree = now
        if req.tail_block is not None:  # adopt: the tree's blocks for the whole path, and its end
            assert got.blocks == tuple(self.path_blocks(ns, tokens[:nblocks * bs]))
            assert got.node.depth_tokens == nblocks * bs
        self.inserted_tokens += len(adopted) * bs
        req.inserted = True
        if tokens in self.seqs:  # inserted sequences are the likeliest bases of the next ones
            self.seqs.remove(tokens)
            self.seqs.append(tokens)
        if nblocks:
            aligned = tokens[:nblocks * bs]
            self.sure[ns].add(aligned)
            self.maybe[ns].add(aligned)
        kept_tail = None if req.tail_block is None else self.tail_holding(ns, tokens)
        self.lru.use(self.path_blocks(ns, tokens[:nblocks * bs]), kept_tail)

    def tail_holding(self, ns, tokens):
        """The partial tail the tree holds that covers the partial last block of ``tokens`` (the one
        an insert kept or found there), or None (a whole-block child covers it instead)."""
        nblocks = len(tokens) // self.bs
        for b in self.in_tree:
            owner, written = self.content[b]
            if owner == ns and len(written) % self.bs and len(written) // self.bs == nblocks \
                    and written[:len(tokens)] == tokens:
                return b
        return None

    def release_req(self, req):
        for _ in range(req.locks):
            self.tree.unlock(req.node)
        req.locks = 0
        if req.blocks:
            self.alloc.release(req.blocks)
            self.holders.subtract(req.blocks)
        self.reqs.remove(req)

    def lock_for(self, req, m):
        self.tree.lock(m.node)
        req.node, req.locks = m.node, 1
        req.lock_tokens = tuple(req.tokens[:m.length])
        req.lock_blocks = m.blocks

    # ------------------------------------------------------------------ rules
    @initialize(data=st.data())
    def seed(self, data):
        """Start from a populated cache: 1-4 finished requests (each a fresh sequence or one built
        from the previous), inserted and released, so that even short runs see hits."""
        bs = self.bs
        for i in range(data.draw(st.integers(1, 4), label="seed requests")):
            ns = data.draw(st.sampled_from(NAMESPACES), label="namespace")
            if i == 0 or data.draw(st.booleans(), label="fresh"):
                pattern = data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=MAX_SEQ_BLOCKS),
                                    label="seed blocks")
                tokens = tuple(t for j in pattern for t in block_pattern(j, bs))
                self.remember(tokens)
            else:
                tokens = self.draw_tokens(data, "seed", ns)
            self.run_request(data, ns, tokens, lock=False, reuse=True, insert=True, release=True)

    @rule(data=st.data())
    def start_request(self, data):
        """A request: match, maybe lock, reuse or recompute the prefix, allocate, maybe insert now."""
        ns = data.draw(st.sampled_from(NAMESPACES), label="namespace")
        tokens = self.draw_tokens(data, "request", ns)
        reuse = not data.draw(st.booleans(), label="recompute the matched prefix")
        lock = not data.draw(st.booleans(), label="do not lock")
        self.run_request(data, ns, tokens, lock, reuse)

    def run_request(self, data, ns, tokens, lock, reuse, insert=None, release=None):
        """The caller's side of one request (match, lock, allocate the rest, insert, release), with every result checked."""
        m = self.do_match(tokens, ns)
        req = Request(ns, tokens)
        self.reqs.append(req)
        if lock:
            self.lock_for(req, m)
        if reuse:
            self.alloc.retain(m.blocks)
            self.holders.update(m.blocks)
            req.blocks = list(m.blocks)
        with_tail = bool(len(tokens) % self.bs) and data.draw(st.booleans(), label="with tail")
        new = self.take(len(tokens) // self.bs - len(req.blocks) + with_tail)
        if new is None:
            self.release_req(req)
            return None
        for i, b in enumerate(new, start=len(req.blocks)):
            self.content[b] = (ns, tokens[:(i + 1) * self.bs])
        req.blocks += new
        if with_tail:
            req.tail_block = req.blocks[-1]
        if insert is None:
            insert = not data.draw(st.booleans(), label="insert later")
        if insert:
            self.do_insert(req)
            if release is None:
                release = not data.draw(st.booleans(), label="keep holding")
            if release:
                self.release_req(req)
                return None
        return req

    @precondition(lambda self: self.bs > 1 and any(self.maybe.values()))
    @rule(data=st.data())
    def continue_partly(self, data):
        """vLLM's test_evict at random: a request's prompt is a cached sequence cut inside one of its
        blocks, so the tree offers that block (a child's first block, or a kept tail) to copy from;
        the request then runs (locked, holding its prefix; it inserts or aborts later) or aborts at
        once (unlocked and released without inserting). Only the blocks it matched are refreshed."""
        bs = self.bs
        ns = data.draw(st.sampled_from([ns for ns in NAMESPACES if self.maybe[ns]]), label="namespace")
        base = data.draw(st.sampled_from(sorted(self.maybe[ns])), label="continued sequence")
        keep = data.draw(st.integers(0, len(base) // bs - 1), label="whole blocks kept")
        tokens = base[:keep * bs + data.draw(st.integers(1, bs - 1), label="tokens into the next block")]
        self.remember(tokens)
        abort = data.draw(st.booleans(), label="abort at once")
        req = self.run_request(data, ns, tokens, lock=True, reuse=True, insert=False)
        event(f"continue partly: {'aborted' if abort else 'running'}")
        if abort and req is not None:
            self.release_req(req)

    @precondition(lambda self: any(not r.inserted for r in self.reqs))
    @rule(data=st.data())
    def finish_request(self, data):
        """Insert a pending request's tokens (its prefix may have been evicted meanwhile)."""
        req = data.draw(st.sampled_from([r for r in self.reqs if not r.inserted]), label="request")
        self.do_insert(req)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def release(self, data):
        """A request or reader finishes (or aborts): unlock and release every reference it holds."""
        req = data.draw(st.sampled_from(self.reqs), label="request")
        self.release_req(req)

    @rule(data=st.data())
    def query(self, data):
        """A pure match; sometimes a reader that locks the match and holds its blocks."""
        ns = data.draw(st.sampled_from(NAMESPACES), label="namespace")
        tokens = self.draw_tokens(data, "query", ns)
        m = self.do_match(tokens, ns)
        if data.draw(st.booleans(), label="reader"):
            req = Request(ns, tokens)
            req.inserted = True
            self.reqs.append(req)
            self.lock_for(req, m)
            self.alloc.retain(m.blocks)
            self.holders.update(m.blocks)
            req.blocks = list(m.blocks)

    @precondition(lambda self: any(r.locks for r in self.reqs))
    @rule(data=st.data())
    def relock(self, data):
        """Lock an already locked handle again (locks nest)."""
        req = data.draw(st.sampled_from(self.locked()), label="request")
        self.tree.lock(req.node)
        req.locks += 1

    @precondition(lambda self: any(r.locks for r in self.reqs))
    @rule(data=st.data())
    def unlock_once(self, data):
        """Undo one lock of a request; at zero its path becomes evictable again."""
        req = data.draw(st.sampled_from(self.locked()), label="request")
        self.tree.unlock(req.node)
        req.locks -= 1

    @rule(dt=st.sampled_from([0.5, 1.0, 3.0, 20.0]))
    def advance_clock(self, dt):
        """Time passes on the tree's clock: retention deadlines run out."""
        self.clock.now += dt

    @rule(data=st.data())
    def keep(self, data):
        """Retain a locked request's node, or the node of a fresh match, until a deadline (sometimes
        already passed)."""
        ahead = data.draw(st.sampled_from([-1.0, 0.0, 0.5, 1.0, 2.0, 5.0, 50.0]), label="keep for")
        until = self.clock.now + ahead
        if self.locked() and data.draw(st.booleans(), label="keep a locked node"):
            req = data.draw(st.sampled_from(self.locked()), label="request")
            ns, node, path = req.ns, req.node, req.lock_tokens
        else:
            ns = data.draw(st.sampled_from(NAMESPACES), label="namespace")
            tokens = self.draw_tokens(data, "keep", ns)
            m = self.do_match(tokens, ns)
            node, path = m.node, tuple(tokens[:m.length])
        self.tree.keep(node, until)
        event(f"keep: {'live' if ahead > 0 else 'already expired'}, {'path' if path else 'root'}")
        if path:
            self.retentions.append([ns, path, until])

    @precondition(lambda self: self.tree.evictable_blocks)
    @rule(k=st.one_of(st.integers(1, 6), st.integers(1, 3), st.sampled_from([0, HUGE, "reset"])))
    def evict(self, k):
        """Evict up to k blocks (mostly a few, sometimes none or all), or reset()."""
        if k == "reset":
            self.do_reset()
        else:
            self.do_evict(k)

    def do_reset(self):
        """reset(): every unpinned node goes; exactly the locked paths stay."""
        pinned = self.pinned_set()
        self.tree.reset()
        now = self.observe_tree()
        assert now == pinned, f"after reset the tree holds {sorted(now)}, pinned {sorted(pinned)}"
        assert self.tree.cached_blocks == self.tree.pinned_blocks == len(pinned)
        self.lru.forget(self.in_tree - now)
        self.in_tree = now
        self.forget(self.sure)
        self.forget(self.maybe)
        self.cut_retentions()

    # ------------------------------------------------------------------ after every step
    @invariant()
    def invariants_hold(self):
        """check(), invariant 1, whole-tree soundness, locks, stats; then matches and a full
        eviction on a copy (invariants 2-5)."""
        tree, alloc, bs = self.tree, self.alloc, self.bs
        tree.check()

        # 1: reference counts.
        assert self.observe_tree() == self.in_tree
        counts = [alloc.refcount(b) for b in range(NUM_BLOCKS)]
        used = sum(1 for c in counts if c)
        assert alloc.num_free == NUM_BLOCKS - used and alloc.num_free + used == alloc.num_blocks
        assert tree.cached_blocks == len(self.in_tree)

        # 2 (whole tree): every block of every node was written for the prefix it sits at.
        paths, seen = {}, set()
        for node in tree.nodes():
            above = paths.get(id(node.parent), ())
            path = paths[id(node)] = above + tuple(node.key)
            first = len(above) // bs
            for j, b in enumerate(node.blocks):
                assert self.content.get(b) == (node.namespace, path[:(first + j + 1) * bs]), \
                    f"tree block {b} holds {self.content.get(b)}, sits at {path[:(first + j + 1) * bs]}"
                seen.add(b)
        assert seen == self.in_tree

        # Pins and locked handles (4, without touching recency).
        pinned = self.pinned_set()
        assert pinned <= self.in_tree
        assert tree.pinned_blocks == len(pinned)
        assert tree.evictable_blocks == len(self.in_tree) - len(pinned)
        for r in self.locked():
            assert r.node.alive and r.node.depth_tokens == len(r.lock_tokens)
        assert (tree.stats.queried_tokens, tree.stats.hit_tokens) == (self.queried, self.hit)
        assert tree.stats.inserted_tokens == self.inserted_tokens

        # peek: no side effect (no split, no stats) on the real tree; must agree with match below.
        nodes = sum(1 for _ in tree.nodes())
        peeks = {(ns, s): tree.peek(s, ns) for ns in NAMESPACES for s in self.seqs}
        assert sum(1 for _ in tree.nodes()) == nodes, "peek split a node"
        assert (tree.stats.queried_tokens, tree.stats.hit_tokens) == (self.queried, self.hit)

        # 2, 3, 4, 5 through match/evict on a copy.
        twin = self.clone()
        for r in self.locked():
            m = twin.match(r.lock_tokens, r.ns)
            assert (m.length, m.blocks) == (len(r.lock_tokens), r.lock_blocks), "locked path changed"
        for ns in NAMESPACES:
            for s in self.seqs:
                m = twin.match(s, ns)
                self.check_match(m, s, ns)
                assert peeks[ns, s] == m.length, f"peek {peeks[ns, s]} != match {m.length}"
        ev = twin.evictable_blocks
        assert twin.evict(HUGE) == ev, "evictable_blocks is not what evict can drop"
        order = eviction_order(self.clone())  # 5: the whole order, one block at a time
        assert order == self.eviction_order(), f"eviction order {order}, block-level LRU order " \
                                               f"{self.eviction_order()} (last uses {self.lru.last})"
        assert twin.cached_blocks == twin.pinned_blocks == len(pinned)
        twin.check()
        for r in self.locked():
            m = twin.match(r.lock_tokens, r.ns)
            assert (m.length, m.blocks) == (len(r.lock_tokens), r.lock_blocks), \
                "a locked path did not survive evict"

    def teardown(self):
        """Invariant 6: unlock and release everything, reset(): every block is free."""
        for req in list(self.reqs):
            self.release_req(req)
        self.tree.reset()
        self.tree.check()
        assert self.alloc.num_free == NUM_BLOCKS, f"{NUM_BLOCKS - self.alloc.num_free} blocks leaked"
        assert self.tree.cached_blocks == self.tree.pinned_blocks == 0
        assert self.tree.leaks() == []


def machine_for(block_size):
    """The state machine for one block size, with the suite's settings."""
    machine = type(f"CacheMachineBS{block_size}", (CacheMachine,), {"block_size": block_size})
    return machine


class TestBlockSize1(machine_for(1).TestCase):
    """Random request sequences keep every invariant with block size 1 (every token is a block)."""

    settings = SETTINGS


class TestBlockSize2(machine_for(2).TestCase):
    """Random request sequences keep every invariant with block size 2."""

    settings = SETTINGS


class TestBlockSize4(machine_for(4).TestCase):
    """Random request sequences keep every invariant with block size 4."""

    settings = SETTINGS


class TestBlockSize16(machine_for(16).TestCase):
    """Random request sequences keep every invariant with block size 16 (the default)."""

    settings = SETTINGS
