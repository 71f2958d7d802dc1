"""The history work after a reply is off the critical path: the final chunk (and the JSON body) goes
out before the history form is rendered, history work waits behind incoming prompts on the render
thread, it renders the conversation at most twice, and a client that comes back before it is done
waits for its render but never for its compute. The first token goes out before the hit is checked
against the previous turn."""

import asyncio
import threading
import time

import httpx
import pytest

from radixcache.app.demo import build_system_prompt
from radixcache.integrations.serve.requests.chat_template import ChatRenderer
from radixcache.integrations.serve.history.forms import history_after_reply, history_tokens
from radixcache.integrations.serve.history.index import HistoryIndex
from radixcache.integrations.serve.history.work import PendingHistories
from radixcache.integrations.serve.requests.job import Conversation, assistant_message
from radixcache.integrations.serve.requests.render_thread import RenderThread
from serve_helpers import DRIFT_GENERATION_THINK, DRIFT_STRIP_THINK, Served, embedded_tokenizer, write_model_dir

BS = 16
SYSTEM = "You are a helpful agent. Answer briefly and precisely. " * 3
REPLY = "Step one is done: I looked at it closely, found two small issues and fixed them both."


class GatedHistory:
    """Holds every rendering of a conversation that contains ``reply`` (only the history work renders
    one: the prompt never holds its own reply) until ``open()``; ``entered`` once one started."""

    def __init__(self, renderer, monkeypatch, reply: str):
        self.gate, self.entered, self.reply = threading.Event(), threading.Event(), reply
        real = renderer.render_text

        def render_text(messages, tools=None, add_generation_prompt=True):
            if any(m.get("role") == "assistant" and self.reply in (m.get("content") or "") for m in messages):
                self.entered.set()
                assert self.gate.wait(60), "the gate was never opened"
            return real(messages, tools, add_generation_prompt)

        monkeypatch.setattr(renderer, "render_text", render_text)

    def open(self):
        self.gate.set()


class HeldHistoryWork:
    """Holds the history work before it renders (without holding the render thread) until ``open()``."""

    def __init__(self, state, monkeypatch):
        self.gate, self.entered = threading.Event(), threading.Event()
        real = state.render_later

        async def render_later(fn, *args):
            self.entered.set()
            while not self.gate.is_set():
                await asyncio.sleep(0.01)
            return await real(fn, *args)

        monkeypatch.setattr(state, "render_later", render_later)

    def open(self):
        self.gate.set()


class HeldSteps:
    """From now on the engine takes no step until a request that is not a history prefill has been
    added to it: the next turn then always finds the precompute not yet started (without this,
    whether the engine steps between the two submissions is a race)."""

    def __init__(self, served, monkeypatch):
        self.added = threading.Event()
        engine, real_add, real_step = served.engine.engine, served.engine.engine.add, served.engine.engine.step

        def add(valid, fetched=None):
            real_add(valid, fetched)
            if not str(valid.request.request_id).startswith("history"):
                self.added.set()

        def step():
            self.added.wait(30)
            return real_step()

        monkeypatch.setattr(engine, "add", add)
        monkeypatch.setattr(engine, "step", step)

    def wait(self, timeout: float) -> bool:
        return self.added.wait(timeout)


@pytest.fixture
def served(tmp_path, request):
    template = getattr(request, "param", None)
    server = Served(write_model_dir(tmp_path / "tiny-smol", max_positions=2048, chat_template=template,
                                    weights=True))
    yield server
    server.stop()


def ask(served, messages, stream: bool, timeout: float = 20.0) -> tuple[str, int]:
    """(reply text, cached tokens) of one greedy request, read to its very end (``[DONE]``)."""
    body = {"model": "tiny-smol", "messages": messages, "max_tokens": 64, "temperature": 0}
    if not stream:
        out = httpx.post(served.base_url + "/v1/chat/completions", json=body, timeout=timeout).json()
        return out["choices"][0]["message"]["content"], out["usage"]["prompt_tokens_details"]["cached_tokens"]
    import json

    text, cached, done = "", None, False
    with httpx.stream("POST", served.base_url + "/v1/chat/completions", timeout=timeout,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as response:
        for line in response.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                text += "".join(c["delta"].get("content") or "" for c in chunk["choices"])
                if chunk.get("usage"):
                    cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert done
    return text, cached


@pytest.mark.parametrize("stream", [True, False])
def test_the_final_chunk_goes_out_before_the_history_form_is_rendered(served, monkeypatch, stream):
    gated = GatedHistory(served.state.renderer, monkeypatch, REPLY)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Go."}]
    served.say(messages, REPLY)
    try:
        text, _ = ask(served, messages, stream)  # before the fix: no final chunk while the gate holds
        assert text == REPLY
        assert not gated.gate.is_set() and len(served.state.histories) == 0  # its history form is not done
    finally:
        gated.open()
    deadline = time.monotonic() + 30
    while len(served.state.histories) == 0:  # the history work finishes in the background
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert gated.entered.is_set()


@pytest.mark.parametrize("served", [DRIFT_STRIP_THINK], indirect=True)
def test_a_client_back_before_the_history_work_waits_for_its_render_not_its_compute(served, monkeypatch):
    """The reasoning is dropped from the reply's history form, so only the precompute would make it
    a hit. The next request of the same conversation waits for the history work to be rendered and
    submitted (another conversation does not), but not for the engine to compute it: it computes
    the rewritten reply itself in its own step (it waited a whole step before), and its short hit
    is reported as ``not_precomputed``. Once the precompute ran, the form counts as computed."""
    from serve_helpers import metric

    reply = "<think>\nThe user wants step one. Let me check.\n</think>\n" + REPLY
    gated = HeldHistoryWork(served.state, monkeypatch)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Go."}]
    served.say(messages, reply)
    before = metric(served.metrics(), "prefix_cache_short_hits_total", reason="not_precomputed")
    try:
        assert ask(served, messages, stream=True)[0] == reply
        following = messages + [{"role": "assistant", "content": reply}, {"role": "user", "content": "Next."}]
        result = {}
        thread = threading.Thread(target=lambda: result.update(out=ask(served, following, False, timeout=60)))
        thread.start()
        assert gated.entered.wait(30)
        other = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Another session."}]
        served.model.script = {}
        ask(served, other, stream=False)  # not its conversation: it does not wait for the gate
        assert "out" not in result  # the next turn waits for its conversation's history work
        next_turn_added = HeldSteps(served, monkeypatch)  # the precompute must not start before it
    finally:
        gated.open()
    assert next_turn_added.wait(30)
    thread.join(60)
    _, cached = result["out"]
    history = history_tokens(served.state.renderer, messages + [{"role": "assistant", "content": reply}])
    prompt = served.render(following)
    assert prompt[:len(history)] == history and len(history) > len(SYSTEM) // 8
    assert cached < len(history) // BS * BS  # it computed the rewritten reply itself
    assert metric(served.metrics(), "prefix_cache_short_hits_total", reason="not_precomputed") == before + 1
    served.quiet()
    assert served.state.histories.computed(history) is None  # the precompute ran: all of it is computed


def test_prompts_go_ahead_of_history_work_on_the_render_thread():
    thread, order, hold = RenderThread(), [], threading.Event()

    async def run():
        first = asyncio.ensure_future(thread.run(hold.wait))  # occupies the thread
        await asyncio.sleep(0.05)
        later = [asyncio.ensure_future(thread.run_later(order.append, f"history {i}")) for i in range(3)]
        await asyncio.sleep(0.05)
        prompt = asyncio.ensure_future(thread.run(order.append, "prompt"))
        await asyncio.sleep(0.05)
        assert thread.queued == (1, 3)
        hold.set()
        await asyncio.gather(first, prompt, *later)
        with pytest.raises(ZeroDivisionError):  # an exception comes back to the caller
            await thread.run_later(lambda: 1 / 0)

    asyncio.run(run())
    thread.close()
    assert order == ["prompt", "history 0", "history 1", "history 2"]


def test_a_history_a_client_waits_on_goes_ahead_of_every_queued_prompt():
    """Issue 30 item 3: other sessions keep the render thread busy with prompts; a client that comes
    back waits for its own history work (``PendingHistories.wait_for``), which is then promoted:
    it runs right after the job already running, before the prompts queued ahead of it (it used to
    wait behind all of them)."""
    thread, order, hold = RenderThread(), [], threading.Event()
    pending = PendingHistories(thread.promote)
    conversation = Conversation([{"role": "user", "content": "hi"}])
    following = Conversation(conversation.messages + [{"role": "assistant", "content": "yo"},
                                                      {"role": "user", "content": "again"}])

    async def history_work():
        await thread.run_later(order.append, "history")

    async def run():
        busy = asyncio.ensure_future(thread.run(hold.wait))  # occupies the thread
        await asyncio.sleep(0.05)
        task = asyncio.ensure_future(history_work())
        pending.add(task, conversation, None)
        prompts = [asyncio.ensure_future(thread.run(order.append, f"prompt {i}")) for i in range(4)]
        await asyncio.sleep(0.05)
        assert thread.queued == (4, 1)
        waiting = asyncio.ensure_future(pending.wait_for(following, None))
        await asyncio.sleep(0.05)
        assert thread.queued == (5, 0)  # promoted
        hold.set()
        await asyncio.gather(busy, waiting, *prompts)
        # promoted before it queued its job: the job goes ahead at once
        late = asyncio.ensure_future(history_work())
        thread.promote(late)
        hold.clear()
        busy = asyncio.ensure_future(thread.run(hold.wait))
        await asyncio.sleep(0.05)
        prompt = asyncio.ensure_future(thread.run(order.append, "prompt late"))
        await asyncio.sleep(0.05)
        hold.set()
        await asyncio.gather(busy, late, prompt)

    asyncio.run(run())
    thread.close()
    assert order == ["history", "prompt 0", "prompt 1", "prompt 2", "prompt 3", "history", "prompt late"]


class CountingRenderer(ChatRenderer):
    def __init__(self, *args):
        super().__init__(*args)
        self.renders = 0

    def render_text(self, *args, **kwargs):
        self.renders += 1
        return super().render_text(*args, **kwargs)


@pytest.mark.parametrize("template,renders", [(None, 1), (DRIFT_GENERATION_THINK, 2), (DRIFT_STRIP_THINK, 1)])
def test_the_history_form_takes_at_most_two_renders(template, renders):
    renderer = CountingRenderer(embedded_tokenizer(), template)
    system, _ = build_system_prompt(embedded_tokenizer(), 1500)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Weather in Berlin?"}]
    prompt = renderer.render(messages).token_ids
    text = ("<think>\nshort\n</think>\n" if template == DRIFT_STRIP_THINK else "") + REPLY
    generated = list(embedded_tokenizer()(text, add_special_tokens=False)["input_ids"]) + [2]
    renderer.renders = 0
    history = history_after_reply(renderer, messages, None, prompt, generated, assistant_message(text, None))
    assert renderer.renders == renders  # one for the form; one more only to explain a departure in the prompt
    assert (history.divergence is None) == (template is None)


def test_finding_the_previous_turn_among_many_sessions_walks_the_prompt_once(monkeypatch):
    """1,000 sessions behind one 1,500-token system prompt: the lookup compares the prompt against a
    few trie edges, not against every stored form (the old index made one common-prefix scan per
    form); checked by counting the comparisons."""
    import radixcache.integrations.serve.history.index as module

    system = tuple(range(5000, 6500))
    index = HistoryIndex()
    for s in range(1000):
        index.remember(system + (s, s + 1) * 50)
    calls, real = [], module.common_prefix
    monkeypatch.setattr(module, "common_prefix", lambda a, b: calls.append(1) or real(a, b))
    assert index.previous(system + (7, 8) * 50 + (1, 2, 3)) == system + (7, 8) * 50
    assert len(calls) <= 3


def test_the_first_token_goes_out_before_the_hit_is_checked_against_the_previous_turn(served, monkeypatch):
    """Looking up the previous turn's history form (and classifying the hit) is bookkeeping: it
    runs once the first content chunk has gone out. Here the lookup blocks the event loop until the
    client has read that chunk (before the fix it ran before the request was even submitted)."""
    import json

    seen, lookups = threading.Event(), []
    real = served.state.histories.previous

    def previous(*args):
        lookups.append(seen.wait(20))  # False: the client never saw a token while this waited
        return real(*args)

    monkeypatch.setattr(served.state.histories, "previous", previous)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Go."}]
    served.say(messages, REPLY)
    text = ""
    body = {"model": "tiny-smol", "messages": messages, "max_tokens": 64, "temperature": 0, "stream": True}
    with httpx.stream("POST", served.base_url + "/v1/chat/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                text += "".join(c["delta"].get("content") or "" for c in json.loads(line[6:])["choices"])
                if text:
                    seen.set()
    assert text == REPLY and lookups == [True]
