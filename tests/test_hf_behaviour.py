"""The wrapper's generate options, fallbacks and failure safety (one family: Llama)."""

import logging

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

import radixcache
from radixcache import OutOfBlocks
from tiny_models import VOCAB, random_ids, tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture
def lm(model):
    return radixcache.wrap(model, block_size=4, max_cache_tokens=1024)


def snapshot(lm):
    alloc = lm.manager.allocator
    return ([alloc.refcount(b) for b in range(alloc.num_blocks)], lm.cache.cached_blocks,
            lm.cache.pinned_blocks, lm.stats()["requests"])


def warm(lm):
    lm.generate(random_ids(20, 1), max_new_tokens=3, do_sample=False)


class Recorder(BaseStreamer):
    def __init__(self):
        self.chunks = []

    def put(self, value):
        self.chunks.append(value.tolist())

    def end(self):
        self.chunks.append("end")


class Ban(LogitsProcessor):
    def __init__(self, token):
        self.token = token

    def __call__(self, input_ids, scores):
        scores[:, self.token] = -float("inf")
        return scores


class Boom(LogitsProcessor):
    def __call__(self, input_ids, scores):
        raise RuntimeError("boom")


class StopAfter(StoppingCriteria):
    def __init__(self, length):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)


def test_streamer_processors_stopping_and_eos_match_plain(model, lm):
    """Streamers see the same chunks; logits processors, stopping criteria and eos behave as plain."""
    ids = random_ids(18, 2)
    mask = torch.ones_like(ids)
    warm(lm)
    for kwargs in [dict(logits_processor=LogitsProcessorList([Ban(5), Ban(7)])),
                   dict(stopping_criteria=StoppingCriteriaList([StopAfter(22)])),
                   dict(eos_token_id=int(model.generate(ids, attention_mask=mask, max_new_tokens=3,
                                                        do_sample=False)[0, -1]))]:
        want = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, **kwargs)
        got = lm.generate(ids, max_new_tokens=8, do_sample=False, **kwargs)
        assert torch.equal(want, got), kwargs
    s1, s2 = Recorder(), Recorder()
    model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, streamer=s1)
    lm.generate(ids, max_new_tokens=5, do_sample=False, streamer=s2)
    assert s1.chunks == s2.chunks


def test_sampling_with_seed_matches_plain(model, lm):
    """Sampling consumes the RNG exactly like plain generate: same seed, same tokens."""
    ids = random_ids(25, 3)
    warm(lm)
    torch.manual_seed(123)
    want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10,
                          do_sample=True, top_k=0, temperature=0.9)
    torch.manual_seed(123)
    got = lm.generate(ids, max_new_tokens=10, do_sample=True, top_k=0, temperature=0.9)
    assert torch.equal(want, got)


def test_return_dict_and_max_length(model, lm):
    """return_dict_in_generate gives the same type; max_length works like max_new_tokens."""
    ids = random_ids(12, 4)
    out = lm.generate(ids, max_length=20, do_sample=False, return_dict_in_generate=True)
    want = model.generate(ids, attention_mask=torch.ones_like(ids), max_length=20, do_sample=False,
                          return_dict_in_generate=True)
    assert type(out) is type(want) and torch.equal(out.sequences, want.sequences)


@pytest.mark.parametrize("kwargs, reason", [
    (dict(num_beams=2), "beam search"),
    (dict(num_return_sequences=2, do_sample=True), "num_return_sequences > 1"),
])
def test_unsupported_modes_fall_back_with_one_warning(model, lm, kwargs, reason, caplog):
    """Beam search etc. fall back to plain generate: right answer, one warning, a counter."""
    ids = random_ids(15, 5)
    with caplog.at_level(logging.WARNING, logger="radixcache"):
        for _ in range(2):
            torch.manual_seed(0)
            got = lm.generate(ids, max_new_tokens=4, **kwargs)
    torch.manual_seed(0)
    want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, **kwargs)
    assert torch.equal(got, want)
    assert lm.stats()["fallbacks"] == 2 and lm.stats()["fallback_reasons"] == {reason: 2}
    assert sum(reason in r.message for r in caplog.records) == 1


@pytest.mark.parametrize("flags", [dict(output_attentions=True), dict(output_hidden_states=True),
                                   dict(output_attentions=True, output_hidden_states=True)])
def test_attentions_and_hidden_states_fall_back_whole(flags, caplog):
    """The paged path never computes a cached prefix's attentions or hidden states (nor, with
    radixcache's attention, any attention weights): asked for them in a dict output, generate
    falls back with one warning and returns plain generate's, whole, cold and warm."""
    model = tiny_model("llama")
    model.set_attn_implementation("eager")  # the implementation that returns attention weights
    lm = radixcache.wrap(model, block_size=4, max_cache_tokens=1024)
    ids = random_ids(30, 11)
    kwargs = dict(max_new_tokens=3, do_sample=False, return_dict_in_generate=True, **flags)
    want = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    assert lm.generate(ids, max_new_tokens=3, do_sample=False).shape[1] == 33  # cached: warm
    with caplog.at_level(logging.WARNING, logger="radixcache"):
        for _ in range(2):
            got = lm.generate(ids, **kwargs)
            for name, per_step in (("attentions", 2), ("hidden_states", 3)):  # 2 layers (+ embeddings)
                assert (getattr(got, name) is None) == (getattr(want, name) is None)
                steps_got, steps_want = getattr(got, name) or (), getattr(want, name) or ()
                assert len(steps_got) == len(steps_want)
                for step_got, step_want in zip(steps_got, steps_want):
                    assert len(step_got) == len(step_want) == per_step
                    assert all(torch.equal(g, w) for g, w in zip(step_got, step_want))
    assert want.attentions is None or want.attentions[0][0].shape == (1, 4, 30, 30)
    assert want.hidden_states is None or want.hidden_states[0][-1].shape == (1, 30, 64)
    assert torch.equal(got.sequences, want.sequences)
    reason = "output_attentions / output_hidden_states"
    assert lm.stats()["fallback_reasons"] == {reason: 2}
    assert sum(reason in r.message for r in caplog.records) == 1
    plain_tokens = lm.generate(ids, max_new_tokens=3, do_sample=False, **flags)  # not returned: paged
    assert torch.equal(plain_tokens, want.sequences) and lm.stats()["fallbacks"] == 2


def test_right_padding_falls_back(model, lm):
    """A right-padded mask is served by plain generate (which owns its semantics)."""
    ids = random_ids(10, 6, batch=2)
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0
    got = lm.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    assert torch.equal(got, model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False))
    assert lm.stats()["fallbacks"] == 1


def test_model_with_non_attention_layers_falls_back():
    """A model declaring layers that keep no K/V is never served by the paged path."""
    model = tiny_model("llama")
    model.config.layer_types = ["full_attention", "linear_attention"]
    lm = radixcache.wrap(model, block_size=4, max_cache_tokens=256)
    del model.config.layer_types  # plain generate must still run the real (all-attention) model
    assert "linear_attention" in lm.unsupported
    ids = random_ids(9, 7)
    assert torch.equal(lm.generate(ids, max_new_tokens=3, do_sample=False),
                       model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3,
                                      do_sample=False))
    assert lm.stats()["fallbacks"] == 1 and lm.cache.cached_blocks == 0


def test_model_whose_attention_ignores_the_cache_fails_self_test():
    """If a model's attention does not read the cache, the self-test catches it: fallback, not a wrong answer."""
    model = tiny_model("llama")
    for layer in model.model.layers:
        attn = layer.self_attn
        original = attn.forward

        def forward(*args, _original=original, **kwargs):
            kwargs.pop("past_key_values", None)
            kwargs.pop("cache", None)
            return _original(*args, **kwargs)

        attn.forward = forward
    lm = radixcache.wrap(model, block_size=4, max_cache_tokens=256)
    assert lm.unsupported and "self-test" in lm.unsupported


@pytest.mark.parametrize("bad, kwargs, error", [
    (torch.zeros((1, 0), dtype=torch.long), {}, ValueError),
    (torch.tensor([[1, 2, VOCAB]]), {}, ValueError),
    (torch.tensor([[1, -1, 2]]), {}, ValueError),
    (torch.tensor([[1.0, 2.0]]), {}, TypeError),
    (torch.tensor([[1, 2, 3]]), dict(attention_mask=torch.ones((1, 4), dtype=torch.long)), ValueError),
    (torch.tensor([[1, 2, 3]]), dict(attention_mask=torch.tensor([[0, 2, 1]])), ValueError),
    (torch.tensor([[1, 2, 3]]), dict(attention_mask=torch.tensor([[0, 0, 0]])), ValueError),
    (torch.tensor([[1, 2, 3]]), dict(cache_salt=5), TypeError),
    ([["a", "b"]], {}, TypeError),
])
def test_bad_input_raises_before_any_change(lm, bad, kwargs, error):
    """Bad input gets a clear exception and leaves the cache exactly as it was."""
    warm(lm)
    before = snapshot(lm)
    with pytest.raises(error):
        lm.generate(bad, max_new_tokens=2, **kwargs)
    assert snapshot(lm) == before
    lm.cache.check()


def test_exception_inside_generate_leaves_nothing_pinned_or_leaked(lm):
    """A logits processor that raises: the error propagates, nothing stays pinned or leaked."""
    warm(lm)
    before = snapshot(lm)
    ids = torch.cat([random_ids(20, 1), random_ids(6, 8)], dim=1)
    with pytest.raises(RuntimeError, match="boom"):
        lm.generate(ids, max_new_tokens=4, do_sample=False, logits_processor=LogitsProcessorList([Boom()]))
    assert lm.cache.pinned_blocks == 0
    assert snapshot(lm)[1:3] == before[1:3]
    assert lm.cache.leaks() == []
    lm.cache.check()


def test_a_stopping_criteria_that_is_not_a_list_raises_holding_nothing(lm):
    """A single StoppingCriteria object (not a list) fails before any lease is taken: nothing stays
    pinned, held or running."""
    ids = random_ids(20, 3)
    with pytest.raises(TypeError):
        lm.generate(ids, max_new_tokens=2, do_sample=False, stopping_criteria=NeverStop())
    assert lm.cache.pinned_blocks == 0 and lm.stats()["running"] == 0
    assert lm.cache.leaks() == []
    lm.manager.check()


class NeverStop(StoppingCriteria):
    def __call__(self, input_ids, scores, **kwargs):
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def test_prompt_larger_than_the_pool_raises_out_of_blocks_and_evicts_nothing(model):
    """A prompt the whole pool cannot hold raises OutOfBlocks before computing anything: no block
    is evicted, nothing leaks."""
    lm = radixcache.wrap(model, block_size=4, max_cache_tokens=64)
    warm(lm)
    before = snapshot(lm)
    with pytest.raises(OutOfBlocks, match="max_cache_tokens"):
        lm.generate(random_ids(80, 9), max_new_tokens=10, do_sample=False)
    assert snapshot(lm)[:3] == before[:3]
    lm.cache.check()


def test_cache_salt_isolates_tenants(model, lm):
    """Different salts never share blocks; the same salt hits."""
    ids = random_ids(24, 10)
    lm.generate(ids, max_new_tokens=2, do_sample=False, cache_salt="alice")
    lm.generate(ids, max_new_tokens=2, do_sample=False, cache_salt="bob")
    assert lm.stats()["hit_tokens"] == 0
    lm.generate(ids, max_new_tokens=2, do_sample=False, cache_salt="alice")
    assert lm.stats()["hit_tokens"] == 23  # all but the last token: 5 blocks + 3 of the 6th


def test_clear_and_stats(lm):
    """clear() drops every unpinned prefix; stats reports sizes in tokens."""
    warm(lm)
    stats = lm.stats()
    assert stats["cached_tokens"] > 0 and stats["capacity_tokens"] == 1024
    lm.clear()
    assert lm.stats()["cached_tokens"] == 0 and lm.stats()["free_tokens"] == 1024


def test_wrap_rejects_bad_arguments(model):
    """wrap() validates its arguments."""
    with pytest.raises(ValueError):
        radixcache.wrap(model, block_size=0)
    with pytest.raises(ValueError):
        radixcache.wrap(model, max_cache_tokens=2, block_size=4)
    with pytest.raises(ValueError):
        radixcache.wrap(model, attention="magic")
    with pytest.raises(ValueError):
        radixcache.wrap(model, kv_dtype="int3")
    with pytest.raises(TypeError):
        radixcache.wrap(object())
