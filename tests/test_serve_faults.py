"""Issue 30 against the real server, on every protocol, with the real ``openai`` and ``anthropic``
clients: a stream of extreme but valid requests and of requests that break the model runs beside a
greedy canary conversation. The canary keeps its tokens; every valid request succeeds; the only 5xx
answers are those of the requests whose own failure they report. And the event loop never waits on
the engine: ``/metrics``, ``/v1/loads`` and ``/health`` answer, and an abort returns, while the
cache's lock is held elsewhere.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import openai
import pytest
import torch

from serve_helpers import Served, scripted_llama_class, write_model_dir

POISON = 29106  # " zebra": a step segment holding it gets NaN logits
BOMB = 41401  # " giraffe": a forward whose input holds it raises
SYSTEM = "You are a careful assistant. Answer in one short sentence. " * 6


def faulty_llama_class():
    """``ScriptedLlama`` with faults keyed on tokens, armed once the server runs (``wrap``'s
    self-tests use random ids): a forward over ``BOMB`` raises, and the logits rows of a sequence
    whose new tokens in the step hold ``POISON`` come out NaN (an fp16 overflow would)."""

    class FaultyLlama(scripted_llama_class()):
        armed = False

        def forward(self, input_ids=None, position_ids=None, logits_to_keep=0, **kwargs):
            if self.armed and (input_ids == BOMB).any():
                raise RuntimeError("the model fell over")
            out = super().forward(input_ids=input_ids, position_ids=position_ids,
                                  logits_to_keep=logits_to_keep, **kwargs)
            cache = kwargs.get("cache")
            if self.armed and torch.is_tensor(logits_to_keep) and hasattr(cache, "step_plan"):
                ids = input_ids[0].tolist()
                for row, at in enumerate(logits_to_keep.tolist()):
                    seg = next(s for s in cache.step_plan.segments if s.q_start <= at < s.q_start + s.q_len)
                    if POISON in ids[seg.q_start:seg.q_start + seg.q_len]:
                        out.logits[0, row] = float("nan")
            return out

    return FaultyLlama


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model_dir = write_model_dir(tmp_path_factory.mktemp("faults") / "tiny-smol", max_positions=2048, weights=True)
    server = Served(model_dir, model_class=faulty_llama_class(), max_running=16)
    server.model.armed = True
    yield server
    server.stop()


def canary_turns(served, turns: int = 3) -> list[str]:
    """A greedy three-turn conversation (each reply fed back): its replies."""
    client = served.client()
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Tell me about rivers."}]
    replies = []
    for turn in range(turns):
        out = client.chat.completions.create(model="tiny-smol", messages=messages, max_tokens=24, temperature=0)
        reply = out.choices[0].message.content
        replies.append(reply)
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": f"And {turn}?"}]
    return replies


def extreme_requests(served) -> list:
    """``(name, call, fails)``: one call per extreme kind and protocol; ``fails`` names the cause its
    error must report (None: it must succeed)."""
    o, a = served.client(), served.anthropic()
    user = [{"role": "user", "content": "Count to three."}]
    # a fault is keyed on the tokens a step computes: a new word before the animal keeps it out of
    # the cache (the blocks of a poisoned prompt are cached like any other)
    zebra = Fresh(lambda n: [{"role": "user", "content": f"Describe {n} zebra."}])
    giraffe = Fresh(lambda n: [{"role": "user", "content": f"Describe {n} giraffe."}])
    schema = {"type": "object", "properties": {"a": {"type": "string", "enum": ["only"]}},
              "required": ["a"], "additionalProperties": False}

    def chat(stream=False, **kw):
        def call():
            out = o.chat.completions.create(model="tiny-smol", max_tokens=8, stream=stream, **fresh(kw))
            return list(out) if stream else out
        return call

    def completion(stream=False, **kw):
        def call():
            out = o.completions.create(model="tiny-smol", max_tokens=8, stream=stream, **fresh(kw))
            return list(out) if stream else out
        return call

    def messages(stream=False, **kw):
        # this SDK has no sampling arguments of its own: they go in the body as the API takes them
        knobs = {k: kw.pop(k) for k in ("temperature", "top_p", "top_k") if k in kw}
        kw["extra_body"] = knobs

        def call():
            if stream:
                with a.messages.stream(model="tiny-smol", max_tokens=8, **fresh(kw)) as s:
                    return s.get_final_message()
            return a.messages.create(model="tiny-smol", max_tokens=8, **fresh(kw))
        return call

    def responses(stream=False, **kw):
        def call():
            out = o.responses.create(model="tiny-smol", max_output_tokens=8, stream=stream, **fresh(kw))
            if not stream:
                return out
            failed = [e for e in out if e.type == "response.failed"]  # the SDK does not raise on it
            if failed:
                raise StreamFailed(failed[0].response.error.message)
        return call

    out = []
    for stream in (False, True):
        s = "stream " if stream else ""
        out += [
            (s + "chat t=1e-40", chat(stream, messages=user, temperature=1e-40), None),
            (s + "chat t=1e-40 top_p", chat(stream, messages=user, temperature=1e-40, top_p=0.5), None),
            (s + "chat t=1e-30 top_p=1e-9", chat(stream, messages=user, temperature=1e-30, top_p=1e-9), None),
            (s + "chat n=3 seed", chat(stream, messages=user, temperature=1e-40, n=3, seed=7), None),
            (s + "chat logprobs", chat(stream, messages=user, temperature=1e-40, logprobs=True, top_logprobs=20), None),
            (s + "chat t=2", chat(stream, messages=user, temperature=2.0, seed=1), None),
            (s + "completion t=1e-40", completion(stream, prompt="Once upon", temperature=1e-40, top_p=0.3), None),
            (s + "completion ids", completion(stream, prompt=[1, 2, 3, 4], temperature=1e-40, logprobs=5), None),
            (s + "messages t=1e-40 top_k", messages(stream, messages=user, temperature=1e-40, top_k=1), None),
            (s + "messages top_p", messages(stream, messages=user, temperature=1e-38, top_p=1e-6), None),
            (s + "responses t=1e-40", responses(stream, input="Count to three.", temperature=1e-40), None),
            (s + "chat poisoned", chat(stream, messages=zebra, temperature=0), "NaN"),
            (s + "completion poisoned", completion(stream, prompt=[5, 6, POISON], temperature=0.7), "NaN"),
            (s + "messages poisoned", messages(stream, messages=zebra), "NaN"),
            (s + "responses poisoned", responses(stream, input=Fresh(lambda n: f"Describe {n} zebra.")), "NaN"),
            (s + "chat bomb", chat(stream, messages=giraffe, temperature=1e-40), "fell over"),
            (s + "messages bomb", messages(stream, messages=giraffe, temperature=0), "fell over"),
        ]
    out.append(("chat one-value json_schema", chat(messages=user, temperature=1e-40, response_format={
        "type": "json_schema", "json_schema": {"name": "one", "schema": schema}}), None))
    return out


class Fresh:
    """A request field made anew for each call from a counter."""

    count = 0

    def __init__(self, make):
        self.make = make

    def __call__(self):
        Fresh.count += 1
        return self.make(f"nonce{Fresh.count}x")


def fresh(kw: dict) -> dict:
    return {k: v() if isinstance(v, Fresh) else v for k, v in kw.items()}


class StreamFailed(Exception):
    """A Responses stream that ended with ``response.failed``."""


def outcome(call, fails):
    try:
        call()
    except (openai.APIError, anthropic.APIError, StreamFailed) as exc:
        status = getattr(exc, "status_code", None)
        return "error", status, str(exc)
    return "ok", 200, ""


def test_extreme_and_faulty_requests_on_every_protocol_leave_a_canary_alone(served):
    alone = canary_turns(served)
    served.quiet()
    requests = extreme_requests(served)
    results: dict = {}
    with ThreadPoolExecutor(4) as pool:
        canary = pool.submit(canary_turns, served)
        for _ in range(2):  # two rounds, interleaved with the canary's turns
            futures = {name: pool.submit(outcome, call, fails) for name, call, fails in requests}
            for name, future in futures.items():
                results.setdefault(name, []).append(future.result(timeout=300))
        assert canary.result(timeout=300) == alone
    for name, call, fails in requests:
        for kind, status, text in results[name]:
            if fails is None:
                assert kind == "ok", (name, status, text)
            else:
                assert kind == "error" and fails in text, (name, status, text)
                # a stream has begun (200) when its error comes: it is reported inside it
                assert status in ((200, None) if name.startswith("stream") else (500,)), (name, status, text)
    served.assert_clean()
    assert served.engine.alive
    assert httpx.get(served.base_url + "/health", timeout=10).status_code == 200


class SlowStore:
    """A ``BlockStore`` whose every offer takes ``delay_s`` (a slow device copy or network): the
    work done under and around the cache's lock is slow, and the event loop must not feel it.
    It holds nothing (every fetch is a miss)."""

    def __init__(self, block_size: int, delay_s: float):
        from radixcache.store import STORE_COUNTERS

        self.block_size = block_size
        self.delay_s = delay_s
        self.counters = dict.fromkeys(STORE_COUNTERS, 0)

    def fetch(self, namespace, tokens, start, limit):
        self.counters["store_miss_blocks"] += limit
        return []

    def offer(self, namespace, tokens, start, blocks, pool):
        time.sleep(self.delay_s)
        for block in blocks:
            pool.export_block(block)
        self.counters["store_dropped_blocks"] += len(blocks)
        return len(blocks)

    def stats(self) -> dict:
        return dict(self.counters)

    def close(self, timeout: float = 10.0) -> dict:
        return self.stats()


def test_the_event_loop_never_waits_on_the_engine(tmp_path):
    """Issue 30 item 2: while another thread holds the cache's lock for a second (and a store takes
    a second per export), ``/metrics``, ``/v1/loads`` and ``/health`` answer within 100 ms and an
    abort returns to the loop within 10 ms."""
    model_dir = write_model_dir(tmp_path / "tiny-smol", max_positions=2048, weights=True)
    served = Served(model_dir, lm_options={"store": SlowStore(16, 1.0)})
    try:
        client = served.client()
        client.chat.completions.create(model="tiny-smol", max_tokens=4, temperature=0,
                                       messages=[{"role": "user", "content": "Hello there, " * 20}])
        manager = served.lm.manager
        held, release = threading.Event(), threading.Event()

        def hold():
            with manager.mutex:
                held.set()
                release.wait(10)

        holder = threading.Thread(target=hold)
        holder.start()
        assert held.wait(10)
        try:
            for path in ("/metrics", "/v1/loads", "/health"):
                began = time.perf_counter()
                assert httpx.get(served.base_url + path, timeout=10).status_code == 200
                assert time.perf_counter() - began < 0.1, path
            loop = served.live.loop
            timings = asyncio.run_coroutine_threadsafe(_timed_abort(served.engine), loop).result(10)
            assert max(timings) < 0.01, timings
        finally:
            release.set()
            holder.join(10)
    finally:
        served.stop()


async def _timed_abort(engine) -> list:
    """On the server's loop: submit a request and abort it, timing each ``abort`` call."""
    from radixcache.engine import Request, SamplingParams

    timings = []
    for i in range(3):
        stream = engine.submit(Request(f"abort-{i}", [1, 2, 3, 4, 5], SamplingParams(max_new_tokens=50)))
        began = time.perf_counter()
        engine.abort(f"abort-{i}")
        timings.append(time.perf_counter() - began)
        del stream
    return timings
