"""Issue 33 item 2: a shared tier nobody can poison. With a secret, every stored block carries a
keyed BLAKE3 MAC: a writer with access to Redis but not to the secret can put valid-looking values
under the very keys a replica reads, and they are misses, counted, deleted, never a token."""

import pytest
import torch

import radixcache
from radixcache.integrations.redis_store import pool_format
from radixcache.store import BlockKV
from radixcache.store.keys import block_digests, namespace_digest
from radixcache.store.values import BadValue, Unauthenticated, decode_value, encode_value, mac_key
from tiny_models import random_ids, tiny_model

BS = 4
PROMPT = random_ids(41, 5)[0].tolist()  # 10 whole blocks of 4 in tokens[:-1]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def plain(model, prompt, new=5):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False)
    return out[0, len(prompt):].tolist()


def run(lm, prompt, new=5):
    out = lm.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), out.cached_tokens[0]


def with_secret(url: str, path) -> str:
    return f"{url}?secret_file={path}"


def forge(client, lm, prompt, key: bytes | None) -> int:
    """Write a value for every whole block of ``prompt`` under the keys ``lm``'s sealed store reads,
    made as its own replicas make them but with K/V of a forger's choosing (large, so a value used
    would change the tokens), sealed with ``key`` (None: a checksum). Returns how many."""
    fmt = pool_format(lm.pool, model=lm.model_id)
    ns = namespace_digest(fmt, lm.namespace(None), sealed=True)
    n = (len(prompt) - 1) // BS
    digests = block_digests(ns, prompt, BS, n)
    gen = torch.Generator().manual_seed(7)
    for i in range(n):
        data = (torch.randn(fmt.shape, generator=gen) * 50).to(getattr(torch, fmt.kv_dtype)).numpy().tobytes()
        kv = BlockKV(data, fmt.kv_dtype, fmt.shape, ())
        client.set(b"radixcache:" + digests[i].hex().encode(),
                   encode_value(fmt, ns, digests[i], prompt[i * BS:(i + 1) * BS], kv, key))
    return n


@pytest.mark.parametrize("forger_key", [None, b"a guess at the secret"])
def test_blocks_forged_under_real_keys_are_misses_never_tokens(model, redis_server, tmp_path, forger_key):
    secret = tmp_path / "secret"
    secret.write_bytes(b"the replicas' shared secret\n")
    url = with_secret(redis_server.url, secret)
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=512, store=url)
    client = redis_server.client()
    forged = forge(client, lm, PROMPT, mac_key(forger_key) if forger_key else None)
    assert forged == 10 and len(client.keys("radixcache:*")) == 10
    tokens, cached = run(lm, PROMPT)
    assert tokens == plain(model, PROMPT) and cached == 0
    stats = lm.close()
    assert stats["store_unauthenticated_blocks"] == 1 and stats["store_hit_tokens"] == 0
    # the first forged value was deleted and the real block written in its place; a replica with
    # the secret reads it, and stops at the next forged one
    again = radixcache.wrap(model, block_size=BS, max_cache_tokens=512, store=url)
    tokens, cached = run(again, PROMPT)
    assert tokens == plain(model, PROMPT) and cached == BS
    assert again.close()["store_unauthenticated_blocks"] == 1


def test_replicas_with_the_secret_share_and_one_without_it_reads_nothing(model, redis_server, tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(b"s3")
    url = with_secret(redis_server.url, secret)
    with radixcache.wrap(model, block_size=BS, max_cache_tokens=512, store=url) as writer:
        run(writer, PROMPT)
    reader = radixcache.wrap(model, block_size=BS, max_cache_tokens=512, store=url)
    tokens, cached = run(reader, PROMPT)
    assert tokens == plain(model, PROMPT) and cached == 40 and reader.close()["store_hit_tokens"] == 40
    outsider = radixcache.wrap(model, block_size=BS, max_cache_tokens=512, store=redis_server.url)
    tokens, cached = run(outsider, PROMPT)  # another namespace: it never even sees the sealed keys
    assert tokens == plain(model, PROMPT) and cached == 0
    assert outsider.close()["store_bad_values"] == 0


def test_a_mac_binds_a_value_to_its_key_and_its_secret():
    lm = radixcache.wrap(tiny_model("llama"), block_size=BS, max_cache_tokens=64)
    fmt = pool_format(lm.pool, model="m")
    ns = namespace_digest(fmt, ("m", None), sealed=True)
    digests = block_digests(ns, list(range(8)), BS, 2)
    kv = BlockKV(bytes(fmt.payload_bytes), fmt.kv_dtype, fmt.shape, ())
    key = mac_key(b"secret")
    value = encode_value(fmt, ns, digests[0], [0, 1, 2, 3], kv, key)
    assert decode_value(value, fmt, ns, digests[0], [0, 1, 2, 3], key).dtype == fmt.kv_dtype
    with pytest.raises(Unauthenticated):
        decode_value(value, fmt, ns, digests[0], [0, 1, 2, 3], mac_key(b"other"))
    with pytest.raises(Unauthenticated):
        decode_value(encode_value(fmt, ns, digests[0], [0, 1, 2, 3], kv), fmt, ns, digests[0], [0, 1, 2, 3], key)
    with pytest.raises(BadValue):  # moved under the next block's key
        decode_value(value, fmt, ns, digests[1], [4, 5, 6, 7], key)
    tampered = bytearray(value)
    tampered[-100] ^= 1
    with pytest.raises(Unauthenticated):
        decode_value(bytes(tampered), fmt, ns, digests[0], [0, 1, 2, 3], key)
    assert namespace_digest(fmt, ("m", None)) != ns  # sealed and unsealed stores never share a key
    with pytest.raises(ValueError, match="empty"):
        mac_key(b"")


def test_a_store_without_a_secret_says_it_trusts_its_redis(model, redis_server, caplog, monkeypatch):
    import radixcache.integrations.redis_store.store as store_module

    monkeypatch.setattr(store_module, "_TRUST_NOTED", set())  # said once per URL and process
    monkeypatch.delenv("RADIXCACHE_STORE_SECRET", raising=False)
    radixcache.wrap(model, block_size=BS, max_cache_tokens=64, store=redis_server.url).close()
    assert any("trusts whoever can write" in r.getMessage() for r in caplog.records)
    caplog.clear()
    monkeypatch.setenv("RADIXCACHE_STORE_SECRET", "from the environment")
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=64, store=redis_server.url)
    assert lm.manager.store.sealed
    lm.close()
    assert not any("trusts" in r.getMessage() for r in caplog.records)
