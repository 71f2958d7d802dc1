"""The shared store through ``wrap(model, store=URL)`` and ``generate``, against a real redis-server:
two processes share a prefix, and no fault (store down, killed, slow, full, corrupt, foreign
values) ever changes a token or raises into the caller."""

import json
import logging
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import radixcache
from tiny_models import random_ids, tiny_model

WORKER = Path(__file__).with_name("store_worker.py")
BS = 4


def worker(url, n=1500, new=8):
    out = subprocess.run([sys.executable, str(WORKER), url, str(n), str(new)], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_second_process_loads_the_first_ones_prefix_from_the_store(redis_server):
    """Process 2's first request over process 1's 1,500-token prompt gets every whole block of it
    (93 blocks of 16 = 1,488 tokens) from Redis, with the same greedy tokens as plain generate."""
    first = worker(redis_server.url)
    assert first["store_written_blocks"] >= 93 and first["store_dropped_blocks"] == 0
    second = worker(redis_server.url)
    assert second["model_id"] == first["model_id"]  # the same weights: the same identity
    assert second["store_hit_tokens"] == 1488 and second["cached_tokens"] == 1488
    assert second["tokens"] == second["plain"] == first["tokens"]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def plain(model, prompt, new=5):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                             do_sample=False)
    return out[0, len(prompt):].tolist()


def run(lm, prompt, new=5, **kwargs):
    out = lm.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False,
                      return_dict_in_generate=True, **kwargs)
    return out.sequences[0, len(prompt):].tolist(), out.cached_tokens[0]


def warm_store(model, url, prompt, **wrap_options):
    with radixcache.wrap(model, block_size=BS, max_cache_tokens=512, store=url,
                         **wrap_options) as lm:
        run(lm, prompt)
    return lm.stats()


PROMPT = random_ids(41, 5)[0].tolist()  # 10 whole blocks of 4 in tokens[:-1]


def test_unreachable_store_at_wrap_warns_once_and_runs_without_it(model, caplog):
    caplog.set_level(logging.WARNING)
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=512, store="redis://127.0.0.1:1/0")
    for _ in range(3):
        assert run(lm, PROMPT)[0] == plain(model, PROMPT)
    lm.close()
    assert sum("redis" in r.getMessage().lower() and "trusts" not in r.getMessage() for r in caplog.records) == 1
    assert lm.stats()["store_errors"] >= 1


def test_killed_mid_run_changes_no_token(model, redis_server):
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=512, store=redis_server.url)
    assert run(lm, PROMPT)[0] == plain(model, PROMPT)
    redis_server.kill()
    for seed in range(3):
        p = random_ids(30, 20 + seed)[0].tolist()
        assert run(lm, p)[0] == plain(model, p)
    lm.close(timeout=1)
    assert lm.stats()["store_errors"] >= 1


def test_slow_store_times_out_as_a_miss(model, redis_server):
    warm_store(model, redis_server.url, PROMPT)
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=512, store=redis_server.url)
    sleeper = threading.Thread(
        target=lambda: redis_server.client().execute_command("DEBUG", "SLEEP", "2"))
    sleeper.start()
    time.sleep(0.1)
    try:
        started = time.monotonic()
        tokens, cached = run(lm, PROMPT)
        waited = time.monotonic() - started
    finally:
        sleeper.join()
    assert tokens == plain(model, PROMPT) and cached == 0 and waited < 2
    lm.close()


def corrupt(client, flip_at):
    for key in client.keys("radixcache:*"):
        value = bytearray(client.get(key))
        value[flip_at % len(value)] ^= 0xFF
        client.set(key, bytes(value))


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_corrupted_values_are_misses_never_wrong_tokens(model, redis_server, how):
    warm_store(model, redis_server.url, PROMPT)
    client = redis_server.client()
    keys = client.keys("radixcache:*")
    if how == "flip":
        corrupt(client, 500)
    else:
        for key in keys:
            client.set(key, client.get(key)[:-7])
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=512, store=redis_server.url)
    tokens, cached = run(lm, PROMPT)
    assert tokens == plain(model, PROMPT) and cached == 0
    assert lm.close()["store_bad_values"] == 1  # the first block: deleted, then written again
    again = radixcache.wrap(model, block_size=BS, max_cache_tokens=512, store=redis_server.url)
    tokens, cached = run(again, PROMPT)
    assert tokens == plain(model, PROMPT) and cached == BS  # block 0 healed, block 1 still bad
    assert again.close()["store_bad_values"] == 1


@pytest.mark.parametrize("other", ["model", "tenant", "block size"])
def test_values_of_another_model_tenant_or_block_size_are_misses(model, redis_server, other):
    warm_store(model, redis_server.url, PROMPT)
    kwargs, wrap_options, reader = {}, {}, model
    if other == "model":
        reader = tiny_model("llama", seed=1)
    elif other == "tenant":
        kwargs = {"cache_salt": "tenant-b"}
    else:
        wrap_options = {"block_size": 8}
    lm = radixcache.wrap(reader, max_cache_tokens=512, store=redis_server.url,
                         **{"block_size": BS, **wrap_options})
    tokens, cached = run(lm, PROMPT, **kwargs)
    assert tokens == plain(reader, PROMPT) and cached == 0
    assert lm.stats()["store_hit_tokens"] == 0
    lm.close()


def test_a_full_store_refuses_writes_softly(model, redis_server):
    client = redis_server.client()
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", int(client.info("memory")["used_memory"]) + 4096)
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=512, store=redis_server.url)
    for seed in range(3):
        p = random_ids(30, 40 + seed)[0].tolist()
        assert run(lm, p)[0] == plain(model, p)
    final = lm.close()
    assert final["store_dropped_blocks"] >= 1 and final["store_written_blocks"] < 21


def test_warm_store_serves_a_cold_wrapper_exactly(model, redis_server):
    warm_store(model, redis_server.url, PROMPT)
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=512, store=redis_server.url)
    tokens, cached = run(lm, PROMPT)
    assert tokens == plain(model, PROMPT) and cached == 40
    out = lm.generate_batch([PROMPT + [3, 4, 5]], max_new_tokens=4)
    assert out.cached_tokens[0] >= 40
    final = lm.close()
    assert final["store_hit_tokens"] == 40 and lm.stats()["store_hit_tokens"] == 40
