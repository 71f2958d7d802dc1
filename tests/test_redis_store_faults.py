"""Store faults, each against a real redis-server: none raises into the caller, none yields a wrong block.

Every call below is made plainly: an exception escaping the store fails the test.
"""

import threading
import time

from redis_servers import start
from store_blocks import NS, fill, make_pool, open_store, same_block, tokens

from radixcache.integrations.redis_store import pool_format
from radixcache.integrations.redis_store.local import free_port
from radixcache.store import BlockKV
from radixcache.store.keys import block_digests, namespace_digest
from radixcache.store.values import encode_value, value_size


def stored(server, blocks=4, seed=0, **options):
    """A pool with ``blocks`` filled blocks, written to ``server``; returns (pool, store still open)."""
    pool = make_pool()
    fill(pool, range(blocks), seed)
    store = open_store(server.url, pool, **options)
    assert store.offer(NS, tokens(blocks), 0, list(range(blocks)), pool) == blocks
    deadline = time.monotonic() + 30
    while store.stats()["store_written_blocks"] < blocks and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store.stats()["store_written_blocks"] == blocks
    return pool, store


def keys_in_chain_order(store, n):
    digests = block_digests(namespace_digest(store.format, NS), tokens(n), store.block_size, n)
    return [store.key(d) for d in digests]


def until(condition, seconds=10.0):
    """Poll ``condition`` (bounded in time); returns its last value."""
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def warnings(caplog):
    """The store's warnings, without the start-up note that a store without a secret trusts its Redis."""
    return [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "trusts" not in r.getMessage()]


def test_unreachable_at_start_warns_once_and_runs_without_it(caplog):
    pool = make_pool()
    fill(pool, [0, 1])
    store = open_store(f"redis://127.0.0.1:{free_port()}/0", pool)
    for _ in range(3):
        assert store.fetch(NS, tokens(2), 0, 2) == []
        assert store.offer(NS, tokens(2), 0, [0, 1], pool) == 0
        time.sleep(0.06)  # past the backoff: the next call tries again
    stats = store.close(timeout=1)
    assert stats["store_miss_blocks"] == 6 and stats["store_dropped_blocks"] == 6
    assert stats["store_errors"] >= 2 and stats["store_hit_tokens"] == 0
    found = warnings(caplog)
    assert len(found) == 1 and "running without it" in found[0]


def test_server_killed_mid_run_then_back(tmp_path, caplog):
    server = start(tmp_path / "r")
    try:
        pool, store = stored(server, blocks=3)
        server.kill()
        assert store.fetch(NS, tokens(3), 0, 3) == []
        assert store.offer(NS, tokens(3), 0, [0, 1, 2], pool) in (0, 3)  # dropped now or by the writer
        assert until(lambda: store.stats()["store_dropped_blocks"] == 3)
        server = start(tmp_path / "r", port=server.port)  # back, empty (no persistence)
        assert until(lambda: store.offer(NS, tokens(3), 0, [0, 1, 2], pool) == 3)
        assert until(lambda: store.stats()["store_written_blocks"] == 6)
        got = store.fetch(NS, tokens(3), 0, 3)
        assert len(got) == 3
        target = make_pool()
        target.import_block(0, got[2])
        assert same_block(pool, 2, target, 0)
        stats = store.close()
        assert stats["store_errors"] >= 1 and stats["store_hit_tokens"] == 3 * store.block_size
        assert len(warnings(caplog)) == 1
    finally:
        server.stop()


def test_slow_server_times_out_as_a_miss(redis_server):
    pool, store = stored(redis_server, blocks=2, timeout=0.2)
    slow = threading.Thread(
        target=lambda: redis_server.client().execute_command("DEBUG", "SLEEP", "1.5"))
    slow.start()
    try:
        time.sleep(0.1)  # the server is asleep now
        assert store.fetch(NS, tokens(2), 0, 2) == []
        answered_while_asleep = slow.is_alive()  # bounded by the socket timeout, not the sleep
        store.offer(NS, tokens(2), 0, [0, 1], pool)  # dropped at once (breaker open) or timed out
    finally:
        slow.join()
    assert answered_while_asleep
    stats = store.stats()
    assert stats["store_errors"] >= 1 and stats["store_miss_blocks"] == 2
    assert until(lambda: len(store.fetch(NS, tokens(2), 0, 2)) == 2)  # awake again: hits
    store.close()


def test_corrupted_truncated_and_mistyped_values_are_misses_and_deleted(redis_server):
    pool, store = stored(redis_server, blocks=4)
    keys = keys_in_chain_order(store, 4)
    raw = redis_server.client()
    value = bytearray(raw.get(keys[2]))
    value[len(value) // 2] ^= 0x40
    raw.set(keys[2], bytes(value))
    got = store.fetch(NS, tokens(4), 0, 4)
    assert len(got) == 2  # blocks before the bad one still serve
    assert raw.exists(keys[2]) == 0 and raw.exists(keys[3]) == 1
    raw.set(keys[1], raw.get(keys[1])[:-100])
    assert len(store.fetch(NS, tokens(4), 0, 4)) == 1
    assert raw.exists(keys[1]) == 0
    raw.set(keys[0], b"")
    assert store.fetch(NS, tokens(4), 0, 4) == []
    assert raw.exists(keys[0]) == 0
    raw.lpush(keys[0], b"not a string")  # WRONGTYPE for GET
    assert store.fetch(NS, tokens(4), 0, 4) == []
    assert raw.exists(keys[0]) == 0
    stats = store.close()
    assert stats["store_bad_values"] == 4 and stats["store_errors"] == 0
    assert stats["store_hit_tokens"] == (2 + 1) * store.block_size


def test_values_of_another_model_tenant_or_block_size_under_our_key_are_misses(redis_server):
    pool, store = stored(redis_server, blocks=1)
    (key,) = keys_in_chain_order(store, 1)
    ours = store.format
    raw = redis_server.client()
    kv = pool.export_block(0)
    foreign = []
    for fmt, ns in [(ours._replace(model="another-model"), NS), (ours, (NS[0], "tenant-b"))]:
        nsd = namespace_digest(fmt, ns)
        digest = block_digests(nsd, tokens(1), fmt.block_size, 1)[0]
        foreign.append(encode_value(fmt, nsd, digest, tokens(1), kv))
    small = make_pool(block_size=2)
    fill(small, [0])
    fmt2 = pool_format(small, "tiny-model")
    nsd = namespace_digest(fmt2, NS)
    foreign.append(encode_value(fmt2, nsd, block_digests(nsd, tokens(1, 2), 2, 1)[0], tokens(1, 2),
                                small.export_block(0)))
    other_tokens = [t + 1 for t in tokens(1)]
    nsd = namespace_digest(ours, NS)
    foreign.append(encode_value(ours, nsd, block_digests(nsd, other_tokens, ours.block_size, 1)[0],
                                other_tokens, kv))  # another block's value under this block's key
    for value in foreign:
        raw.set(key, value)
        assert store.fetch(NS, tokens(1), 0, 1) == []
        assert raw.exists(key) == 0
    assert store.close()["store_bad_values"] == len(foreign)


def test_full_store_refuses_writes_softly(redis_server):
    pool, store = stored(redis_server, blocks=2)
    raw = redis_server.client()
    used = raw.info("memory")["used_memory"]
    raw.config_set("maxmemory-policy", "noeviction")
    raw.config_set("maxmemory", used + 4 * store.value_bytes)
    fill(pool, range(16), seed=5)
    seq = tokens(16, start=5000)
    for first in range(0, 16, 4):
        store.offer(NS, seq, first, list(range(first, first + 4)), pool)
    stats = store.close(timeout=30)
    assert stats["store_written_blocks"] < 2 + 16
    assert stats["store_dropped_blocks"] >= 1 and stats["store_errors"] >= 1
    assert stats["store_written_blocks"] + stats["store_dropped_blocks"] == 2 + 16
    reader = open_store(redis_server.url, pool)
    assert len(reader.fetch(NS, tokens(2), 0, 2)) == 2  # reads still work on a full store
    reader.close()


def test_a_full_queue_drops_and_counts(redis_server):
    pool = make_pool()
    fill(pool, range(10))
    store = open_store(redis_server.url, pool, timeout=5.0, max_queue_bytes=1)
    assert store.offer(NS, tokens(10), 0, list(range(10)), pool) == 0
    assert store.close()["store_dropped_blocks"] == 10
    room = 3 * value_size(pool_format(pool, "tiny-model"))
    small = open_store(redis_server.url, pool, timeout=5.0, max_queue_bytes=room)
    sleeper = threading.Thread(
        target=lambda: redis_server.client().execute_command("DEBUG", "SLEEP", "0.5"))
    sleeper.start()
    try:
        time.sleep(0.05)
        accepted = [small.offer(NS, tokens(10), i, [i], pool) for i in range(10)]
    finally:
        sleeper.join()
    stats = small.close(timeout=30)
    assert 3 <= sum(accepted) <= 4  # room for three (a batch in flight keeps its room), plus
    # one more only if the writer finished a batch before the server fell asleep
    assert stats["store_dropped_blocks"] == 10 - sum(accepted)
    assert stats["store_written_blocks"] == sum(accepted)


def test_close_with_a_stuck_server_reports_what_was_dropped(redis_server):
    pool = make_pool()
    fill(pool, range(4))
    store = open_store(redis_server.url, pool, timeout=5.0)
    sleeper = threading.Thread(
        target=lambda: redis_server.client().execute_command("DEBUG", "SLEEP", "1"))
    sleeper.start()
    try:
        time.sleep(0.05)
        assert store.offer(NS, tokens(4), 0, [0, 1, 2, 3], pool) == 4
        report = store.close(timeout=0.1)
    finally:
        sleeper.join()
    assert report["store_dropped_blocks"] == 4 and report["store_written_blocks"] == 0
    time.sleep(0.3)  # the writer finishes its batch after close: the report stays what it said
    assert store.stats() == report


class BrokenPool:
    """A block source whose snapshots are malformed: encoding them fails on the writer thread."""

    def export_block(self, block):
        return BlockKV(b"short", "float32", (1,), ())


def test_the_writer_outlives_a_batch_that_fails(redis_server):
    pool = make_pool()
    fill(pool, [0])
    store = open_store(redis_server.url, pool)
    assert store.offer(NS, tokens(1), 0, [0], BrokenPool()) == 1
    assert until(lambda: store.stats()["store_dropped_blocks"] == 1)
    assert store.offer(NS, tokens(1), 0, [0], pool) == 1
    assert until(lambda: store.stats()["store_written_blocks"] == 1)
    stats = store.close()
    assert stats["store_errors"] == 1 and store.writer.queued_bytes == 0
