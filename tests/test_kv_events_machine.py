"""A subscriber rebuilds the tree's block set from its KV events (a hypothesis state machine).

The machine drives a real ``CacheManager`` over a pool of a few blocks, so eviction (whole leaves
and the deepest blocks of one), OutOfBlocks, splits and partial tails happen all the time, in three
namespaces (two tenants' salts of one model and another model), with running requests that pin
their paths through ``clear()``, aborts and resyncs. After every step the publisher is flushed and a
real ZMQ subscriber on loopback has applied every batch (consecutive sequence numbers, vLLM's
layout: ``kv_event_subscriber``); its block set must equal the tree's whole-block set, hash for
hash, with each block's parent and tokens, and ``whole_blocks`` must equal BlockStored minus
BlockRemoved since the last AllBlocksCleared.
"""

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kv_event_subscriber import Subscriber, tree_blocks
from radixcache import OutOfBlocks
from radixcache.kv_events import KVEventPublisher
from radixcache.lifecycle.manager import CacheManager

BS = 2
NUM_BLOCKS = 12
NAMESPACES = (("model", None), ("model", "salt-a"), ("other", None))
SETTINGS = settings(max_examples=40, stateful_step_count=30, deadline=None, derandomize=True,
                    suppress_health_check=list(HealthCheck))


class EventsMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.mgr = CacheManager(NUM_BLOCKS, BS)
        self.pub = KVEventPublisher("tcp://127.0.0.1:*", max_batch=7)
        self.mgr.use_events(self.pub)
        self.sub = Subscriber(self.pub.endpoint, BS)
        self.sub.join(self.mgr.resync_events, self.pub.flush)
        self.running = []  # (lease, tokens)
        self.known = [(1, 2, 3, 4, 5, 6)]

    def draw_tokens(self, data):
        base = data.draw(st.sampled_from(self.known), label="base")
        cut = data.draw(st.integers(0, len(base)), label="cut")
        more = data.draw(st.lists(st.integers(1, 4), min_size=0 if cut else 1, max_size=7))
        tokens = tuple(base[:cut]) + tuple(more)
        if tokens not in self.known:
            self.known.append(tokens)
        return list(tokens)

    @rule(data=st.data(), ns=st.sampled_from(NAMESPACES), finish=st.booleans())
    def request(self, data, ns, finish):
        tokens = self.draw_tokens(data)
        lease = self.mgr.admit(tokens, ns)
        try:
            self.mgr.grow(lease, len(tokens))
        except OutOfBlocks:
            self.mgr.release(lease)
            return
        done = data.draw(st.integers(lease.computed, len(tokens)), label="computed")
        self.mgr.commit(lease, tokens, done)
        if finish or len(self.running) >= 3:
            self.mgr.release(lease, tokens[:done])
        else:
            self.running.append((lease, tokens[:done]))

    @precondition(lambda self: self.running)
    @rule(data=st.data(), generated=st.lists(st.integers(1, 4), max_size=5), abort=st.booleans())
    def finish(self, data, generated, abort):
        lease, tokens = self.running.pop(data.draw(st.integers(0, len(self.running) - 1)))
        if abort:
            self.mgr.release(lease)
            return
        tokens = tokens + generated
        try:
            self.mgr.grow(lease, len(tokens))
            self.mgr.commit(lease, tokens, len(tokens))
        except OutOfBlocks:
            tokens = tokens[:lease.computed]
        self.mgr.release(lease, tokens)

    @rule(n=st.integers(0, NUM_BLOCKS))
    def evict(self, n):
        with self.mgr.mutex:
            self.mgr.tree.evict(n)

    @rule()
    def clear(self):
        self.mgr.clear()

    @rule()
    def resync(self):
        self.mgr.resync_events()

    @invariant()
    def subscriber_sees_the_tree(self):
        self.mgr.check()
        assert self.pub.flush()
        self.sub.receive_until(self.pub.batches)
        tree = self.mgr.tree
        assert self.sub.blocks == tree_blocks(tree)
        assert tree.whole_blocks == len(self.sub.blocks) == self.sub.stored - self.sub.removed
        assert self.pub.stats()["kv_events_dropped"] == 0 and self.pub.errors == 0

    def teardown(self):
        for lease, tokens in self.running:
            self.mgr.release(lease, tokens)
        self.mgr.clear()
        self.mgr.close()
        self.sub.close()


EventsMachine.TestCase.settings = SETTINGS
test_subscriber_rebuilds_the_tree_block_set = EventsMachine.TestCase
