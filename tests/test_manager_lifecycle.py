"""The lifecycle's hot paths and its finish verb: commits that touch only their new blocks,
offers to the store copied outside the manager's lock, ``CacheManager.finish``."""

import threading
from array import array

import pytest
import torch

from radixcache import CacheError
from radixcache.kv.pool import KVPool
from radixcache.lifecycle.manager import CacheManager
from test_manager_properties import ContentPool

BS = 4


class ReadLog(list):
    """A token list that records how many tokens each read (index or slice) touched."""

    def __init__(self, *args):
        super().__init__(*args)
        self.read = 0

    def __getitem__(self, key):
        got = super().__getitem__(key)
        self.read += len(got) if isinstance(key, slice) else 1
        return got

    def __iter__(self):
        self.read += len(self)
        return super().__iter__()


def test_a_commit_reads_only_its_new_blocks():
    """Decoding 100 blocks one token at a time: each commit that completes a block reads that
    block's tokens and two committed blocks (the guard against another sequence), never the whole
    context (before: every commit re-read, re-compared and re-packed all of it)."""
    mgr = CacheManager(200, BS)
    tokens = ReadLog(range(1, 9))
    lease = mgr.admit(tokens)
    mgr.grow(lease, 8)
    mgr.commit(lease, tokens, 8)
    for t in range(9, 9 + 100 * BS):
        tokens.append(t)
        mgr.grow(lease, len(tokens))
        tokens.read = 0
        mgr.commit(lease, tokens, len(tokens))
        assert tokens.read <= 3 * BS, f"a commit at {len(tokens)} tokens read {tokens.read}"
    mgr.release(lease, list(tokens))
    mgr.check()


def test_committing_block_by_block_keeps_the_path_a_node_deep():
    """The blocks a lease commits one at a time extend its own node (it holds the only lock):
    the path stays one node, so the lock moves, recency touches and matches stay O(1) nodes
    (before: a node per commit, 100 deep)."""
    mgr = CacheManager(200, BS)
    tokens = list(range(1, 6))
    lease = mgr.admit(tokens)
    for t in range(6, 6 + 100 * BS):
        tokens.append(t)
        mgr.grow(lease, len(tokens))
        mgr.commit(lease, tokens, len(tokens))
    depth, node = 0, lease.node
    while node is not None:
        depth, node = depth + 1, node.parent
    assert depth == 2  # the namespace root and one node
    assert list(lease.tokens) == tokens[:lease.committed * BS]
    mgr.check()
    other = mgr.admit(tokens[:40] + [999, 998])  # splits the long node; the lease keeps its end
    mgr.check()
    mgr.release(other)
    mgr.release(lease, tokens)
    assert mgr.admit(tokens + [1]).cached_tokens == len(tokens) // BS * BS  # no pool: no tail copy
    for x in mgr.leases():
        mgr.release(x)


def test_commit_refuses_another_sequence_in_the_first_or_last_committed_block():
    mgr = CacheManager(16, BS)
    tokens = list(range(1, 20))
    lease = mgr.admit(tokens)
    mgr.grow(lease, 16)
    mgr.commit(lease, tokens, 12)
    for bad in ([0] + tokens[1:], tokens[:11] + [0] + tokens[12:]):
        with pytest.raises(CacheError, match="differ"):
            mgr.commit(lease, bad, 16)
    assert lease.committed == 3 and list(lease.tokens) == tokens[:12]
    mgr.release(lease, tokens)
    mgr.check()


def test_tokens_as_lists_tuples_and_arrays_give_the_same_cache():
    for form in (list, tuple, lambda x: array("I", x)):
        mgr = CacheManager(16, BS, pool=ContentPool(16, BS))
        tokens = form(range(1, 15))
        lease = mgr.admit(tokens)
        mgr.grow(lease, 14)
        mgr.commit(lease, tokens, 14)
        assert type(lease.tokens) is array and list(lease.tokens) == list(range(1, 13))
        mgr.release(lease, tokens)
        assert mgr.admit(form(range(1, 16))).cached_tokens == 14
        for x in mgr.leases():
            mgr.release(x)


# ---------------------------------------------------------------------- finish
def test_finish_commits_retains_and_releases():
    now = [0.0]
    mgr = CacheManager(8, BS, pool=ContentPool(8, BS), clock=lambda: now[0])
    kept, other = list(range(1, 11)), list(range(50, 60))
    for tokens, keep_s in ((kept, 60.0), (other, None)):
        lease = mgr.admit(tokens)
        mgr.grow(lease, 10)
        mgr.commit(lease, tokens, 10)  # tells the manager the K/V are there
        mgr.finish(lease, tokens, keep_s)
        assert lease.released
    assert mgr.stats()["cached_tokens"] == 2 * (8 + 4)  # whole blocks and the tails
    assert mgr.tree.evict(4) == 4  # both tails (never retained), then the unretained path
    assert mgr.admit(kept + [1]).cached_tokens == 8 and mgr.admit(other + [1]).cached_tokens == 0
    for x in mgr.leases():
        mgr.release(x)
    mgr.check()


@pytest.mark.parametrize("keep_s, error", [(-1.0, ValueError), ("soon", TypeError)])
def test_finish_with_a_bad_retention_changes_nothing(keep_s, error):
    mgr = CacheManager(8, BS)
    tokens = list(range(1, 10))
    lease = mgr.admit(tokens)
    mgr.grow(lease, 9)
    with pytest.raises(error):
        mgr.finish(lease, tokens, keep_s)
    assert not lease.released and mgr.stats()["cached_tokens"] == 0
    mgr.finish(lease, tokens)
    with pytest.raises(CacheError, match="released"):
        mgr.finish(lease, tokens)


def test_finish_releases_even_when_its_commit_fails():
    mgr = CacheManager(8, BS)
    tokens = list(range(1, 10))
    lease = mgr.admit(tokens)
    mgr.grow(lease, 9)
    mgr.commit(lease, tokens, 9)
    with pytest.raises(CacheError):
        mgr.finish(lease, tokens[:5], 10.0)  # fewer tokens than computed
    assert lease.released and mgr.stats()["running"] == 0 and mgr.tree.pinned_blocks == 0


def test_scheduler_and_generate_end_through_finish(monkeypatch):
    """Both front ends end a request with the one verb."""
    from radixcache.engine import Request, SamplingParams
    from radixcache.engine.stub import stub_engine

    calls = []
    real = CacheManager.finish

    def spy(self, lease, tokens, keep_s=None):
        calls.append(keep_s)
        return real(self, lease, tokens, keep_s)

    monkeypatch.setattr(CacheManager, "finish", spy)
    engine = stub_engine(32, BS)
    engine.add(Request("a", [1, 2, 3, 4, 5], SamplingParams(max_new_tokens=2), keep_s=9.0))
    while engine.has_work:
        engine.step()
    assert calls == [9.0]
    from tiny_models import random_ids, tiny_model

    import radixcache
    lm = radixcache.wrap(tiny_model("llama"), block_size=BS, max_cache_tokens=512)
    calls.clear()
    lm.generate(random_ids(9, 1, batch=2), max_new_tokens=3, do_sample=False, keep_s=5.0)
    assert calls == [5.0, 5.0]


# ---------------------------------------------------------------------- offers
def make_pool(num_blocks=16, kv_dtype=None):
    return KVPool(2, num_blocks, BS, 1, 8, dtype=torch.float32, device="cpu", kv_dtype=kv_dtype)


def fill(pool, blocks, seed):
    g = torch.Generator().manual_seed(seed)
    for block in blocks:
        rows = pool.rows_for([block], 0, BS)
        for layer in range(pool.num_layers):
            pool.write(layer, rows, torch.randn(BS, 1, 8, generator=g), torch.randn(BS, 1, 8, generator=g))


class LockProbeStore:
    """Records each offer: whether another thread could take the manager's lock meanwhile, and
    the bytes of each block as copied."""

    block_size = BS

    def __init__(self):
        self.manager = None
        self.offers = []

    def fetch(self, namespace, tokens, start, limit):
        return []

    def offer(self, namespace, tokens, start, blocks, pool):
        free = []
        probe = threading.Thread(target=lambda: free.append(self._try_lock()))
        probe.start()
        probe.join()
        copies = [bytes(memoryview(pool.export_block(b).data).cast("B")) for b in blocks]
        self.offers.append((free[0], start, list(blocks), copies))
        return len(blocks)

    def _try_lock(self):
        if self.manager.mutex.acquire(timeout=0.2):
            self.manager.mutex.release()
            return True
        return False

    def stats(self):
        return {}

    def close(self, timeout=10.0):
        return {}


def test_offers_are_copied_outside_the_lock_and_their_blocks_kept_until_then():
    """A commit inside a hold of the lock queues its offer; the lease finishes and the tree is
    told to evict everything inside that same hold: the offered blocks stay (their node is
    locked) and are copied, intact, once the lock is free, never under it (before: the copy was
    taken in the commit, under the lock)."""
    pool = make_pool()
    store = LockProbeStore()
    mgr = CacheManager(16, BS, pool=pool, store=store)
    store.manager = mgr
    tokens = list(range(1, 14))
    with mgr.mutex:
        lease = mgr.admit(tokens)
        mgr.grow(lease, 13)
        fill(pool, lease.blocks, seed=1)
        want = [bytes(memoryview(pool.export_block(b).data).cast("B")) for b in lease.blocks[:3]]
        mgr.commit(lease, tokens, 13)
        blocks = lease.blocks[:3]
        mgr.release(lease, tokens)  # the tail too
        assert store.offers == []
        assert mgr.tree.evict(16) == 1  # only the tail: the offered blocks are locked
        assert all(mgr.tree.holds(b) for b in blocks)
    assert store.offers == [(True, 0, blocks, want)]
    assert mgr.tree.pinned_blocks == 0 and mgr.freeable_blocks() == 16
    mgr.check()


def test_counting_freeable_blocks_inside_the_lock_finishes_the_offers_first():
    """freeable_blocks stays exact while an offer is queued: it hands the offer over first."""
    pool = make_pool()
    store = LockProbeStore()
    mgr = CacheManager(16, BS, pool=pool, store=store)
    store.manager = mgr
    tokens = list(range(1, 10))
    with mgr.mutex:
        lease = mgr.admit(tokens)
        mgr.grow(lease, 9)
        mgr.commit(lease, tokens, 9)
        mgr.release(lease)
        assert mgr.freeable_blocks() == 16  # the two offered blocks and the tail are evictable
        assert [o[0] for o in store.offers] == [False]  # handed over under the lock, as asked
        lease = mgr.admit(list(range(100, 165)))
        mgr.grow(lease, 64)  # takes every block: eviction never meets a locked offer
        mgr.release(lease)
    mgr.check()


@pytest.mark.parametrize("kv_dtype", [None, "fp8"])
def test_export_blocks_equals_export_block(kv_dtype):
    pool = make_pool(kv_dtype=kv_dtype)
    fill(pool, range(16), seed=2)
    many = pool.export_blocks([5, 0, 9])
    for block, kv in zip([5, 0, 9], many):
        one = pool.export_block(block)
        assert bytes(memoryview(kv.data).cast("B")) == bytes(memoryview(one.data).cast("B"))
        assert (kv.dtype, kv.shape, kv.scales) == (one.dtype, one.shape, one.scales)
    assert pool.export_blocks([]) == []
    with pytest.raises(ValueError):
        pool.export_blocks([1, 16])
