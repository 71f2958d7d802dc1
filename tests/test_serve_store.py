"""Two servers on one real redis-server (``--store``): the second's first request over the first's
long prompt loads every whole block from the store, reports them as cached and generates the same
greedy text; both export the store's counters in ``/metrics`` and flush on shutdown."""

import time

import torch

from serve_helpers import Served, metric, write_model_dir

BS = 16


def long_prompt(n: int) -> list:
    g = torch.Generator().manual_seed(77)
    return torch.randint(100, 40000, (n,), generator=g).tolist()


def complete(served, prompt):
    with served.client() as client:
        body = client.completions.create(model="tiny-smol", prompt=prompt, max_tokens=8, temperature=0)
    return body.choices[0].text, body.usage.prompt_tokens_details.cached_tokens


def test_two_servers_share_one_store(tmp_path, redis_server):
    directory = write_model_dir(tmp_path / "tiny-smol", max_positions=2048, weights=True)
    prompt = long_prompt(600)
    whole = (len(prompt) - 1) // BS * BS  # what a request can reuse: whole blocks of prompt[:-1]
    options = dict(lm_options={"store": redis_server.url}, engine_options={"close_lm": True})
    first = Served(directory, **options)
    try:
        text, cached = complete(first, prompt)
        assert cached == 0
        deadline = time.monotonic() + 60  # the writer sends blocks in the background
        while metric(first.metrics(), "store_written_blocks_total") < whole // BS:
            assert time.monotonic() < deadline, first.metrics()
            time.sleep(0.05)
    finally:
        first.stop()
    assert first.lm.stats()["store_dropped_blocks"] == 0  # closed on shutdown: everything was sent
    second = Served(directory, **options)
    try:
        assert second.lm.stats()["cached_tokens"] == 0  # a fresh process: nothing local
        again, cached = complete(second, prompt)
        assert again == text and cached >= whole
        scraped = second.metrics()
        assert metric(scraped, "store_hit_tokens_total") >= whole
        assert metric(scraped, "store_errors_total") == 0
        assert metric(scraped, "prefix_cache_hits_total") >= whole
    finally:
        second.stop()


def test_without_a_store_no_store_metrics(tmp_path):
    served = Served(write_model_dir(tmp_path / "tiny-smol", weights=True))
    try:
        complete(served, long_prompt(40))
        assert "store_" not in served.metrics()
    finally:
        served.stop()
