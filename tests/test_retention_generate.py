"""Session retention through ``generate`` and ``generate_batch`` (``keep_s=``): a hint never
changes a generated token, and a retained session survives one-shot traffic that LRU would let
evict it."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import radixcache
from tiny_models import plain_greedy, random_ids, tiny_model

BS = 4


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(hints=st.lists(st.sampled_from([None, 0.0, 5.0, 1e6]), min_size=6, max_size=6),
       order=st.permutations(range(6)), batch=st.booleans())
def test_a_retention_hint_never_changes_a_generated_token(model, hints, order, batch):
    """Three sessions of two turns plus one-shot prompts, through a pool small enough to evict,
    with random hints: every reply equals plain greedy generate."""
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=96)
    sessions = [random_ids(18, 40 + s)[0].tolist() for s in range(3)]
    for step in order:
        s, turn = step % 3, step // 3
        prompt = sessions[s] + random_ids(5 + turn, 60 + step)[0].tolist()
        want = plain_greedy(model, prompt, 4)
        if batch:
            got = lm.generate_batch([prompt], max_new_tokens=4, keep_s=hints[step])[0][0]
        else:
            ids = torch.tensor([prompt])
            out = lm.generate(ids, max_new_tokens=4, do_sample=False, keep_s=hints[step])
            got = out[0, len(prompt):].tolist()
        assert got == want
        sessions[s] = prompt + got
    lm.manager.check()


def test_a_retained_session_survives_one_shot_traffic(model):
    """Under LRU the one-shot prompts push the paused session out; with a hint it is still cached
    when it comes back, and its reply is the same."""
    results = {}
    for hint in (None, 60.0):
        lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=128)
        session = random_ids(40, 7)[0].tolist()
        ids = torch.tensor([session])
        lm.generate(ids, max_new_tokens=3, do_sample=False, keep_s=hint)
        for k in range(6):  # one-shot traffic fills the pool
            lm.generate_batch([random_ids(30, 100 + k)[0].tolist()], max_new_tokens=3)
        again = session + [5, 6, 7]
        lm.reset_stats()
        out = lm.generate(torch.tensor([again]), max_new_tokens=3, do_sample=False,
                          return_dict_in_generate=True)
        results[hint] = (out.cached_tokens[0], out.sequences[0, len(again):].tolist())
    assert results[None][0] < 40 <= results[60.0][0], results
    assert results[None][1] == results[60.0][1] == plain_greedy(model, again, 3)


@pytest.mark.parametrize("bad, error", [(-1, ValueError), ("5", TypeError), (True, TypeError),
                                        (float("inf"), ValueError)])
def test_bad_keep_s_is_refused_before_anything_changes(model, bad, error):
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=256)
    prompt = random_ids(10, 3)[0].tolist()
    with pytest.raises(error):
        lm.generate(torch.tensor([prompt]), max_new_tokens=2, keep_s=bad)
    with pytest.raises(error):
        lm.generate_batch([prompt], max_new_tokens=2, keep_s=bad)
    assert lm.stats()["requests"] == 0 and lm.stats()["cached_tokens"] == 0
