"""The always-on engine a server drives: add at any time, step, events, abort, priorities and
prefill-only requests."""

import threading

import pytest

import radixcache
from radixcache.engine import (FINISH_ABORT, FINISH_LENGTH, FINISH_PREFILLED, FINISH_STOP, Event,
                               Request, SamplingParams)
from tiny_models import plain_greedy, random_ids, tiny_model
from engine_events import drain, tokens_of

BS = 4


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")






def test_requests_join_between_steps_and_finish_with_reasons(model):
    """A request added while another runs joins the batch; every sample ends with one final event
    carrying its reason and the request's cached tokens."""
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=2048)
    engine = lm.new_engine()
    a, b = random_ids(17, 1)[0].tolist(), random_ids(9, 2)[0].tolist()
    engine.add(Request("a", a, SamplingParams(max_new_tokens=6)))
    events = engine.step() + engine.step()
    assert [e.request_id for e in events] == ["a", "a"]
    free_run = plain_greedy(model, b, 6)
    eos = free_run[2]
    engine.add(Request("b", b, SamplingParams(max_new_tokens=6, stop_token_ids={eos})))
    events += drain(engine)
    assert tokens_of(events, "a") == plain_greedy(model, a, 6)
    assert tokens_of(events, "b") == free_run[:free_run.index(eos) + 1]
    finals = {e.request_id: e for e in events if e.finished}
    assert finals["a"].finish_reason == FINISH_LENGTH and finals["b"].finish_reason == FINISH_STOP
    assert sum(e.finished for e in events) == 2 and engine.step() == []
    assert all(isinstance(e, Event) for e in events)


def test_abort_only_queues_and_flush_releases_blocks_at_once(model):
    """abort() only queues (it never touches the cache); flush() between steps then releases the
    request's blocks (what it computed stays cached); the next step reports one "abort" event per
    unfinished sample."""
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=2048)
    engine = lm.new_engine()
    prompt = random_ids(21, 3)[0].tolist()
    engine.add(Request("x", prompt, SamplingParams(max_new_tokens=50, do_sample=True, n=3, seed=1)))
    engine.step()
    engine.step()
    assert lm.cache.pinned_blocks > 0
    pinned = lm.cache.pinned_blocks
    assert engine.abort("x") is True
    assert lm.cache.pinned_blocks == pinned
    assert engine.flush() is True
    assert lm.cache.pinned_blocks == 0 and lm.cache.leaks() == []
    assert lm.stats()["cached_tokens"] >= 20
    events = engine.step()
    assert sorted((e.sample, e.finish_reason) for e in events) == [(i, FINISH_ABORT) for i in range(3)]
    assert not engine.has_work and engine.abort("x") is False


def test_abort_from_another_thread_during_steps(model):
    """abort() while another thread steps: released at the end of that step, nothing leaks."""
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=2048)
    engine = lm.new_engine()
    for i in range(3):
        engine.add(Request(i, random_ids(12, 10 + i)[0].tolist(), SamplingParams(max_new_tokens=40)))
    done = threading.Event()
    events = []

    def loop():
        while engine.has_work:
            events.extend(engine.step())
        done.set()

    worker = threading.Thread(target=loop)
    worker.start()
    for i in range(3):
        engine.abort(i)
    worker.join(timeout=60)
    assert done.is_set()
    assert lm.cache.leaks() == []
    assert {e.request_id for e in events if e.finished} == {0, 1, 2}


def test_lower_priority_value_runs_first(model):
    """With one running slot, the request with the lower priority value is served first."""
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=2048)
    engine = lm.new_engine(max_running=1)
    engine.add(Request("late", random_ids(8, 4)[0].tolist(), SamplingParams(max_new_tokens=2), priority=5))
    engine.add(Request("urgent", random_ids(8, 5)[0].tolist(), SamplingParams(max_new_tokens=2), priority=-1))
    events = drain(engine)
    assert [e.request_id for e in events if e.finished] == ["urgent", "late"]


def test_prefill_only_caches_the_whole_prompt_and_samples_nothing(model):
    """A prefill-only request computes every prompt token into the tree (one "prefilled" event,
    no token); the next turn that extends it computes only its new tokens."""
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=2048)
    engine = lm.new_engine()
    history = random_ids(30, 6)[0].tolist()
    engine.add(Request("h", history, prefill_only=True))
    events = drain(engine)
    assert events == [Event("h", 0, None, True, FINISH_PREFILLED, 0)]
    assert lm.stats()["generated_tokens"] == 0
    turn = history + random_ids(5, 7)[0].tolist()
    engine.add(Request("t", turn, SamplingParams(max_new_tokens=3)))
    events = drain(engine)
    assert events[-1].cached_tokens == 30  # 7 whole blocks and the 2-token tail
    assert tokens_of(events, "t") == plain_greedy(model, turn, 3)


def test_a_request_waiting_on_a_prefill_promotes_it_and_shares_its_blocks(model):
    """A normal request whose prompt shares blocks with a prefill-only request still being
    computed waits for it, promotes it to its own priority (ahead of a long prompt that otherwise
    takes every step's budget) and then matches those blocks: nothing is computed twice."""
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=4096)
    engine = lm.new_engine(max_step_tokens=8)
    history = random_ids(48, 8)[0].tolist()
    engine.add(Request("bulk", random_ids(120, 9)[0].tolist(), SamplingParams(max_new_tokens=2)))
    engine.add(Request("pre", history, prefill_only=True))
    events = engine.step()
    turn = history + random_ids(6, 10)[0].tolist()
    engine.add(Request("turn", turn, SamplingParams(max_new_tokens=2), priority=-1))
    events += drain(engine)
    order = [(e.request_id, e.finished) for e in events]
    assert order.index(("pre", True)) < order.index(("bulk", False))  # before bulk's prompt is done
    turn_final = next(e for e in events if e.request_id == "turn" and e.finished)
    assert turn_final.cached_tokens == 48
    # the ledger counts what clients asked (the background prefill is not a query), the engine
    # every token it computed: each prompt once, and one decode each for bulk's and turn's 2nd token
    assert lm.stats()["computed_prompt_tokens"] == 120 + 6
    assert engine.metrics.step_tokens == 120 + 48 + 6 + 2
    assert tokens_of(events, "turn") == plain_greedy(model, turn, 2)


def test_a_request_is_not_held_back_by_a_prefill_that_has_not_started(model):
    """A prefill-only request and, before any step, a normal request that extends its prompt: the
    normal one does not wait a step for it (it was held back until the prefill-only one had run,
    which put a reply's history precompute on the next turn's critical path). It computes the
    shared blocks itself, from its first step; the prefill-only one waits for it and then finds
    them cached: it computes only its last token again (a match always leaves one to compute)."""
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=4096)
    engine = lm.new_engine(max_step_tokens=64)
    history = random_ids(45, 12)[0].tolist()
    turn = history + random_ids(7, 13)[0].tolist()
    engine.add(Request("pre", history, prefill_only=True))
    engine.add(Request("turn", turn, SamplingParams(max_new_tokens=2)))
    first = engine.step()
    assert [(e.request_id, e.finished) for e in first] == [("turn", False)]  # its first token, at once
    events = first + drain(engine)
    assert next(e for e in events if e.request_id == "turn").cached_tokens == 0
    assert next(e for e in events if e.request_id == "pre").finish_reason == FINISH_PREFILLED
    assert lm.stats()["computed_prompt_tokens"] == len(turn)  # the ledger: the client's request
    assert engine.metrics.step_tokens == len(turn) + 1 + 1  # turn's decode, then pre's last token
    assert tokens_of(events, "turn") == plain_greedy(model, turn, 2)


def test_add_rejects_bad_requests_without_changes(model):
    """Duplicate ids, out-of-vocabulary ids and prompts larger than the pool raise at add()."""
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=64)
    engine = lm.new_engine()
    engine.add(Request(1, [1, 2, 3]))
    with pytest.raises(ValueError, match="already in use"):
        engine.add(Request(1, [4, 5]))
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add(Request(2, [1, 10**6]))
    with pytest.raises(radixcache.OutOfBlocks):
        engine.add(Request(3, [1] * 100))
    with pytest.raises(TypeError):
        engine.add(("not", "a request"))
    with pytest.raises(ValueError):
        Request(4, [])
    drain(engine)
    assert lm.stats()["requests"] == 1


def test_abort_of_one_sample_leaves_the_others_running(model):
    """abort(request_id, sample) stops one sample (a stop string): it gets its "abort" event, its
    blocks go at once, the other samples run to the end; a leader aborted before it forks still
    forks the rest."""
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=2048)
    engine = lm.new_engine()
    prompt = random_ids(13, 11)[0].tolist()
    params = SamplingParams(max_new_tokens=6, do_sample=True, n=3, seed=5)
    engine.add(Request("r", prompt, params))
    events = engine.step()  # the prompt, then three first tokens
    assert engine.abort("r", 1) is True
    events += drain(engine)
    finals = {e.sample: e.finish_reason for e in events if e.finished}
    assert finals == {0: FINISH_LENGTH, 1: FINISH_ABORT, 2: FINISH_LENGTH}
    assert len(tokens_of(events, "r", 0)) == len(tokens_of(events, "r", 2)) == 6
    engine.add(Request("s", prompt, params))
    engine.abort("s", 0)  # before the prompt ran: samples 1 and 2 still come
    events = drain(engine)
    finals = {e.sample: e.finish_reason for e in events if e.finished}
    assert finals == {0: FINISH_ABORT, 1: FINISH_LENGTH, 2: FINISH_LENGTH}
    assert lm.cache.leaks() == [] and not engine.has_work


def test_a_failing_forward_ends_its_requests_with_error_events(model, monkeypatch):
    """The model raising in a step: every request of that step gets "error" events (saying why),
    nothing stays held, last_error keeps the exception, and the engine serves the next request."""
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=2048)
    engine = lm.new_engine()
    engine.add(Request("a", random_ids(9, 12)[0].tolist(), SamplingParams(max_new_tokens=4, n=2,
                                                                          do_sample=True)))
    real = lm.runner.forward

    def broken(*args, **kwargs):
        raise RuntimeError("device fell over")

    monkeypatch.setattr(lm.runner, "forward", broken)
    events = engine.step()
    assert [(e.sample, e.finish_reason) for e in events] == [(0, "error"), (1, "error")]
    assert all("device fell over" in e.error for e in events)
    assert isinstance(engine.last_error, RuntimeError) and not engine.has_work
    assert lm.cache.leaks() == [] and lm.cache.pinned_blocks == 0
    monkeypatch.setattr(lm.runner, "forward", real)
    prompt = random_ids(9, 13)[0].tolist()
    engine.add(Request("b", prompt, SamplingParams(max_new_tokens=3)))
    assert tokens_of(drain(engine), "b") == plain_greedy(model, prompt, 3)


def test_a_request_that_cannot_fit_yet_waits_without_touching_the_cache(model):
    """A waiting request whose first chunk cannot get its blocks while another runs is not admitted
    and backed out on every step (each would match, split, evict or copy a tail, and count a
    query): the tree is queried once per admitted request, and both answers equal plain generate."""
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=64)
    engine = lm.new_engine()
    a, b = random_ids(40, 21)[0].tolist(), random_ids(30, 22)[0].tolist()
    engine.add(Request("a", a, SamplingParams(max_new_tokens=20)))
    events = engine.step()
    queried = lm.cache.stats.queried_tokens
    engine.add(Request("b", b, SamplingParams(max_new_tokens=3)))
    for _ in range(5):
        events += engine.step()
        assert lm.cache.stats.queried_tokens == queried  # "b" waits, untouched
    events += drain(engine)
    assert lm.cache.stats.queried_tokens == queried + len(b) - 1
    assert tokens_of(events, "a") == plain_greedy(model, a, 20)
    assert tokens_of(events, "b") == plain_greedy(model, b, 3)
