"""The server generating, over real HTTP: uvicorn on a free loopback port, the ``openai`` client and
httpx, a tiny random Llama with the embedded tokenizer behind radixcache's always-on engine.

Greedy text equals ``model.generate`` on the rendered prompt, streamed or not; ``n``, ``stop``,
seeds; 16 concurrent clients equal sequential greedy; a client that disconnects frees everything;
429 and 503 with requests really in flight; an engine failure is a 500 and leaves the cache exact.
After every test the engine must hold nothing (the end-of-test leak check covers the caches the
test made; ``client`` checks the module's server).
"""

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from serve_helpers import Served, metric, write_model_dir

SYSTEM = "You are a careful assistant who answers in one short sentence. " * 4


def chat(user: str) -> list:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model_dir(tmp_path_factory.mktemp("model") / "tiny-smol", max_positions=2048, weights=True)


@pytest.fixture(scope="module")
def served(model_dir):
    server = Served(model_dir)
    yield server
    server.stop()


@pytest.fixture
def client(served):
    served.model.script = {}
    with served.client() as c:
        yield c
    served.assert_clean()


def streamed(stream):
    """(text per choice index, finish reason per index, the usage) of a streamed chat completion."""
    texts, reasons, usage = {}, {}, None
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
        if chunk.usage is not None:
            usage = chunk.usage
    return texts, reasons, usage


def test_streaming_and_not_give_model_generates_greedy_text(served, client):
    messages = chat("Name a colour.")
    prompt = served.render(messages)
    expected = served.plain_greedy_text(prompt, 20)
    body = client.chat.completions.create(model="tiny-smol", messages=messages, max_tokens=20, temperature=0)
    assert body.choices[0].message.content == expected and body.choices[0].finish_reason == "length"
    assert body.usage.prompt_tokens == len(prompt) and body.usage.completion_tokens == 20
    texts, reasons, usage = streamed(client.chat.completions.create(
        model="tiny-smol", messages=messages, max_tokens=20, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert texts == {0: expected} and reasons == {0: "length"}
    # the second time the whole prompt but the one token computed for logits was cached
    assert usage.prompt_tokens_details.cached_tokens == len(prompt) - 1 and usage.completion_tokens == 20
    for prompt_arg in (served.state.tokenizer.decode(prompt), list(prompt)):
        text = client.completions.create(model="tiny-smol", prompt=prompt_arg, max_tokens=20, temperature=0)
        assert text.choices[0].text == expected and text.usage.prompt_tokens_details.cached_tokens > 0
        pieces = client.completions.create(model="tiny-smol", prompt=prompt_arg, max_tokens=20,
                                           temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in pieces if c.choices) == expected


def test_default_temperature_samples_and_seed_fixes_the_samples(client):
    messages = chat("Tell me a story.")
    first = client.chat.completions.create(model="tiny-smol", messages=messages, max_tokens=12, n=3, seed=7)
    again = client.chat.completions.create(model="tiny-smol", messages=messages, max_tokens=12, n=3, seed=7)
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2] and len(set(texts)) == 3  # OpenAI's default: sampling
    assert [c.message.content for c in again.choices] == texts and first.usage.completion_tokens == 36
    texts_streamed, reasons, _ = streamed(client.chat.completions.create(
        model="tiny-smol", messages=messages, max_tokens=12, n=3, seed=7, stream=True))
    assert texts_streamed == dict(enumerate(texts)) and reasons == {0: "length", 1: "length", 2: "length"}
    other = client.chat.completions.create(model="tiny-smol", messages=messages, max_tokens=12, n=3, seed=8)
    assert [c.message.content for c in other.choices] != texts
    nucleus = client.chat.completions.create(model="tiny-smol", messages=messages, max_tokens=12, seed=7,
                                             temperature=0.7, top_p=0.5)
    assert nucleus.choices[0].finish_reason == "length"


def test_greedy_n_gives_n_copies_of_the_greedy_reply(client):
    messages = chat("Count to three.")
    one = client.chat.completions.create(model="tiny-smol", messages=messages, max_tokens=10, temperature=0)
    many = client.chat.completions.create(model="tiny-smol", messages=messages, max_tokens=10, temperature=0, n=3)
    assert [c.message.content for c in many.choices] == [one.choices[0].message.content] * 3
    assert many.usage.completion_tokens == 30
    texts, _, _ = streamed(client.chat.completions.create(model="tiny-smol", messages=messages, max_tokens=10,
                                                          temperature=0, n=2, stream=True))
    assert texts == {0: one.choices[0].message.content, 1: one.choices[0].message.content}


def test_stop_strings_end_a_sample_early(served, client):
    messages = chat("Spell a long word.")
    full = client.chat.completions.create(model="tiny-smol", messages=messages, max_tokens=30, temperature=0)
    text = full.choices[0].message.content
    stop = text[len(text) // 3:len(text) // 3 + 3]
    cut = text[:text.find(stop)]
    generated_before = served.lm.stats()["generated_tokens"]
    short = client.chat.completions.create(model="tiny-smol", messages=messages, max_tokens=30, temperature=0,
                                           stop=[stop, "never-appears"])
    assert short.choices[0].message.content == cut and short.choices[0].finish_reason == "stop"
    assert short.usage.completion_tokens < 30 and served.lm.stats()["generated_tokens"] - generated_before < 30
    texts, reasons, _ = streamed(client.chat.completions.create(
        model="tiny-smol", messages=messages, max_tokens=30, temperature=0, stop=stop, stream=True))
    assert texts == {0: cut} and reasons == {0: "stop"}
    # with several samples a stop string ends only the sample that wrote it
    sampled = client.chat.completions.create(model="tiny-smol", messages=messages, max_tokens=16, n=3, seed=3)
    target = sampled.choices[1].message.content
    stop = target[4:7]
    cut = client.chat.completions.create(model="tiny-smol", messages=messages, max_tokens=16, n=3, seed=3,
                                         stop=stop)
    for before, after in zip(sampled.choices, cut.choices):
        position = before.message.content.find(stop)
        expected = before.message.content if position < 0 else before.message.content[:position]
        assert after.message.content == expected
        assert after.finish_reason == ("length" if position < 0 else "stop")


def test_sixteen_concurrent_clients_equal_sequential_greedy(served, client):
    users = [f"Question {i}: what is {i} plus {i * 3}?" for i in range(16)]
    sequential = [client.chat.completions.create(model="tiny-smol", messages=chat(u), max_tokens=16,
                                                 temperature=0).choices[0].message.content for u in users]
    served.lm.clear()
    steps_before = served.engine.engine.metrics.steps

    def one(i):
        if i % 2:
            texts, _, _ = streamed(client.chat.completions.create(model="tiny-smol", messages=chat(users[i]),
                                                                  max_tokens=16, temperature=0, stream=True))
            return texts[0]
        return client.chat.completions.create(model="tiny-smol", messages=chat(users[i]), max_tokens=16,
                                              temperature=0).choices[0].message.content

    with ThreadPoolExecutor(16) as pool:
        concurrent = list(pool.map(one, range(16)))
    assert concurrent == sequential
    # they ran batched: far fewer steps than the 16 x 16 tokens they generated
    assert served.engine.engine.metrics.steps - steps_before < 16 * 16 / 2


def test_a_client_that_disconnects_mid_stream_frees_everything(served, client):
    generated_before = served.lm.stats()["generated_tokens"]
    body = {"model": "tiny-smol", "messages": chat("Write a very long essay."), "max_tokens": 1500,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", served.base_url + "/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        chunks = 0
        for line in response.iter_lines():
            chunks += line.startswith("data: ")
            if chunks == 4:
                break
    served.quiet()
    assert served.lm.stats()["generated_tokens"] - generated_before < 1500
    assert served.engine.counts().running == 0 and served.lm.cache.pinned_blocks == 0
    # the same for a non-streaming request whose client gives up
    generated_before = served.lm.stats()["generated_tokens"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(served.base_url + "/v1/chat/completions", json={**body, "stream": False}, timeout=0.5)
    served.quiet()
    assert served.lm.stats()["generated_tokens"] - generated_before < 1500
    assert metric(served.metrics(), "num_requests_running") == 0


def open_streams(served, count: int, max_tokens: int = 1500):
    """``count`` streaming requests that are generating (each has sent a token); close to abort."""
    streams = []
    for i in range(count):
        response = httpx.stream("POST", served.base_url + "/v1/chat/completions", timeout=60, json={
            "messages": chat(f"Essay {i}."), "max_tokens": max_tokens, "temperature": 0, "stream": True})
        opened = response.__enter__()
        lines = opened.iter_lines()
        while not next(lines).startswith('data: {"id"'):
            pass
        streams.append((response, lines))
    return streams


def close_streams(streams) -> None:
    for response, _ in streams:
        response.__exit__(None, None, None)


def refuses_one_more_then_serves(served, error, check):
    """With two requests held open, one more gets ``error`` (``check(exc)`` asserts its details);
    once they are closed the server answers again."""
    streams = []
    try:
        streams = open_streams(served, 2)
        with served.client() as c:
            with pytest.raises(error) as info:
                c.chat.completions.create(model="tiny-smol", messages=chat("One more?"), max_tokens=2)
            check(info.value)
            close_streams(streams)
            streams = []
            served.quiet()
            assert c.chat.completions.create(model="tiny-smol", messages=chat("Now?"), max_tokens=2).usage
    finally:
        close_streams(streams)
        served.stop()


def test_a_full_server_answers_429_and_a_full_engine_503(model_dir):
    served = Served(model_dir, max_running=1, max_queue=1)  # two in flight at most

    def queue_full(exc):
        assert metric(served.metrics(), "num_requests_running") == 1  # one runs, one waits for a place
        assert exc.status_code == 429 and exc.code == "queue_full"

    refuses_one_more_then_serves(served, openai.RateLimitError, queue_full)
    served = Served(model_dir, max_running=1, max_queue=8, engine_options={"max_requests": 2})

    def overloaded(exc):
        assert exc.status_code == 503 and "overloaded" in exc.message
        assert metric(served.metrics(), "requests_rejected_total", status="503") == 1

    refuses_one_more_then_serves(served, openai.InternalServerError, overloaded)


def test_prompts_too_long_for_the_pool_are_refused_before_the_engine(model_dir):
    served = Served(model_dir, lm_options={"max_cache_tokens": 256})
    try:
        with served.client() as c:
            with pytest.raises(openai.BadRequestError) as info:
                c.completions.create(model="tiny-smol", prompt=[5] * 300, max_tokens=2)
            assert "pool holds only 256" in info.value.message
            # 250 tokens and the first new one fit the pool's 16 blocks of 16: served (issue 17)
            for n in (250, 200):
                assert c.completions.create(model="tiny-smol", prompt=[5] * n, max_tokens=2).usage
    finally:
        served.stop()


def test_an_engine_failure_is_a_500_and_the_cache_stays_exact(served, client, monkeypatch):
    messages = chat("What went wrong?")
    expected = client.chat.completions.create(model="tiny-smol", messages=messages, max_tokens=8,
                                              temperature=0).choices[0].message.content
    served.lm.clear()
    real = served.lm.runner.forward
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        if len(calls) >= 2:  # the prompt goes in; the first decode step fails
            raise RuntimeError("device fell over")
        return real(*args, **kwargs)

    monkeypatch.setattr(served.lm.runner, "forward", broken)
    with pytest.raises(openai.InternalServerError) as info:
        client.chat.completions.create(model="tiny-smol", messages=messages, max_tokens=8, temperature=0)
    assert info.value.status_code == 500 and "device fell over" in info.value.message
    with pytest.raises(openai.APIError, match="device fell over"):
        streamed(client.chat.completions.create(model="tiny-smol", messages=messages, max_tokens=8,
                                                temperature=0, stream=True))
    served.quiet()
    served.lm.manager.check()
    assert served.lm.cache.pinned_blocks == 0
    monkeypatch.setattr(served.lm.runner, "forward", real)
    again = client.chat.completions.create(model="tiny-smol", messages=messages, max_tokens=8, temperature=0)
    assert again.choices[0].message.content == expected  # what the failed step left cached is exact
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_metrics_follow_the_requests(served, client):
    before = served.metrics()
    client.chat.completions.create(model="tiny-smol", messages=chat("Metrics?"), max_tokens=5, temperature=0)
    after = served.metrics()
    grew = lambda name, **labels: metric(after, name, **labels) - metric(before, name, **labels)  # noqa: E731
    assert grew("prefix_cache_queries_total") > 0 and grew("generation_tokens_total") == 5
    assert grew("request_success_total", finish_reason="length") == 1
    assert grew("time_to_first_token_seconds_count") == 1 and grew("inter_token_latency_seconds_count") == 4
    assert 0 < metric(after, "kv_cache_usage_perc") <= 1 or metric(after, "kv_cache_usage_perc") == 0
    assert httpx.get(served.base_url + "/health", timeout=10).json() == {"status": "ok"}


def test_the_engine_thread_sleeps_when_idle(served, client):
    """No work: the scheduler thread waits on its condition (it does not step in a loop)."""
    client.chat.completions.create(model="tiny-smol", messages=chat("Idle?"), max_tokens=2, temperature=0)
    served.quiet()
    steps = served.engine.engine.metrics.steps
    time.sleep(0.3)
    assert served.engine.engine.metrics.steps == steps
    threads = [t for t in threading.enumerate() if t.name == "radixcache-scheduler"]
    assert threads and all(t.is_alive() for t in threads)


def test_usage_is_json_everywhere(served):
    """Every body carries usage.prompt_tokens_details.cached_tokens, streamed or not."""
    body = {"model": "tiny-smol", "messages": chat("JSON?"), "max_tokens": 3, "temperature": 0}
    plain = httpx.post(served.base_url + "/v1/chat/completions", json=body, timeout=60).json()
    assert set(plain["usage"]["prompt_tokens_details"]) == {"cached_tokens"}
    with httpx.stream("POST", served.base_url + "/v1/chat/completions", json={**body, "stream": True},
                      timeout=60) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: {")]
    assert events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0
    served.assert_clean()


def test_a_model_the_engine_cannot_serve_is_refused():
    """Attention the engine does not compute (GPT-OSS sinks): the server refuses the model rather
    than answer with tokens that may be wrong."""
    import radixcache
    from radixcache.integrations.serve.engine.local import LocalEngine
    from test_unsupported_attention import gpt_oss

    lm = radixcache.wrap(gpt_oss(), block_size=4, max_cache_tokens=512)
    with pytest.raises(ValueError, match="cannot run on radixcache's engine: .*s_aux"):
        LocalEngine(lm)


def test_prepare_runs_on_the_scheduler_thread_with_its_threads_before_any_step():
    """``prepare`` (the server's --compile) runs on the scheduler thread after its thread count is
    set, before the constructor returns; what it raises comes out of the constructor."""
    import torch

    import radixcache
    from radixcache.integrations.serve.engine.local import LocalEngine
    from tiny_models import tiny_model

    lm = radixcache.wrap(tiny_model("llama"), block_size=4, max_cache_tokens=512)
    seen = []
    engine = LocalEngine(lm, compute_threads=2,
                         prepare=lambda: seen.append((threading.current_thread().name, torch.get_num_threads())))
    try:
        assert seen == [("radixcache-scheduler", 2)]
    finally:
        asyncio.run(engine.close())

    def fails():
        raise RuntimeError("no C++ compiler")

    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
        LocalEngine(lm, prepare=fails)


def test_a_prompt_outside_the_vocabulary_is_a_400_naming_the_id_and_the_field(served, client):
    """The engine's one validation pass: the id and the field come back as OpenAI's ``param``."""
    response = httpx.post(served.base_url + "/v1/completions", json={"prompt": [5, 10 ** 6]}, timeout=30)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "prompt" and "token id 1000000 is outside the vocabulary" in error["message"]
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        client.completions.create(model="tiny-smol", prompt=[5, 10 ** 6])
