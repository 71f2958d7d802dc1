"""CacheManager unit tests: the messages and error paths the property machine does not name."""

import pytest

from radixcache import CacheError, OutOfBlocks
from radixcache.lifecycle.manager import CacheManager
from test_manager_properties import ContentPool

BS = 4


def make(num_blocks=8):
    pool = ContentPool(num_blocks, BS)
    return CacheManager(num_blocks, BS, pool=pool), pool


def run(mgr, tokens, namespace=()):
    """Admit, grow, 'compute' and finish ``tokens``; return the lease (released)."""
    lease = mgr.admit(tokens, namespace)
    mgr.grow(lease, len(tokens))
    mgr.commit(lease, tokens, len(tokens))
    mgr.release(lease, tokens)
    return lease


def test_out_of_blocks_names_free_evictable_and_running():
    """The message counts free blocks and evictable ones separately (issue 8, problem 4)."""
    mgr, _ = make(8)
    run(mgr, tuple(range(12)))            # 3 blocks cached, evictable
    hog = mgr.admit((100, 101))
    mgr.grow(hog, 8)                      # 2 blocks held by a running request
    lease = mgr.admit((200, 201))
    before = (mgr.allocator.num_free, mgr.tree.cached_blocks, list(lease.blocks))
    with pytest.raises(OutOfBlocks, match=r"3 are free and 3 more could be evicted; 2 running "
                                          r"requests hold 2"):
        mgr.grow(lease, 40)
    assert (mgr.allocator.num_free, mgr.tree.cached_blocks, list(lease.blocks)) == before
    assert mgr.can_grow(lease, 24) and not mgr.can_grow(lease, 28)
    mgr.grow(lease, 24)                   # 6 blocks: 3 free + 3 evicted
    assert mgr.tree.cached_blocks == 0
    for x in (hog, lease):
        mgr.release(x)
    mgr.check()


def test_commit_refuses_tokens_that_differ_from_what_was_committed():
    mgr, _ = make()
    tokens = tuple(range(14))
    lease = mgr.admit(tokens)
    mgr.grow(lease, 12)
    mgr.commit(lease, tokens, 8)
    before = (mgr.tree.cached_blocks, lease.computed, list(lease.blocks))
    with pytest.raises(CacheError, match="differ"):
        mgr.commit(lease, (9,) + tokens[1:], 12)
    with pytest.raises(CacheError, match="computed"):
        mgr.commit(lease, tokens, 4)      # computed never goes back
    assert (mgr.tree.cached_blocks, lease.computed, list(lease.blocks)) == before
    mgr.release(lease, tokens)
    mgr.check()


def test_ledger_counts_admissions_and_resets():
    mgr, _ = make()
    run(mgr, tuple(range(9)))
    lease = mgr.admit(tuple(range(9)) + (50,))
    assert lease.cached_tokens == 9       # 2 whole blocks + the 1-token tail
    mgr.release(lease)
    again = mgr.admit(tuple(range(9)), count=False)  # a resumed sequence is not counted twice
    mgr.release(again)
    s = mgr.stats()
    assert (s["requests"], s["queried_tokens"], s["hit_tokens"]) == (2, 19, 9)
    assert s["hit_rate"] == pytest.approx(9 / 19)
    assert s["cached_tokens"] == 12 and s["capacity_tokens"] == 32 and s["running"] == 0
    mgr.record_generated(5)
    mgr.record_fallback("beam search")
    mgr.record_preemption()
    s = mgr.stats()
    assert (s["generated_tokens"], s["fallbacks"], s["fallback_reasons"], s["preemptions"]) == \
        (5, 1, {"beam search": 1}, 1)
    mgr.reset_stats()
    assert mgr.stats()["requests"] == 0 and mgr.stats()["cached_tokens"] == 12


def test_release_lets_go_even_when_its_commit_fails():
    mgr, _ = make()
    tokens = tuple(range(6))
    lease = mgr.admit(tokens)
    mgr.grow(lease, 6)
    mgr.commit(lease, tokens, 6)
    with pytest.raises(CacheError):
        mgr.release(lease, tokens[:3])    # fewer tokens than computed
    assert lease.released and mgr.stats()["running"] == 0 and mgr.stats()["pinned_tokens"] == 0
    mgr.check()


def test_fork_needs_a_pool_for_a_partial_block():
    mgr = CacheManager(8, BS)
    tokens = (1, 2, 3, 4, 5, 6)
    lease = mgr.admit(tokens)
    mgr.grow(lease, 6)
    mgr.commit(lease, tokens, 6)
    with pytest.raises(CacheError, match="pool"):
        mgr.fork(lease, tokens)
    mgr.release(lease, tokens)
    again = mgr.admit((1, 2, 3, 4, 5, 6, 7))
    assert again.cached_tokens == 4       # no pool: a tail cannot be copied, so it is recomputed
    mgr.release(again)


def test_a_tentative_admission_is_counted_only_when_recorded():
    """admit(count=False) + release changes no counter; record_admission counts the kept one once
    (a scheduler backing out of an admission never counts a prompt twice)."""
    mgr, _ = make(8)
    run(mgr, tuple(range(8)))
    mgr.reset_stats()
    tokens = tuple(range(10))
    tentative = mgr.admit(tokens, count=False)
    mgr.release(tentative)
    assert mgr.stats()["requests"] == 0 and mgr.stats()["queried_tokens"] == 0
    kept = mgr.admit(tokens, count=False)
    mgr.record_admission(kept, len(tokens))
    stats = mgr.stats()
    assert (stats["requests"], stats["queried_tokens"], stats["hit_tokens"],
            stats["computed_prompt_tokens"]) == (1, 10, 8, 2)
    mgr.release(kept)
    with pytest.raises(CacheError, match="released"):
        mgr.record_admission(kept, len(tokens))
    assert mgr.stats()["requests"] == 1
    mgr.check()


def test_reset_stats_zeroes_every_counter_stats_reports():
    """reset_stats zeroes the ledger and the tree's counters alike (evicted tokens too), and
    leaves the cache's contents and sizes as they were."""
    mgr = CacheManager(num_blocks=4, block_size=2)
    for start in (0, 100, 200):  # the third prompt evicts the first's blocks
        tokens = list(range(start, start + 5))
        lease = mgr.admit(tokens)
        mgr.grow(lease, 4)
        mgr.commit(lease, tokens, 4)
        mgr.release(lease, tokens)
    before = mgr.stats()
    assert before["evicted_tokens"] > 0 and before["requests"] == 3
    mgr.reset_stats()
    after = mgr.stats()
    counters = ("requests", "queried_tokens", "hit_tokens", "computed_prompt_tokens",
                "generated_tokens", "preemptions", "fallbacks", "evicted_tokens")
    assert all(after[k] == 0 for k in counters), {k: after[k] for k in counters}
    assert after["cached_tokens"] == before["cached_tokens"]
    mgr.check()


def test_admit_copies_a_tail_that_eviction_takes_first():
    """A full pool whose least recently used block is the one a new prompt partly matches (the
    source of its partial-tail copy): the eviction that makes room for the copy takes the source
    itself. Admission must neither fail nor leave a pin behind: the evicted block becomes the
    lease's own (regression: OutOfBlocks from inside admit, with the match left locked)."""
    mgr = CacheManager(4, 2, pool=ContentPool(4, 2))
    for tokens in [(1, 2, 3, 4), (5, 6)]:  # blocks (1, 2) (3, 4), then (5, 6): 3 cached, 1 free
        lease = mgr.admit(tokens, count=False)
        mgr.grow(lease, len(tokens))
        mgr.commit(lease, tokens, len(tokens))
        mgr.release(lease, tokens)
    holder = mgr.admit((9, 9, 9), count=False)
    mgr.grow(holder, 2)  # the free block is taken: 0 free; evictable: (3, 4) (LRU) and (5, 6)
    assert mgr.allocator.num_free == 0
    lease = mgr.admit((1, 2, 3, 9, 9))  # (1, 2) whole, then (3) of the block (3, 4)
    assert lease.computed == 3 and lease.cached_tokens == 3 and len(lease.blocks) == 2
    assert mgr.allocator.refcount(lease.blocks[1]) == 1 and not mgr.tree.holds(lease.blocks[1])
    mgr.check()
    mgr.release(lease)
    mgr.release(holder)
    mgr.check()
    assert mgr.tree.pinned_blocks == 0 and mgr.tree.leaks() == []
