"""KV events through ``radixcache.wrap(model, kv_events=...)``: a tiny model's ``generate`` and
``generate_batch`` publish their whole blocks to a real subscriber, ``invalidate`` and ``clear``
announce AllBlocksCleared, ``close`` unbinds, and a bad ``kv_events`` is refused."""

import pytest
import torch

import radixcache
from kv_event_subscriber import Subscriber, tree_blocks
from radixcache.kv_events import KVEventPublisher
from tiny_models import random_ids, tiny_model

BS = 4


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def settled(lm, pub, sub):
    assert pub.flush()
    sub.receive_until(pub.batches)
    with lm.manager.mutex:
        assert sub.blocks == tree_blocks(lm.cache)
        assert len(sub.blocks) == lm.cache.whole_blocks


def test_generate_publishes_the_blocks_it_caches(model):
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=512, kv_events="tcp://127.0.0.1:*")
    pub = lm.manager.events
    assert isinstance(pub, KVEventPublisher)
    sub = Subscriber(pub.endpoint, BS)
    try:
        sub.join(lm.manager.resync_events, pub.flush)
        prompt = random_ids(22, seed=1)
        out = lm.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=5,
                          do_sample=False)
        settled(lm, pub, sub)
        assert len(sub.blocks) == (22 + 5 - 1) // BS  # the last token has no K/V yet
        lm.generate_batch([out[0].tolist() + [7, 8]], max_new_tokens=3, cache_salt="tenant")
        settled(lm, pub, sub)
        salted = [h for h, (parent, _) in sub.blocks.items() if parent is None]
        assert len(salted) == 2  # one chain per namespace
        cleared = sub.cleared
        lm.invalidate()
        settled(lm, pub, sub)
        assert sub.cleared == cleared + 1 and sub.blocks == {}
        lm.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=2,
                    do_sample=False)
        settled(lm, pub, sub)
        assert sub.blocks  # the new identity chains from another namespace digest
        final = lm.close()
        assert pub.closed and final["kv_events_batches"] == sub.last_seq + 1
        assert lm.stats()["kv_events_dropped"] == 0
    finally:
        lm.close()
        sub.close()


def test_a_publisher_object_and_bad_values(model):
    pub = KVEventPublisher("tcp://127.0.0.1:*", topic="replica-1")
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=256, kv_events=pub)
    assert lm.manager.events is pub
    lm.close()
    assert pub.closed
    with pytest.raises(ValueError, match="closed"):
        radixcache.wrap(model, block_size=BS, max_cache_tokens=256, kv_events=pub)
    with pytest.raises(TypeError, match="kv_events"):
        radixcache.wrap(model, block_size=BS, max_cache_tokens=256, kv_events=5557)
    with pytest.raises(ValueError, match="not a loopback address"):  # another transport: a network one
        radixcache.wrap(model, block_size=BS, max_cache_tokens=256, kv_events="udp://x")
    with pytest.raises(ValueError, match="cannot bind"):
        radixcache.wrap(model, block_size=BS, max_cache_tokens=256, kv_events="tcp://127.0.0.1:notaport")
