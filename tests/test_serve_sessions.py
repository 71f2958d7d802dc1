"""Conversations over real HTTP: token-exact history and retention hints.

A multi-turn chat, re-templated as text every turn by the client (as agent frameworks do), hits the
whole previous conversation on every turn (block-aligned), with the model's template and with two
that drift (an empty think block only in the generation prompt; reasoning stripped from past
turns): the server computes each reply's history form into the cache at low priority, and the
next request waits for that work instead of computing it again. The last turn's greedy text equals
``model.generate`` on the same rendered prompt. Without the precompute the same conversation stops
short, and ``/metrics`` says why. ``prompt_cache_key`` / ``prompt_cache_retention`` keep a
session's prefix over prefixes without a hint; tenants (API keys) share nothing unless the server is
started with ``--share-cache-across-keys``, and a request's ``cache_salt`` narrows sharing further.
"""

import time

import openai
import pytest
import torch

from radixcache.integrations.serve.history.forms import history_tokens
from serve_helpers import DRIFT_GENERATION_THINK, DRIFT_STRIP_THINK, Served, metric, write_model_dir

BS = 16
SYSTEM = "You are a helpful agent. Answer briefly and precisely. " * 3
TEMPLATES = {"model": None, "generation_think": DRIFT_GENERATION_THINK, "strip_think": DRIFT_STRIP_THINK}
# why and how many times in the conversation the history form departs from the computed tokens:
# every turn's generation prompt; every scripted reasoning block (not the model's own last reply)
DRIFT = {"model": (None, 0), "generation_think": ("generation_prompt", 4), "strip_think": ("reasoning", 3)}
USERS = ["List the files.", "Open the first one.", "Summarise it in a line.", "Now what is left?"]


def reply_text(template: str, turn: int) -> str:
    if template == "strip_think":
        return f"<think>\nThe user wants step {turn}. Let me check.\n</think>\n{answer(turn)}"
    return answer(turn)


def answer(turn: int) -> str:  # longer than a block, so that rewriting the reasoning costs blocks
    return f"Step {turn} is done: I looked at it closely, found two small issues and fixed them both."


@pytest.fixture(scope="module", params=list(TEMPLATES))
def chat_server(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param) / "tiny-smol"
    write_model_dir(directory, max_positions=2048, chat_template=TEMPLATES[request.param], weights=True)
    server = Served(directory)
    yield request.param, server
    server.stop()


def converse(served, template: str, client, turns: int = len(USERS)) -> list:
    """Run the conversation; per turn ``(prompt ids, cached tokens, ideal)``, where ideal is the
    whole blocks of the previous turn's history form that the prompt repeats. The last turn is
    the model's own greedy reply, checked against ``model.generate``. Between turns the client
    waits until the server is idle, as an agent does while it runs its tool (a client back sooner
    computes what the precompute had not yet: ``test_serve_history_work``)."""
    messages = [{"role": "system", "content": SYSTEM}]
    previous, seen = None, []
    for turn, user in enumerate(USERS[:turns], 1):
        messages.append({"role": "user", "content": user})
        prompt = served.render(messages)
        last = turn == turns
        if last:
            served.model.script = {}
        else:
            served.say(messages, reply_text(template, turn))
        body = client.chat.completions.create(model="tiny-smol", messages=messages, temperature=0,
                                              max_tokens=12 if last else 64)
        assert body.usage.prompt_tokens == len(prompt)
        content = body.choices[0].message.content
        if last:
            assert content == served.plain_greedy_text(prompt, 12)
        else:
            assert content == reply_text(template, turn) and body.choices[0].finish_reason == "stop"
        ideal = 0
        if previous is not None:
            assert prompt[:len(previous)] == previous  # the template renders the past as its history form
            ideal = min(len(previous), len(prompt) - 1) // BS * BS
        seen.append((prompt, body.usage.prompt_tokens_details.cached_tokens, ideal))
        messages.append({"role": "assistant", "content": content})
        previous = history_tokens(served.state.renderer, messages)
        served.quiet()
    return seen


def test_every_turn_hits_the_whole_previous_conversation(chat_server):
    template, served = chat_server
    before = served.metrics()
    with served.client() as client:
        turns = converse(served, template, client)
    after = served.metrics()
    for prompt, cached, ideal in turns[1:]:
        assert ideal > len(SYSTEM) // 8  # the system prompt and every earlier turn
        assert ideal <= cached < len(prompt)
    grew = lambda name, **labels: metric(after, name, **labels) - metric(before, name, **labels)  # noqa: E731
    assert grew("prefix_cache_short_hits_total", reason="evicted") == 0
    assert grew("prefix_cache_short_hits_total", reason="history_mismatch") == 0
    reason, times = DRIFT[template]
    if reason is not None:  # the drift was there; the precompute covered it
        assert grew("history_divergence_total", reason=reason) == times
        assert grew("history_precompute_tokens_total") > 0
    served.assert_clean()


@pytest.mark.parametrize("chat_server", ["model"], indirect=True)
def test_a_new_conversation_sharing_only_the_system_prompt_is_no_short_hit(chat_server):
    """A second conversation that shares only the system prompt with a finished one is served that
    prompt from the cache; it continues nothing, so no hit is expected of it and none is reported
    short (it was counted as history_mismatch: the stored form with the longest common prefix was
    taken for its previous turn). A turn that continues the first conversation still is checked."""
    _, served = chat_server
    with served.client() as client:
        first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USERS[0]}]
        served.say(first, answer(1))
        reply = client.chat.completions.create(model="tiny-smol", messages=first, temperature=0, max_tokens=64)
        first.append({"role": "assistant", "content": reply.choices[0].message.content})
        deadline = time.monotonic() + 60
        while not len(served.state.histories):  # the reply's history form is stored after the reply
            assert time.monotonic() < deadline
            time.sleep(0.01)
        served.quiet()
        before = served.metrics()
        other = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Something else entirely."}]
        body = client.chat.completions.create(model="tiny-smol", messages=other, temperature=0, max_tokens=2)
        assert body.usage.prompt_tokens_details.cached_tokens >= len(served.render(other[:1])) // BS * BS - BS
        after = served.metrics()
        assert metric(after, "prefix_cache_short_hits_total", reason="history_mismatch") == \
            metric(before, "prefix_cache_short_hits_total", reason="history_mismatch")
    served.assert_clean()


def test_without_the_precompute_a_drifting_template_stops_short_and_says_why(tmp_path):
    directory = write_model_dir(tmp_path / "tiny-smol", max_positions=2048, chat_template=DRIFT_STRIP_THINK,
                                weights=True)
    served = Served(directory, history_precompute=False)
    try:
        with served.client() as client:
            turns = converse(served, "strip_think", client, turns=3)
        text = served.metrics()
        short = [(cached, ideal) for _, cached, ideal in turns[1:] if cached < ideal]
        assert len(short) == 2  # every later turn recomputes the rewritten reply and all after it
        assert metric(text, "prefix_cache_short_hits_total", reason="not_precomputed") == 2
        assert metric(text, "prefix_cache_short_hit_tokens_total", reason="not_precomputed") == \
            sum(ideal - cached for cached, ideal in short)
        assert metric(text, "history_precompute_tokens_total") == 0
    finally:
        served.stop()


def ids(seed: int, n: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 40000, (n,), generator=g).tolist()


def test_a_session_key_keeps_its_prefix_over_prefixes_without_one(tmp_path):
    """In a pool that must evict, the session with ``prompt_cache_key`` survives a later, larger
    prompt and the request without a hint is evicted; without keys LRU evicts the older one."""
    directory = write_model_dir(tmp_path / "tiny-smol", max_positions=2048, weights=True)
    served = Served(directory, lm_options={"max_cache_tokens": 512})
    a, b, big = ids(1, 160), ids(2, 160), ids(3, 300)
    try:
        with served.client() as client:
            def cached(prompt, **hint) -> int:
                body = client.completions.create(model="tiny-smol", prompt=prompt, max_tokens=2,
                                                 temperature=0, extra_body=hint)
                return body.usage.prompt_tokens_details.cached_tokens

            for hint in ({}, {"prompt_cache_key": "session-a"}, {"prompt_cache_retention": "24h"}):
                served.lm.clear()
                assert cached(a, **hint) == 0 and cached(b) == 0 and cached(big) == 0
                # the survivor is asked first: recomputing the other one evicts again
                if hint:
                    assert cached(a, **hint) >= 144 and cached(b) < 100
                else:  # least recently used first: a goes
                    assert cached(b) >= 144 and cached(a) < 100
            for bad in ({"prompt_cache_retention": "forever"}, {"prompt_cache_retention": 5}):
                with pytest.raises(openai.BadRequestError) as info:
                    client.chat.completions.create(model="tiny-smol", max_tokens=2, prompt_cache_key="s",
                                                   extra_body=bad, messages=[{"role": "user", "content": "x"}])
                assert info.value.param == "prompt_cache_retention"
    finally:
        served.stop()


def test_tenants_with_their_own_keys_never_share_a_block(tmp_path):
    """Issue 33: two keys and no flag: tenant B's request for tenant A's prompt reads 0 cached tokens
    and computes every one of them (the time to first token of a miss: it tells B nothing); a
    request's own ``cache_salt`` narrows sharing within a tenant; ``--share-cache-across-keys``
    shares again."""
    directory = write_model_dir(tmp_path / "tiny-smol", max_positions=2048, weights=True)
    prompt = ids(4, 100)

    def cached(served, key, **extra) -> tuple:
        computed = served.engine.engine.metrics.step_tokens
        with served.client(api_key=key) as client:
            body = client.completions.create(model="tiny-smol", prompt=prompt, max_tokens=4, temperature=0,
                                             extra_body=extra)
        served.quiet()
        return (body.choices[0].text, body.usage.prompt_tokens_details.cached_tokens,
                served.engine.engine.metrics.step_tokens - computed)

    served = Served(directory, api_keys=("key-a", "key-b"))
    try:
        text, first, work = cached(served, "key-a")
        assert first == 0 and work >= len(prompt)
        assert cached(served, "key-a")[:2] == (text, 99)
        again, hit, work = cached(served, "key-b")  # the same prompt, another tenant: computed again
        assert (again, hit) == (text, 0) and work >= len(prompt)
        assert cached(served, "key-a", cache_salt="s1")[1] == 0  # its own salt: a namespace of its own
        assert cached(served, "key-a", cache_salt="s1")[1] == 99
        assert cached(served, "key-b", cache_salt="s1")[1] == 0  # the same salt, another tenant
        with pytest.raises(openai.AuthenticationError):
            cached(served, "key-c")
        with pytest.raises(openai.BadRequestError, match="cache_salt"):
            cached(served, "key-a", cache_salt="")
    finally:
        served.stop()
    served = Served(directory, api_keys=("key-a", "key-b"), share_cache_across_keys=True)
    try:
        cached(served, "key-a")
        assert cached(served, "key-b")[:2] == (text, 99)  # the opt-in: B learns what A sent
    finally:
        served.stop()
