"""The engine's scheduling without a model: a ``StubRunner`` whose next token depends on every
cached K/V, so admission, chunked prefill, sharing, preemption, priorities, forks and failures are
tested in milliseconds and any wrong cache content shows as a token ``reference`` does not expect."""

import random
from array import array

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixcache.engine import (FINISH_ABORT, FINISH_ERROR, FINISH_LENGTH, FINISH_PREFILLED,
                               FINISH_STOP, Request, SamplingParams)
from radixcache.engine.stub import StubRunner, next_token, reference, stub_engine
from engine_events import drain, tokens_of

BS = 4
V = 997


def ids(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(1, V) for _ in range(n)]






def finals(events):
    return [(e.request_id, e.finish_reason) for e in events if e.finished]


def test_the_stub_reads_back_every_cached_position():
    """Sanity of the instrument: the stub's tokens are ``next_token`` of the K/V it reads, so a
    prompt run twice (the second time from the cache) gives the reference both times."""
    engine = stub_engine(64, BS)
    prompt = ids(23, 1)
    for rid in ("cold", "warm"):
        engine.add(Request(rid, prompt, SamplingParams(max_new_tokens=6)))
        assert tokens_of(drain(engine), rid) == reference(prompt, 6, V)
    assert engine.manager.stats()["hit_tokens"] == 22
    assert next_token([1, 2, 3], V) != next_token([1, 3, 2], V)


def test_shared_prefixes_are_computed_once_and_outputs_exact():
    """A batch behind one system prompt: every output is the reference, the system prompt's whole
    blocks are computed once (counted in the forwards the stub saw)."""
    engine = stub_engine(256, BS, max_step_tokens=64)
    system = ids(40, 2)
    prompts = [system + ids(3 + i, 10 + i) for i in range(6)]
    for i, p in enumerate(prompts):
        engine.add(Request(i, p, SamplingParams(max_new_tokens=5)))
    events = drain(engine)
    for i, p in enumerate(prompts):
        assert tokens_of(events, i) == reference(p, 5, V)
    computed = sum(len(t) for t, _ in engine.runner.calls)
    own = sum(len(p) for p in prompts) - 5 * 40  # five of them found the system prompt cached
    assert computed == own + 6 * 4  # plus four decode tokens each
    assert engine.manager.leases() == ()


def test_preemption_under_a_tight_pool_keeps_every_output_exact():
    """Room for about two sequences: requests are preempted and resumed, outputs stay exact, each
    prompt is counted once."""
    engine = stub_engine(24, BS, max_step_tokens=16)
    prompts = [ids(20 + i, 30 + i) for i in range(5)]
    for i, p in enumerate(prompts):
        engine.add(Request(i, p, SamplingParams(max_new_tokens=30)))
    events = drain(engine)
    stats = engine.manager.stats()
    assert stats["preemptions"] > 0
    assert stats["queried_tokens"] == sum(map(len, prompts))
    for i, p in enumerate(prompts):
        assert tokens_of(events, i) == reference(p, 30, V)
    engine.manager.check()


def test_lower_priority_value_runs_first_and_starvation_is_bounded():
    """One slot: priority -1 before 0 before 5; within a priority, arrival order (FCFS)."""
    engine = stub_engine(64, BS, max_running=1, schedule="fcfs")
    for rid, prio in (("late", 5), ("a", 0), ("urgent", -1), ("b", 0)):
        engine.add(Request(rid, ids(6, hash(rid) % 100), SamplingParams(max_new_tokens=2),
                           priority=prio))
    assert [rid for rid, _ in finals(drain(engine))] == ["urgent", "a", "b", "late"]


def test_longest_cached_prefix_goes_first():
    """LPM: with one slot, the waiting request with the most cached tokens is admitted first."""
    engine = stub_engine(128, BS, max_running=1)
    cached = ids(24, 3)
    engine.add(Request("warm-up", cached + [5], SamplingParams(max_new_tokens=1)))
    drain(engine)
    engine.add(Request("cold", ids(25, 4), SamplingParams(max_new_tokens=1)))
    engine.add(Request("warm", cached + ids(2, 5), SamplingParams(max_new_tokens=1)))
    assert [rid for rid, _ in finals(drain(engine))] == ["warm", "cold"]


def test_a_request_sharing_a_running_prefill_waits_and_matches_it():
    """A request whose prompt shares uncached blocks with a prompt still being prefilled (chunk
    by chunk) waits for it and then matches those blocks: computed once, counted as cached."""
    engine = stub_engine(256, BS, max_step_tokens=8)
    history = ids(40, 6)
    engine.add(Request("first", history + [1], SamplingParams(max_new_tokens=2)))
    engine.step()
    engine.add(Request("second", history + [2, 3], SamplingParams(max_new_tokens=2)))
    events = drain(engine)
    second = next(e for e in events if e.request_id == "second" and e.finished)
    assert second.cached_tokens == 40
    assert tokens_of(events, "second") == reference(history + [2, 3], 2, V)
    assert engine.manager.stats()["computed_prompt_tokens"] == 41 + 2


def test_prefill_only_is_promoted_by_a_request_that_waits_on_it():
    """A prefill-only request runs behind everything unless a normal request waits on its blocks:
    then it is promoted, and the normal request counts them as cached."""
    engine = stub_engine(512, BS, max_step_tokens=8)
    history = ids(48, 7)
    engine.add(Request("bulk", ids(120, 8), SamplingParams(max_new_tokens=2)))
    engine.add(Request("pre", history, prefill_only=True))
    events = engine.step()
    turn = history + ids(6, 9)
    engine.add(Request("turn", turn, SamplingParams(max_new_tokens=2), priority=-1))
    events += drain(engine)
    order = [(e.request_id, e.finished) for e in events]
    assert ("pre", True) in order and order.index(("pre", True)) < order.index(("bulk", False))
    assert (("pre", FINISH_PREFILLED) in finals(events))
    assert next(e for e in events if e.request_id == "turn" and e.finished).cached_tokens == 48
    assert tokens_of(events, "turn") == reference(turn, 2, V)


def test_stop_ids_samples_abort_and_length():
    """Stop ids end a sample with "stop" (the token included); n samples fork after the prompt;
    abort ends a request at once; a sample outgrowing the pool ends with "length"."""
    engine = stub_engine(16, BS)
    prompt = ids(10, 10)
    free = reference(prompt, 8, V)
    engine.add(Request("s", prompt, SamplingParams(max_new_tokens=8, stop_token_ids={free[3]})))
    events = drain(engine)
    assert tokens_of(events, "s") == free[:4] and finals(events) == [("s", FINISH_STOP)]
    engine.add(Request("n", prompt, SamplingParams(max_new_tokens=4, n=3, do_sample=True, seed=1)))
    events = drain(engine)
    assert sorted(e.sample for e in events if e.finished) == [0, 1, 2]
    assert all(tokens_of(events, "n", i) == free[:4] for i in range(3))  # one-hot logits
    engine.add(Request("a", prompt, SamplingParams(max_new_tokens=50)))
    engine.step()
    assert engine.abort("a") and finals(engine.step()) == [("a", FINISH_ABORT)]
    engine.add(Request("long", prompt, SamplingParams(max_new_tokens=100)))
    events = drain(engine)
    assert finals(events) == [("long", FINISH_LENGTH)]
    assert tokens_of(events, "long") == reference(prompt, len(tokens_of(events, "long")), V)
    assert engine.manager.leases() == ()


def test_a_failing_forward_ends_its_requests_and_keeps_the_cache_sound():
    engine = stub_engine(128, BS, max_step_tokens=8)
    prompt = ids(30, 11)
    engine.add(Request("x", prompt, SamplingParams(max_new_tokens=4)))
    engine.runner.fail_at = 3
    events = drain(engine)
    assert finals(events) == [("x", FINISH_ERROR)] and "on purpose" in events[-1].error
    engine.manager.check()
    engine.add(Request("y", prompt, SamplingParams(max_new_tokens=4)))
    assert tokens_of(drain(engine), "y") == reference(prompt, 4, V)


def test_a_prompt_that_fits_the_pool_is_served():
    """Issue 17 item 5: a prompt whose blocks fit the whole pool is served (no block to spare is
    asked for): 10 tokens in 3 blocks of 4."""
    engine = stub_engine(3, BS)
    prompt = ids(10, 12)
    engine.add(Request("p", prompt, SamplingParams(max_new_tokens=2)))
    assert tokens_of(drain(engine), "p") == reference(prompt, 2, V)
    engine.add(Request("q", ids(12, 13), SamplingParams(max_new_tokens=4)))
    events = drain(engine)
    assert finals(events) == [("q", FINISH_LENGTH)] and len(tokens_of(events, "q")) == 1
    with pytest.raises(Exception, match="does not fit"):
        engine.add(Request("r", ids(13, 14)))


def test_stop_ids_outside_the_vocabulary_are_refused_by_name():
    engine = stub_engine(16, BS)
    with pytest.raises(ValueError, match=r"stop token ids \[1000000000\] are outside"):
        engine.add(Request("x", [1, 2], SamplingParams(stop_token_ids={3, 10**9})))
    assert not engine.has_work


def test_request_prompt_is_an_array_of_its_own():
    """Tokens end to end: a Request packs its prompt once into an array('I') of its own (lists,
    tuples, arrays and 1-D tensors accepted); the engine's sequences carry arrays."""
    torch = pytest.importorskip("torch")
    given = array("I", [1, 2, 3])
    for prompt in ([1, 2, 3], (1, 2, 3), given, torch.tensor([1, 2, 3])):
        r = Request("r", prompt)
        assert type(r.prompt) is array and r.prompt.typecode == "I" and list(r.prompt) == [1, 2, 3]
    assert Request("r", given).prompt is not given
    with pytest.raises(ValueError):
        Request("r", [1, -2])
    with pytest.raises(TypeError):
        Request("r", [1, 2.5])
    engine = stub_engine(16, BS)
    engine.add(Request("x", [1, 2, 3, 4, 5], SamplingParams(max_new_tokens=3)))
    engine.step()
    seq = engine.scheduler.running[0]
    assert type(seq.tokens) is array and len(seq.tokens) == 6
    drain(engine)


def count_peeks(engine):
    tree = engine.manager.tree
    calls = [0]
    real = tree.peek

    def peek(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    tree.peek = peek
    return calls


def test_no_peeks_while_every_slot_is_taken():
    """With every slot taken, a step ranks nobody: no tree peek at all for the waiting ones."""
    engine = stub_engine(512, BS, max_running=2)
    for i in range(12):
        engine.add(Request(i, ids(20, 40 + i), SamplingParams(max_new_tokens=30)))
    engine.step()
    engine.step()
    calls = count_peeks(engine)
    for _ in range(5):
        engine.step()
    assert len(engine.scheduler.waiting) == 10 and calls[0] == 0
    for i in range(12):
        engine.abort(i)
    drain(engine)


def test_a_waiting_request_is_peeked_again_only_when_the_tree_may_have_changed_it():
    """Decodes insert blocks every few steps, none of which a waiting prompt can match: after its
    first ranking a waiting request is not peeked again until something could have changed its
    cached prefix (a prompt of its own being inserted)."""
    engine = stub_engine(512, BS, max_running=3)
    for i in range(3):
        engine.add(Request(("run", i), ids(8, 50 + i), SamplingParams(max_new_tokens=40)))
    engine.step()
    for i in range(4):  # more waiting than slots free up, so admission ranks them every step
        engine.add(Request(("wait", i), ids(30, 60 + i), SamplingParams(max_new_tokens=2),
                           priority=1))
    engine.step()
    calls = count_peeks(engine)
    engine.scheduler.max_running = 4  # a free slot: every step ranks the waiting ones
    engine.add(Request("blocker", ids(600, 70), SamplingParams(max_new_tokens=2), priority=-5))
    engine.step()  # the blocker is admitted (peeked once), the waiting ones are ranked
    first = calls[0]
    for _ in range(12):  # decodes commit blocks; the waiting prompts share nothing with them
        engine.step()
    assert engine.manager.tree.changes.epoch > 0 and calls[0] == first
    for rid in [("run", i) for i in range(3)] + [("wait", i) for i in range(4)] + ["blocker"]:
        engine.abort(rid)
    drain(engine)


def exact_order(sched):
    """The admission order computed the slow way: a fresh peek of every waiting sequence."""
    tree, rounds = sched.manager.tree, sched.starvation_rounds
    cached = {id(s): tree.peek(s.tokens[:-1], s.live.namespace) for s in sched.waiting}
    return sorted(sched.waiting, key=lambda s: (s.live.priority, s.passed_over < rounds,
                                                -cached[id(s)], s.arrival))


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 30), st.integers(1, 12),
                          st.integers(0, 2)), min_size=3, max_size=14),
       st.integers(12, 60), st.integers(1, 4))
def test_lazy_lpm_order_equals_the_exact_one_and_outputs_stay_exact(specs, blocks, slots):
    """Random requests (a few shared prefixes, lengths, priorities) on a small pool with few
    slots: at every step the scheduler's lazily ranked order (cached peeks carried across the
    tree's changes) equals a fresh exact ranking, and every output is the reference."""
    engine = stub_engine(blocks, BS, max_running=slots, max_step_tokens=12)
    bases = [ids(24, 100 + b) for b in range(4)]
    want = {}
    for i, (base, cut, new, prio) in enumerate(specs):
        prompt = bases[base][:cut] + ids(3, 200 + i)
        if -(-len(prompt) // BS) > blocks:
            continue
        engine.add(Request(i, prompt, SamplingParams(max_new_tokens=new), priority=prio))
        want[i] = reference(prompt, new, V)
    events = []
    for _ in range(3000):
        if not engine.has_work:
            break
        sched = engine.scheduler
        if sched.waiting and sched.schedule == "lpm":
            expected = exact_order(sched)
            assert list(sched._in_order()) == expected
        events.extend(engine.step())
    assert not engine.has_work
    for i, tokens in want.items():
        got = tokens_of(events, i)
        assert got == tokens[:len(got)] and (len(got) == len(tokens) or
                                             (i, FINISH_LENGTH) in finals(events))
    engine.manager.check()


def test_stub_runner_is_a_model_runner():
    runner = StubRunner(50, read_kv=False)
    assert runner.vocab_size == 50 and runner.model_id == "stub"
