"""CacheManager with a shared store: committed blocks are offered, prefetch loads what follows the
local match, against a real redis-server (two managers with their own pools stand for two processes;
the two-process test through ``generate`` is in test_store_processes.py)."""

import time

from radixcache.lifecycle.manager import CacheManager
from store_blocks import BS, NS, fill, make_pool, open_store, same_block, tokens


def wait_written(store, n, timeout=10.0):
    deadline = time.monotonic() + timeout
    while store.stats()["store_written_blocks"] < n and time.monotonic() < deadline:
        time.sleep(0.02)
    return store.stats()["store_written_blocks"]


def computed_request(mgr, toks, seed=0):
    """A request that 'computes' toks (random K/V written into its own blocks) and finishes."""
    lease = mgr.admit(toks, NS)
    mgr.grow(lease, len(toks))
    fill(mgr.pool, lease.blocks[lease.committed:], seed)
    mgr.commit(lease, toks, len(toks))
    mgr.release(lease, toks)


def manager(url):
    pool = make_pool()
    return CacheManager(pool.num_blocks, BS, pool=pool, store=open_store(url, pool))


def test_committed_blocks_reach_another_manager_through_prefetch(redis_server):
    a, b = manager(redis_server.url), manager(redis_server.url)
    prompt = tokens(5)                         # 5 whole blocks
    computed_request(a, prompt)
    assert wait_written(a.store, 5) == 5
    ask = prompt + [7, 7, 7]
    loaded = b.prefetch(ask, NS)
    assert loaded == 5 * BS
    lease = b.admit(ask, NS)
    assert lease.cached_tokens == 5 * BS       # the admit after a prefetch matches it all locally
    for i in range(5):
        assert same_block(a.pool, a.tree.match(prompt, NS).blocks[i], b.pool, lease.blocks[i])
    b.release(lease)
    s = b.stats()
    assert s["store_hit_tokens"] == 5 * BS and s["hit_tokens"] == 5 * BS
    assert b.prefetch(ask, NS) == 0            # all of it is local now: nothing to fetch
    assert a.close()["store_written_blocks"] == 5
    b.close()
    b.check()
    a.check()


def test_prefetched_blocks_are_not_offered_back_and_new_ones_are(redis_server):
    a, b = manager(redis_server.url), manager(redis_server.url)
    prompt = tokens(3)
    computed_request(a, prompt)
    wait_written(a.store, 3)
    b.prefetch(prompt + [1], NS)
    longer = prompt + tokens(2, start=500)
    computed_request(b, longer, seed=1)
    assert wait_written(b.store, 2) == 2       # only its own two blocks went to the store
    assert b.close()["store_written_blocks"] == 2
    a.close()


def test_prefetch_loads_nothing_when_the_store_is_down(redis_server):
    b = manager(redis_server.url)
    redis_server.kill()
    assert b.prefetch(tokens(4) + [1], NS) == 0
    lease = b.admit(tokens(4) + [1], NS)
    assert lease.cached_tokens == 0
    b.release(lease)
    assert b.stats()["store_errors"] >= 1
    b.close()
    assert b.stats()["store_errors"] >= 1     # readable after close


def test_prefetch_takes_no_more_blocks_than_the_pool_can_free(redis_server):
    a = manager(redis_server.url)
    prompt = tokens(12)
    computed_request(a, prompt)
    assert wait_written(a.store, 12) == 12
    pool = make_pool()
    small = CacheManager(6, BS, pool=pool, store=open_store(redis_server.url, pool))
    hog = small.admit([9, 9], NS)
    small.grow(hog, 2 * BS)                    # 2 of 6 blocks held by a running request
    assert small.prefetch(prompt + [1], NS) == 4 * BS
    small.release(hog)
    small.check()
    small.close()
    a.close()
