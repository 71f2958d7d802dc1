"""KV events in vLLM's layout from a real CacheManager to a real ZMQ subscriber on loopback: the
message layout (and vLLM's own msgspec struct shapes decoding it), whole blocks only, salts kept
apart, eviction, clear, start-up, the store's prefetch, a full queue that drops and recovers, and
every error path of the publisher."""

import socket
import time
from array import array

import msgspec
import pytest

from kv_event_subscriber import BlockSet, Subscriber, event_hash, tree_blocks
from radixcache import BlockAllocator, RadixCache
from radixcache.kv_events import BlockEventLog, EventTranslator, KVEventPublisher, open_publisher
from radixcache.lifecycle.manager import CacheManager
from radixcache.store.keys import block_digests, tree_namespace_digest

BS = 4
NS = ("model", None)
SALTED = ("model", "tenant-a")
LOOPBACK = "tcp://127.0.0.1:*"


def run(mgr, tokens, namespace=NS, keep=None):
    """One request that computes ``tokens`` and finishes (its partial last block kept as a tail)."""
    lease = mgr.admit(tokens, namespace)
    mgr.grow(lease, len(tokens))
    mgr.commit(lease, tokens, len(tokens))
    if keep:
        return lease
    mgr.release(lease, tokens)


@pytest.fixture
def wired():
    """A manager publishing to a real subscriber that has joined (it knows the state)."""
    mgr = CacheManager(24, BS)
    pub = KVEventPublisher(LOOPBACK)
    mgr.use_events(pub)
    sub = Subscriber(pub.endpoint, BS)
    sub.join(mgr.resync_events, pub.flush)
    yield mgr, pub, sub
    mgr.close()
    sub.close()


def settle(mgr, pub, sub):
    """Everything queued so far sent and received; the subscriber's view equals the tree."""
    assert pub.flush()
    sub.receive_until(pub.batches)
    with mgr.mutex:
        assert sub.blocks == tree_blocks(mgr.tree)
        assert len(sub.blocks) == mgr.tree.whole_blocks == sub.stored - sub.removed
    assert pub.stats()["kv_events_dropped"] == 0 and pub.errors == 0


def last_events(sub, skip=0):
    return [e for _, events in sub.batches[skip:] for e in events]


def test_blocks_stored_name_their_digest_chain_parent_and_tokens(wired):
    mgr, pub, sub = wired
    seen = len(sub.batches)
    prompt = list(range(1, 15))             # 3 whole blocks and a 2-token tail
    run(mgr, prompt)
    run(mgr, prompt[:8] + [99] * 8)         # shares 2 blocks, adds 2
    settle(mgr, pub, sub)
    stored = [e for e in last_events(sub, seen) if e[0] == "BlockStored"]
    ns = tree_namespace_digest(NS, BS)
    first = [event_hash(d) for d in block_digests(ns, prompt, BS, 3)]
    assert stored[0] == ["BlockStored", first, None, prompt[:12], BS, None, "GPU", None]
    second = [event_hash(d) for d in block_digests(ns, prompt[:8] + [99] * 8, BS, 4)]
    assert stored[1] == ["BlockStored", second[2:], first[1], [99] * 8, BS, None, "GPU", None]
    assert mgr.tree.whole_blocks == 5 and mgr.tree.cached_blocks == 6  # the tail is not counted
    seqs = [s for s, _ in sub.batches]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))


def test_vllm_struct_shapes_decode_every_message(wired):
    """vLLM's msgspec structs (array_like, tagged), as its current and an older release declare
    them, decode what we send: the fields vLLM requires are there, and extra trailing fields are
    what older decoders ignore."""
    mgr, pub, sub = wired
    run(mgr, list(range(1, 15)))
    mgr.tree.evict(2)                        # the tail, then the deepest whole block
    mgr.clear()
    settle(mgr, pub, sub)

    class Event(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
        pass

    class BlockStored(Event):
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list | None = None

    class BlockRemoved(Event):
        block_hashes: list[int]
        medium: str | None

    class AllBlocksCleared(Event):
        pass

    class Batch(msgspec.Struct, array_like=True, omit_defaults=True):
        ts: float
        events: list[BlockStored | BlockRemoved | AllBlocksCleared]
        data_parallel_rank: int | None = None

    class OldBlockStored(msgspec.Struct, array_like=True, tag="BlockStored"):
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None

    class OldBatch(msgspec.Struct, array_like=True):
        ts: float
        events: list[OldBlockStored | BlockRemoved | AllBlocksCleared]

    kinds = set()
    for payload in sub.payloads:
        batch = msgspec.msgpack.decode(payload, type=Batch)
        assert batch.data_parallel_rank == 0
        old = msgspec.msgpack.decode(payload, type=OldBatch)
        for new, older in zip(batch.events, old.events):
            kinds.add(type(new).__name__)
            if isinstance(new, BlockStored):
                assert new.medium == "GPU" and new.lora_id is None and new.block_size == BS
                assert older.block_hashes == new.block_hashes
                assert len(new.token_ids) == BS * len(new.block_hashes)
    assert kinds == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}


def test_partial_tails_never_appear_until_they_are_whole(wired):
    mgr, pub, sub = wired
    run(mgr, [5, 6, 7, 8, 9, 10])           # 1 whole block, a 2-token tail
    settle(mgr, pub, sub)
    assert len(sub.blocks) == 1 and mgr.tree.cached_blocks == 2
    run(mgr, [5, 6, 7, 8, 9, 10, 11, 12, 13])  # the tail's block is whole now
    settle(mgr, pub, sub)
    assert len(sub.blocks) == 2
    mgr.tree.evict(mgr.tree.evictable_blocks)  # the new tail [13] goes too: never named
    settle(mgr, pub, sub)
    assert sub.blocks == {} and sub.removed == 2


def test_salted_namespaces_stay_distinct(wired):
    mgr, pub, sub = wired
    prompt = list(range(1, 9))
    for namespace in (NS, SALTED, ("other-model", None)):
        run(mgr, prompt, namespace)
    settle(mgr, pub, sub)
    assert len(sub.blocks) == 6  # the same tokens, three chains
    roots = [h for h, (parent, _) in sub.blocks.items() if parent is None]
    assert len(roots) == 3


def test_eviction_trimming_a_leaf_removes_its_deepest_blocks(wired):
    mgr, pub, sub = wired
    prompt = list(range(1, 17))              # 4 whole blocks, one node
    run(mgr, prompt)
    settle(mgr, pub, sub)
    before = len(sub.batches)
    hashes = [event_hash(d) for d in block_digests(tree_namespace_digest(NS, BS), prompt, BS, 4)]
    assert mgr.tree.evict(1) == 1
    settle(mgr, pub, sub)
    assert last_events(sub, before) == [["BlockRemoved", [hashes[3]], "GPU"]]
    run(mgr, prompt[:12] + [50, 51, 52, 53])  # a child below the trimmed node
    settle(mgr, pub, sub)
    assert sub.blocks[last_events(sub, before)[-1][1][0]][0] == hashes[2]


def test_clear_announces_all_blocks_cleared_and_what_pinned_requests_keep(wired):
    mgr, pub, sub = wired
    run(mgr, list(range(100, 120)))
    lease = run(mgr, list(range(1, 11)), keep=True)  # pinned: 2 whole blocks stay through clear
    settle(mgr, pub, sub)
    cleared = sub.cleared
    before = len(sub.batches)
    mgr.clear()
    settle(mgr, pub, sub)
    events = last_events(sub, before)
    assert events[0] == ["AllBlocksCleared"] and sub.cleared == cleared + 1
    assert all(e[0] == "BlockStored" for e in events[1:]) and len(sub.blocks) == 2
    mgr.release(lease, list(range(1, 11)))
    mgr.clear()
    settle(mgr, pub, sub)
    assert sub.blocks == {}


def test_attaching_to_a_tree_that_holds_blocks_starts_with_the_whole_state():
    """Start-up (and any attach): AllBlocksCleared, then every whole block already cached."""
    tree = RadixCache(BlockAllocator(16), BS)
    blocks = tree.allocator.allocate(4)
    tree.insert(list(range(1, 14)), blocks[:3], NS, tail_block=blocks[3])  # 3 blocks and a tail
    tree.allocator.release(blocks)
    log = BlockEventLog()
    tree.set_event_log(log)
    view, translator = BlockSet(BS), EventTranslator("GPU")
    events = translator.translate(log.take())
    assert events[0] == ["AllBlocksCleared"] and events[1][0] == "BlockStored"
    view.apply(events)
    assert view.blocks == tree_blocks(tree) and len(view.blocks) == 3 and log.take() is None
    tree.set_event_log(None)
    tree.reset()
    assert log.take() is None  # detached: nothing more


def test_a_full_queue_drops_counts_and_resyncs_instead_of_blocking():
    tree = RadixCache(BlockAllocator(64), BS)
    log = BlockEventLog(max_records=4)
    tree.set_event_log(log)                  # record 1: the start-up snapshot

    def insert(start):
        blocks = tree.allocator.allocate(2)
        tree.insert(list(range(start, start + 2 * BS)), blocks, NS)
        tree.allocator.release(blocks)

    for i in range(8):                       # nobody drains: 3 fit, 5 are dropped
        insert(1000 * (i + 1))
    assert log.appended == 4 and log.dropped == 5 and log.lost
    view, translator = BlockSet(BS), EventTranslator("GPU")
    while (record := log.take()) is not None:
        view.apply(translator.translate(record))
    assert len(view.blocks) == 6 != tree.whole_blocks == 16
    insert(50_000)                           # the queue has room again: a resync replaces it
    assert not log.lost and log.resyncs == 2
    while (record := log.take()) is not None:
        view.apply(translator.translate(record))
    assert view.blocks == tree_blocks(tree) and len(view.blocks) == tree.whole_blocks == 18
    tree.set_event_log(None)


def test_prefetched_blocks_from_the_store_are_announced(redis_server):
    from store_blocks import fill, make_pool, open_store

    a_pool, b_pool = make_pool(), make_pool()
    a = CacheManager(a_pool.num_blocks, BS, pool=a_pool, store=open_store(redis_server.url, a_pool))
    b = CacheManager(b_pool.num_blocks, BS, pool=b_pool, store=open_store(redis_server.url, b_pool))
    pub = KVEventPublisher(LOOPBACK)
    b.use_events(pub)
    sub = Subscriber(pub.endpoint, BS)
    try:
        sub.join(b.resync_events, pub.flush)
        prompt = list(range(100, 100 + 5 * BS))
        lease = a.admit(prompt, NS)
        a.grow(lease, len(prompt))
        fill(a_pool, lease.blocks, 0)
        a.commit(lease, prompt, len(prompt))
        a.release(lease, prompt)
        deadline = time.monotonic() + 10
        while a.store.stats()["store_written_blocks"] < 5 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert b.prefetch(prompt + [1], NS) == 5 * BS
        settle(b, pub, sub)
        assert len(sub.blocks) == 5
    finally:
        a.close()
        b.close()
        sub.close()


def test_flush_close_and_stats():
    mgr = CacheManager(8, BS)
    pub = KVEventPublisher(LOOPBACK, topic="events", dp_rank=3, medium="CPU")
    mgr.use_events(pub)
    run(mgr, list(range(1, 9)))
    assert pub.flush()
    stats = mgr.stats()
    assert stats["kv_events_batches"] >= 1 and stats["kv_events_dropped"] == 0
    assert stats["kv_events_queued"] == 0
    port = int(pub.endpoint.rsplit(":", 1)[1])
    final = mgr.close()
    assert pub.closed and final["kv_events_batches"] == stats["kv_events_batches"]
    assert mgr.close() == final and pub.close() == pub.stats()  # idempotent
    run(mgr, list(range(1, 9)))              # the cache stays usable, unpublished
    assert mgr.stats()["kv_events_batches"] == final["kv_events_batches"]
    again = KVEventPublisher(f"tcp://127.0.0.1:{port}")  # the port was released
    again.close()


def test_bad_publishers_are_refused_with_a_reason():
    with pytest.raises(TypeError, match="endpoint"):
        KVEventPublisher("")
    with pytest.raises(TypeError, match="endpoint"):
        KVEventPublisher(5557)
    with pytest.raises(ValueError, match="cannot bind 'nonsense'"):
        KVEventPublisher("nonsense")
    with pytest.raises(TypeError, match="topic"):
        KVEventPublisher(LOOPBACK, topic=b"kv")
    with pytest.raises(TypeError, match="medium"):
        KVEventPublisher(LOOPBACK, medium=1)
    for option in ("dp_rank", "max_batch", "max_queue", "hwm"):
        with pytest.raises(ValueError, match=option):
            KVEventPublisher(LOOPBACK, **{option: -1})
    with pytest.raises(TypeError, match="KVEventPublisher"):
        CacheManager(4, BS).use_events("tcp://127.0.0.1:5557")
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    try:
        with pytest.raises(ValueError, match="cannot bind"):
            KVEventPublisher(f"tcp://127.0.0.1:{busy.getsockname()[1]}")
    finally:
        busy.close()
    with pytest.raises(TypeError, match="kv_events"):
        open_publisher(3)
    pub = open_publisher(LOOPBACK)
    assert open_publisher(pub) is pub and open_publisher(None) is None
    pub.close()
    with pytest.raises(ValueError, match="closed"):
        open_publisher(pub)


def test_one_log_follows_one_tree():
    log = BlockEventLog()
    first, second = RadixCache(BlockAllocator(4), BS), RadixCache(BlockAllocator(4), BS)
    first.set_event_log(log)
    with pytest.raises(ValueError, match="another tree"):
        second.set_event_log(log)
    assert second.body.events is None and first.body.events is log
    first.set_event_log(log)                 # the same log again: a resync, still attached
    assert first.body.events is log and log.resyncs == 2
    first.set_event_log(None)
    second.set_event_log(log)                # free again once detached
    second.set_event_log(None)
    log.close()
    with pytest.raises(ValueError, match="closed"):
        first.set_event_log(log)
    with pytest.raises(ValueError, match="max_records"):
        BlockEventLog(0)


def test_a_record_the_publisher_cannot_apply_is_counted_and_resynced(wired):
    """A record naming a parent with no digest (the view and the tree disagree) is counted in
    ``kv_events_errors``; the next change republishes the whole state, and the subscriber is exact
    again."""
    mgr, pub, sub = wired
    run(mgr, list(range(1, 9)))
    settle(mgr, pub, sub)
    log = pub.log
    with mgr.mutex:  # as if the tree had logged a child below a block nobody announced
        log.records.append((0, array("I", [20]).tobytes(), None, bytes(4 * BS),
                            array("I", [21]).tobytes()))
        log.appended += 1
    assert pub.flush() and pub.errors == 1 and log.lost
    run(mgr, list(range(50, 58)))            # the next change resyncs
    pub.errors = 0                           # (settle insists on none)
    settle(mgr, pub, sub)
    assert len(sub.blocks) == 4


def test_the_translator_refuses_records_it_cannot_read():
    translator = EventTranslator("GPU")
    with pytest.raises(ValueError, match="unknown"):
        translator.translate((9,))
    translator.translate((2, 8, BS, []))     # a snapshot of an empty tree
    with pytest.raises(ValueError, match="2 block ids for 1 whole blocks"):
        translator.translate((0, None, NS, bytes(4 * BS), bytes(8)))
