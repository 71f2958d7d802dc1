"""RedisStore against a real redis-server: round trips, chain order, isolation, URLs, TLS, Cluster."""

import hashlib
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import redis
from redis_servers import redis_binary
from store_blocks import BS, NS, contents, fill, make_pool, open_store, same_block, tokens

from radixcache.integrations.redis_store import DEFAULT_QUEUE_BYTES, RedisStore, pool_format
from radixcache.integrations.redis_store.local import INSTALL_COMMAND, find_binary
from radixcache.store import STORE_COUNTERS, BlockStore

ROOT = Path(__file__).resolve().parent.parent


def written(server, url=None, pool=None, blocks=4, seed=0, ns=NS, **options):
    """Offer ``blocks`` blocks of ``tokens(blocks)`` through a store that is then closed."""
    pool = pool or make_pool()
    fill(pool, range(blocks), seed)
    store = open_store(url or server.url, pool, **options)
    assert store.offer(ns, tokens(blocks), 0, list(range(blocks)), pool) == blocks
    return pool, store.close()


def test_round_trip_between_two_stores(redis_server):
    source, report = written(redis_server, blocks=4)
    assert report["store_written_blocks"] == 4 and report["store_dropped_blocks"] == 0
    reader = open_store(redis_server.url, make_pool())
    assert isinstance(reader, BlockStore)
    got = reader.fetch(NS, tokens(4) + [7], 0, 10)
    assert len(got) == 4
    target = make_pool()
    for i, kv in enumerate(got):
        target.import_block(10 + i, kv)
        assert same_block(source, i, target, 10 + i)
    stats = reader.close()
    assert set(STORE_COUNTERS) <= set(stats)
    assert stats["store_hit_tokens"] == 4 * BS and stats["store_miss_blocks"] == 0
    assert stats["store_bytes_read"] == 4 * reader.value_bytes == report["store_bytes_written"]
    assert redis_server.client().dbsize() == 4


def test_fetch_is_in_chain_order_and_stops_at_the_first_miss(redis_server):
    pool = make_pool()
    fill(pool, range(6))
    store = open_store(redis_server.url, pool)
    seq = tokens(6)
    store.offer(NS, seq, 0, [0, 1], pool)
    store.offer(NS, seq, 3, [3, 4, 5], pool)  # block 2 is missing
    store.close()
    reader = open_store(redis_server.url, pool)
    assert len(reader.fetch(NS, seq, 0, 6)) == 2
    got = reader.fetch(NS, seq, 3, 2)
    target = make_pool()
    target.import_block(0, got[0])
    assert len(got) == 2 and same_block(pool, 3, target, 0)
    assert reader.fetch(NS, seq[:-1], 3, 10) == reader.fetch(NS, seq, 3, 2)[:2]  # only whole blocks
    assert reader.fetch(NS, seq, 6, 5) == [] and reader.fetch(NS, seq, 0, 0) == []
    assert reader.fetch(NS, [9] + seq[1:], 0, 6) == []  # another first token: another chain
    stats = reader.close()
    assert stats["store_miss_blocks"] == 4 + 0 + 0 + 6  # reads past the tokens are never asked


def test_offer_skips_blocks_the_store_already_holds(redis_server):
    pool, _ = written(redis_server, blocks=3)
    again = open_store(redis_server.url, pool)
    assert again.offer(NS, tokens(3), 0, [0, 1, 2], pool) == 3
    stats = again.close()
    assert stats["store_present_blocks"] == 3 and stats["store_written_blocks"] == 0
    assert stats["store_bytes_written"] == 0


def test_other_models_tenants_dtypes_and_block_sizes_never_hit(redis_server):
    pool, _ = written(redis_server, blocks=4)
    seq = tokens(4)
    cases = [(open_store(redis_server.url, pool, model="another-model"), NS),
             (open_store(redis_server.url, pool), (NS[0], "tenant-b")),
             (open_store(redis_server.url, make_pool(kv_dtype="bf16")), NS),
             (open_store(redis_server.url, make_pool(block_size=2)), NS),
             (open_store(redis_server.url, pool, prefix="other:"), NS)]
    for store, ns in cases:
        assert store.fetch(ns, seq, 0, 8) == []
        assert store.close()["store_bad_values"] == 0  # a plain miss: another key, not a bad value
    assert redis_server.client().dbsize() == 4


def test_url_options_ttl_prefix_and_db(redis_server):
    url = redis_server.url.replace("/0", "/3") + "?ttl=60&prefix=rc-test:"
    pool, report = written(redis_server, url=url, blocks=2)
    assert report["store_written_blocks"] == 2
    db3 = redis_server.client(db=3)
    keys = db3.keys()
    assert len(keys) == 2 and all(k.startswith(b"rc-test:") for k in keys)
    assert redis_server.client().dbsize() == 0
    assert all(0 < db3.pttl(k) <= 60_000 for k in keys)
    for k in keys:
        db3.pexpire(k, 5_000)
    reader = open_store(url, pool)
    assert len(reader.fetch(NS, tokens(2), 0, 2)) == 2
    assert all(db3.pttl(k) > 5_000 for k in keys)  # a read refreshes the TTL (GETEX)
    reader.close()
    with pytest.raises(ValueError, match="ttl"):
        open_store(redis_server.url + "?ttl=0", pool)
    with pytest.raises(ValueError, match="redis://"):
        RedisStore("http://127.0.0.1:1", pool_format(pool, "m"))
    with pytest.raises(ValueError, match="socket_timeout"):
        open_store(redis_server.url + "?socket_timeout=soon", pool)


def test_password_in_the_url_and_acl_users(redis_auth_server, caplog):
    server = redis_auth_server
    pool, report = written(server, blocks=2)
    assert report["store_written_blocks"] == 2
    admin = server.client()
    admin.acl_setuser("alice", enabled=True, passwords=["+alice-pw"], keys=["*"], commands=["+@all"])
    alice = f"redis://alice:alice-pw@127.0.0.1:{server.port}/0"
    reader = open_store(alice, pool)
    assert len(reader.fetch(NS, tokens(2), 0, 2)) == 2
    reader.close()
    for url in (f"redis://127.0.0.1:{server.port}/0", f"redis://:wrong@127.0.0.1:{server.port}/0",
                f"redis://alice:wrong@127.0.0.1:{server.port}/0"):
        caplog.clear()
        denied = open_store(url, pool)
        assert denied.fetch(NS, tokens(2), 0, 2) == []
        assert denied.close()["store_errors"] >= 1
        warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert "wrong" not in " ".join(warnings)  # the password never reaches a log
        warnings = [w for w in warnings if "trusts" not in w]  # the note of a store without a secret
        assert len(warnings) == 1 and "running without it" in warnings[0]


def test_tls_rediss_url(redis_servers, tmp_path):
    import trustme  # in [dev]: a missing one fails, never skips

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    paths = {name: str(tmp_path / f"{name}.pem") for name in ("ca", "cert", "key")}
    ca.cert_pem.write_to_path(paths["ca"])
    cert.cert_chain_pems[0].write_to_path(paths["cert"])
    cert.private_key_pem.write_to_path(paths["key"])
    server = redis_servers(tls=paths)
    url = f"rediss://127.0.0.1:{server.port}/0?ssl_ca_certs={paths['ca']}"
    assert url.startswith("rediss://")
    pool, report = written(server, url=url, blocks=2)
    assert report["store_written_blocks"] == 2
    reader = open_store(url, pool)
    assert len(reader.fetch(NS, tokens(2), 0, 2)) == 2
    reader.close()
    untrusted = open_store(f"rediss://127.0.0.1:{server.port}/0", pool)  # no CA: refused, no raise
    assert untrusted.fetch(NS, tokens(2), 0, 2) == []
    assert untrusted.close()["store_errors"] >= 1


def test_redis_cluster_reads_a_chain_spread_over_nodes(redis_cluster):
    nodes = redis_cluster
    url = nodes[0].url
    pool = make_pool()
    fill(pool, range(12))
    seq = tokens(12)
    store = open_store(url, pool)
    assert store.offer(NS, seq, 0, list(range(12)), pool) == 12
    assert store.close()["store_written_blocks"] == 12
    holders = [n.client().dbsize() for n in nodes]
    assert sum(holders) == 12 and sum(1 for h in holders if h) >= 2  # no hash tag pins a chain
    reader = open_store(nodes[2].url, pool)
    got = reader.fetch(NS, seq, 0, 12)
    assert len(got) == 12
    target = make_pool()
    for i, kv in enumerate(got):
        target.import_block(i, kv)
        assert same_block(pool, i, target, i)
    assert reader.close()["store_errors"] == 0
    owner = next(n for n in nodes if n.client().dbsize())
    keys = owner.client().keys()
    other = next(k for n in nodes if n is not owner for k in n.client().keys())
    with pytest.raises(redis.ResponseError, match="same slot"):
        owner.client().mget(keys[0], other)  # CROSSSLOT: why reads are pipelined GETs, not MGET


def test_a_second_process_reads_what_the_first_wrote(redis_server):
    pool, _ = written(redis_server, blocks=5, seed=3)
    want = [hashlib.sha256(bytes(memoryview(pool.export_block(i).data).cast("B"))).hexdigest()
            for i in range(5)]
    script = (
        "import hashlib, sys; sys.path.insert(0, 'tests');"
        "from store_blocks import NS, make_pool, open_store, tokens;"
        f"s = open_store({redis_server.url!r}, make_pool());"
        "got = s.fetch(NS, tokens(5), 0, 5); s.close();"
        "print(' '.join(hashlib.sha256(bytes(kv.data)).hexdigest() for kv in got))")
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == want


def test_a_snapshot_is_taken_at_offer_so_block_reuse_never_sends_wrong_kv(redis_server):
    pool = make_pool()
    fill(pool, [0, 1], seed=1)
    original = make_pool()
    for b in (0, 1):
        original.import_block(b, pool.export_block(b))
    store = open_store(redis_server.url, pool, timeout=5.0)
    sleeper = threading.Thread(target=lambda: redis_server.client().execute_command("DEBUG", "SLEEP", "0.5"))
    sleeper.start()
    try:
        assert store.offer(NS, tokens(2), 0, [0, 1], pool) == 2
        fill(pool, [0, 1], seed=2)  # evicted and reused while the writer waits on the server
    finally:
        sleeper.join()
    assert store.close()["store_written_blocks"] == 2
    reader = open_store(redis_server.url, pool)
    target = make_pool()
    for i, kv in enumerate(reader.fetch(NS, tokens(2), 0, 2)):
        target.import_block(i, kv)
        assert same_block(original, i, target, i) and not same_block(pool, i, target, i)
    reader.close()


def test_close_waits_for_every_queued_write_and_stats_stay_readable(redis_server):
    pool = make_pool()
    fill(pool, range(16))
    store = open_store(redis_server.url, pool)
    assert store.writer.max_bytes == DEFAULT_QUEUE_BYTES >= 256 << 20
    seq = tokens(16)
    for start in range(0, 16, 2):
        store.offer(NS, seq, start, [start, start + 1], pool)
    report = store.close(timeout=30)
    assert report["store_written_blocks"] == 16 and report["store_dropped_blocks"] == 0
    assert store.close() == report == store.stats()
    assert store.fetch(NS, seq, 0, 16) == []  # closed: nothing is read any more, nothing raises
    assert store.offer(NS, seq, 0, [0], pool) == 0
    assert redis_server.client().dbsize() == 16


def test_bad_arguments_raise_at_once(redis_server):
    pool = make_pool()
    store = open_store(redis_server.url, pool)
    with pytest.raises(ValueError, match="start"):
        store.fetch(NS, tokens(2), -1, 1)
    with pytest.raises(ValueError, match="count"):
        store.fetch(NS, tokens(2), 0, -1)
    with pytest.raises(TypeError, match="namespace"):
        store.fetch(["not", "a tuple"], tokens(2), 0, 1)
    with pytest.raises(ValueError, match="token ids"):
        store.fetch(NS, [-5] * BS, 0, 1)
    with pytest.raises(ValueError, match="need"):
        store.offer(NS, tokens(1), 0, [0, 1], pool)
    with pytest.raises(ValueError, match="block must be"):
        store.offer(NS, tokens(1), 0, [99], pool)
    assert store.writer.queued_bytes == 0
    with pytest.raises(TypeError, match="URL"):
        open_store(None, pool)
    store.close()


def test_a_missing_redis_server_is_named_with_its_install_command(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(RuntimeError, match="apt-get update && apt-get install -y redis-server"):
        find_binary()
    with pytest.raises(pytest.fail.Exception, match=INSTALL_COMMAND.replace("&", "[&]")):
        redis_binary()
    makefile = (ROOT / "Makefile").read_text()
    assert "command -v redis-server" in makefile and "apt-get install -y redis-server" in makefile
    assert "apt-get install -y redis-server" in (ROOT / ".ci" / "run").read_text()


def test_url_parsing_takes_out_our_options_and_redacts_passwords():
    from radixcache.integrations.redis_store.connection import Breaker, redact, split_url

    url, own = split_url("rediss://alice:pw@h:6380/2?ttl=60&ssl_ca_certs=/ca.pem&prefix=p:")
    assert url == "rediss://alice:pw@h:6380/2?ssl_ca_certs=/ca.pem" and own == {"ttl": "60", "prefix": "p:"}
    assert redact("redis://alice:pw@h:6380/2") == "redis://alice:***@h:6380/2"
    assert redact("redis://:pw@h/0") == "redis://:***@h/0" and redact("redis://h/0") == "redis://h/0"
    now = [0.0]
    breaker = Breaker(1.0, 4.0, clock=lambda: now[0])
    assert breaker.ready() and breaker.failed() and not breaker.ready()
    now[0] = 1.0
    assert breaker.ready() and not breaker.failed() and breaker.backoff == 2.0
    breaker.failed()
    breaker.failed()
    assert breaker.backoff == 4.0 and breaker.succeeded() and breaker.ready() and not breaker.succeeded()


def test_fp8_blocks_carry_their_scales_through_the_store(redis_server):
    import torch

    source = make_pool(kv_dtype="fp8")
    fill(source, range(2), seed=1)
    _, report = written(redis_server, pool=source, blocks=2, seed=1)
    assert report["store_written_blocks"] == 2
    fresh, calibrated = make_pool(kv_dtype="fp8"), make_pool(kv_dtype="fp8")
    fill(calibrated, [9], seed=7)  # its scales were set by other K/V
    for target in (fresh, calibrated):
        reader = open_store(redis_server.url, target)
        got = reader.fetch(NS, tokens(2), 0, 2)
        reader.close()
        for i, kv in enumerate(got):
            target.import_block(i, kv)
    assert same_block(source, 0, fresh, 0) and same_block(source, 1, fresh, 1)  # adopted: exact
    for i in range(2):
        for want, got in zip(contents(source, i), contents(calibrated, i)):
            assert torch.allclose(got, want, rtol=0.15, atol=0.05)  # rescaled: within fp8 precision
