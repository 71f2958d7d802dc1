"""A hypothesis state machine over RedisStore and a real redis-server, against a model of the store.

Rules offer random token sequences (small alphabet, so prefixes overlap) in two tenants, corrupt
or delete stored values behind the store's back, and fetch random sequences from random starts.
After every fetch: every block handed back holds exactly the K/V offered for that tenant and that
whole token prefix (soundness), the fetch stopped exactly at the first block that is absent or bad
(chain order, completeness), and a bad value's key is gone.
"""

import hashlib
import time

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from redis_servers import start
from store_blocks import fill, make_pool, open_store

from radixcache.store.keys import block_digests, namespace_digest
from radixcache.store.values import encode_value

BS = 2
TENANTS = [("model", "tenant-a"), ("model", "tenant-b")]
sequences = st.lists(st.integers(0, 2), min_size=BS, max_size=4 * BS)


def seed_of(ns, prefix) -> int:
    return int.from_bytes(hashlib.sha256(repr((ns, tuple(prefix))).encode()).digest()[:4], "little")


class StoreMachine(RuleBasedStateMachine):
    """The model: ``state[(ns, prefix)]`` is "ok" or "bad" for every block value in Redis."""

    server = None  # set by the test: one redis-server for every example

    @initialize()
    def fresh(self):
        self.raw = self.server.client()
        self.raw.flushall()
        self.pool = make_pool(block_size=BS)
        self.scratch = make_pool(block_size=BS)
        self.store = open_store(self.server.url, self.pool, timeout=5.0)
        self.state = {}
        self.offered = 0

    def expected(self, ns, prefix) -> bytes:
        fill(self.scratch, [0], seed_of(ns, prefix))
        return bytes(memoryview(self.scratch.export_block(0).data).cast("B"))

    def key(self, ns, prefix):
        digest = block_digests(namespace_digest(self.store.format, ns), prefix, BS, len(prefix) // BS)[-1]
        return self.store.key(digest)

    def flush(self):
        deadline = time.monotonic() + 30
        done = ("store_written_blocks", "store_present_blocks", "store_dropped_blocks")
        while sum(self.store.stats()[k] for k in done) < self.offered and time.monotonic() < deadline:
            time.sleep(0.005)
        assert sum(self.store.stats()[k] for k in done) == self.offered
        assert self.store.stats()["store_dropped_blocks"] == 0

    @rule(tenant=st.sampled_from(TENANTS), seq=sequences, data=st.data())
    def offer(self, tenant, seq, data):
        n = len(seq) // BS
        first = data.draw(st.integers(0, n - 1))
        blocks = list(range(n - first))
        for j, block in enumerate(blocks):
            fill(self.pool, [block], seed_of(tenant, seq[:(first + j + 1) * BS]))
        assert self.store.offer(tenant, seq, first, blocks, self.pool) == len(blocks)
        self.offered += len(blocks)
        for i in range(first, n):
            self.state.setdefault((tenant, tuple(seq[:(i + 1) * BS])), "ok")  # SET NX keeps a bad one

    @precondition(lambda self: "ok" in self.state.values())
    @rule(data=st.data(), how=st.sampled_from(["flip", "truncate", "delete", "foreign"]))
    def tamper(self, data, how):
        self.flush()
        # only intact values: flipping a flipped bit back, or truncating an empty value, would
        # leave the model's "bad" wrong or draw from an empty range
        ok = sorted((k for k, v in self.state.items() if v == "ok"), key=repr)
        ns, prefix = data.draw(st.sampled_from(ok))
        key = self.key(ns, prefix)
        value = self.raw.get(key)
        if how == "delete":
            self.raw.delete(key)
            del self.state[(ns, prefix)]
            return
        if how == "flip":
            at = data.draw(st.integers(0, len(value) - 1))
            value = value[:at] + bytes([value[at] ^ 0x01]) + value[at + 1:]
        elif how == "truncate":
            value = value[:data.draw(st.integers(0, len(value) - 1))]
        else:  # the other tenant's value for the same tokens, under this tenant's key
            other = TENANTS[1 - TENANTS.index(ns)]
            other_ns = namespace_digest(self.store.format, other)
            digest = block_digests(other_ns, prefix, BS, len(prefix) // BS)[-1]
            value = encode_value(self.store.format, other_ns, digest, prefix[-BS:],
                                 self.scratch.export_block(0))
        self.raw.set(key, value)
        self.state[(ns, prefix)] = "bad"

    @rule(tenant=st.sampled_from(TENANTS), seq=sequences, data=st.data())
    def fetch(self, tenant, seq, data):
        self.check_fetch(tenant, seq, data.draw(st.integers(0, len(seq) // BS)))

    @precondition(lambda self: self.state)
    @rule(data=st.data(), more=st.lists(st.integers(0, 2), max_size=2 * BS))
    def fetch_known(self, data, more):
        """Fetch through a prefix the model knows (often one just tampered with)."""
        tenant, prefix = data.draw(st.sampled_from(sorted(self.state, key=repr)))
        seq = list(prefix) + more
        self.check_fetch(tenant, seq, data.draw(st.integers(0, len(prefix) // BS - 1)))

    def check_fetch(self, tenant, seq, start):
        self.flush()
        n = len(seq) // BS
        got = self.store.fetch(tenant, seq, start, n)
        for j, kv in enumerate(got):
            prefix = tuple(seq[:(start + j + 1) * BS])
            assert self.state.get((tenant, prefix)) == "ok"
            assert bytes(memoryview(kv.data).cast("B")) == self.expected(tenant, prefix)
        stop = start + len(got)
        if stop < n:
            prefix = tuple(seq[:(stop + 1) * BS])
            assert self.state.get((tenant, prefix)) != "ok"  # it stopped at the first gap
            if self.state.get((tenant, prefix)) == "bad":
                assert self.raw.exists(self.key(tenant, prefix)) == 0  # a bad value is deleted
                del self.state[(tenant, prefix)]

    @invariant()
    def nothing_raised_into_the_counters(self):
        if hasattr(self, "store"):
            assert self.store.stats()["store_errors"] == 0

    def teardown(self):
        if hasattr(self, "store"):
            self.store.close()


@pytest.fixture(scope="module")
def machine_server(tmp_path_factory):
    server = start(tmp_path_factory.mktemp("redis-machine"))
    yield server
    server.stop()


def test_store_state_machine(machine_server):
    StoreMachine.server = machine_server
    StoreMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)
    StoreMachine.TestCase().runTest()
