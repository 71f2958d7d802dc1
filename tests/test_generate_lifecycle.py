"""lm.generate on the cache manager: regression tests for problems 1-5 of issue 8 (returned cache,
transformers' length rules, lazy growth, admission failures, inputs users pass)."""

import logging
import warnings
from contextlib import contextmanager

import pytest
import torch
from transformers import BatchEncoding

import radixcache
from radixcache import CacheError, OutOfBlocks
from tiny_models import random_ids, tiny_model

BS = 4


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def plain(model, ids, mask=None, **kw):
    mask = torch.ones_like(ids) if mask is None else mask
    return model.generate(ids, attention_mask=mask, do_sample=False, **kw)


def eos_after(model, ids, k):
    """A token id that greedy generation from ``ids`` produces as its k-th new token (first time)."""
    run = plain(model, ids, max_new_tokens=k + 1)[0, ids.shape[1]:].tolist()
    return run[k] if run[k] not in run[:k] else eos_after(model, ids, k + 1)


# --------------------------------------------------------------------- 1. the returned cache
@pytest.mark.parametrize("argument", ["past_key_values", "cache"])
def test_returned_cache_passed_back_continues_exactly(model, argument):
    """The PagedCache in a dict output is released with the call: passed back, it is recognised
    and the tree serves the prefix; another prompt's blocks are never overwritten."""
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=1024)
    ids = random_ids(21, 1)
    eos = eos_after(model, ids, 6)
    r = lm.generate(ids, max_new_tokens=200, eos_token_id=eos, return_dict_in_generate=True)
    assert r.sequences.shape[1] < 21 + 200  # stopped at EOS
    other = random_ids(30, 2)
    first_other = lm.generate(other, max_new_tokens=8, do_sample=False)
    turn = torch.cat([r.sequences, random_ids(7, 3)], dim=1)
    lm.reset_stats()
    got = lm.generate(turn, max_new_tokens=8, do_sample=False, eos_token_id=eos,
                      **{argument: r.cache})
    assert torch.equal(got, plain(model, turn, max_new_tokens=8, eos_token_id=eos))
    assert lm.stats()["hit_tokens"] >= r.sequences.shape[1] - 1 and lm.stats()["fallbacks"] == 0
    assert torch.equal(lm.generate(other, max_new_tokens=8, do_sample=False), first_other)
    assert torch.equal(first_other, plain(model, other, max_new_tokens=8))
    lm.cache.check()


@contextmanager
def nothing_warned():
    """Fails when Python warnings or transformers' logger warn inside (radixcache's own fallback
    warning goes to the ``radixcache`` logger and is not counted)."""
    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    root = logging.getLogger("transformers")
    logging.Logger.warning_once.cache_clear()  # transformers says a deprecation once per process
    root.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
    finally:
        root.removeHandler(handler)
    assert [str(w.message) for w in caught] == [] and [r.getMessage() for r in records] == []


@pytest.mark.parametrize("argument", ["cache", "past_key_values"])
def test_a_cache_passed_under_either_name_warns_nothing(model, argument):
    """``cache=`` (transformers' name) and ``past_key_values=`` (its deprecated one) are accepted
    alike, ours or the caller's own (plain generate serves that one) or None, without a warning."""
    from transformers import DynamicCache

    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=1024)
    ids = random_ids(14, 21)
    with nothing_warned():
        r = lm.generate(ids, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
        turn = torch.cat([r.sequences, random_ids(5, 22)], dim=1)
        got = lm.generate(turn, max_new_tokens=3, do_sample=False, **{argument: r.cache})
        mine = DynamicCache(config=model.config)
        own = lm.generate(ids, max_new_tokens=3, do_sample=False, **{argument: mine})
        none = lm.generate(ids, max_new_tokens=3, do_sample=False, **{argument: None})
    assert torch.equal(got, plain(model, turn, max_new_tokens=3))
    assert torch.equal(own, plain(model, ids, max_new_tokens=3)) and mine.get_seq_length() == 16
    assert torch.equal(none, own)
    assert lm.stats()["fallback_reasons"] == {"caller passed its own cache": 1}


def test_two_different_caches_are_refused(model):
    from transformers import DynamicCache

    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=512)
    with pytest.raises(ValueError, match="pass one cache"):
        lm.generate(random_ids(6, 1), max_new_tokens=2, cache=DynamicCache(config=model.config),
                    past_key_values=DynamicCache(config=model.config))
    assert lm.stats()["fallbacks"] == 0 and lm.stats()["requests"] == 0


def test_released_cache_refuses_any_other_use(model):
    """Plain model.generate with a released PagedCache raises CacheError (never wrong K/V)."""
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=512)
    r = lm.generate(random_ids(10, 4), max_new_tokens=3, return_dict_in_generate=True)
    with pytest.raises(CacheError, match="released"):
        model.generate(r.sequences, cache=r.cache, max_new_tokens=2)
    other = radixcache.wrap(model, block_size=BS, max_cache_tokens=512)
    with pytest.raises(ValueError, match="another radixcache wrapper"):
        other.generate(r.sequences, past_key_values=r.cache, max_new_tokens=2)


def test_cached_tokens_per_row_on_dict_outputs(model):
    """return_dict_in_generate outputs carry cached_tokens per row (usage.cached_tokens)."""
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=1024)
    ids = random_ids(23, 5)
    first = lm.generate(ids, max_new_tokens=3, return_dict_in_generate=True)
    assert first.cached_tokens == [0]
    # the next turn extends what was computed (23 + 2 fed tokens): 6 whole blocks + a 1-token tail
    turn = torch.cat([first.sequences, random_ids(5, 6)], dim=1)
    again = lm.generate(turn, max_new_tokens=3, return_dict_in_generate=True)
    assert again.cached_tokens == [25]
    batch = lm.generate(torch.cat([turn, turn]), attention_mask=torch.ones(2, 31, dtype=torch.long),
                        max_new_tokens=1, return_dict_in_generate=True)
    assert batch.cached_tokens == [30, 30]  # 7 whole blocks + 2 tokens of a diverging block


# --------------------------------------------------------------------- 2. transformers' length rules
@pytest.mark.parametrize("length", [10, 25])
def test_no_max_new_tokens_follows_transformers(model, length):
    """Without a length, transformers' own rule applies (20 new tokens) and the cache is used."""
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=1024)
    ids = random_ids(length, 6)
    want = plain(model, ids)
    assert torch.equal(lm.generate(ids), want)
    assert torch.equal(lm.generate(ids), want)
    stats = lm.stats()
    assert stats["fallbacks"] == 0 and stats["hit_tokens"] == length - 1


def test_max_length_is_a_total_length(model):
    """max_length counts the prompt, as in transformers."""
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=1024)
    ids = random_ids(12, 7)
    assert torch.equal(lm.generate(ids, max_length=17), plain(model, ids, max_length=17))


# --------------------------------------------------------------------- 3. lazy growth
def test_huge_max_new_tokens_grows_lazily(model):
    """max_new_tokens=10**6 in a 256-token pool: no OutOfBlocks, the reply stops at EOS."""
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=256)
    ids = random_ids(20, 8)
    eos = eos_after(model, ids, 5)
    got = lm.generate(ids, max_new_tokens=10**6, eos_token_id=eos)
    assert torch.equal(got, plain(model, ids, max_new_tokens=30, eos_token_id=eos))


def test_a_request_that_fits_never_evicts_for_tokens_it_does_not_generate(model):
    """In a 1,024-token pool holding 288 cached tokens, max_new_tokens=900 with a 10-token reply
    evicts nothing."""
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=1024)
    for seed in range(4):
        lm.generate(random_ids(70, 20 + seed), max_new_tokens=3)
    assert lm.stats()["cached_tokens"] == 288
    evicted = lm.stats()["evicted_tokens"]
    ids = random_ids(30, 9)
    eos = eos_after(model, ids, 9)
    lm.generate(ids, max_new_tokens=900, eos_token_id=eos)
    assert lm.stats()["evicted_tokens"] == evicted and lm.stats()["cached_tokens"] >= 288


def test_out_of_blocks_mid_generation_keeps_what_was_computed(model):
    """When even eviction cannot supply the next block, OutOfBlocks names it; the cache is exact,
    nothing leaks, and what was computed is cached (a retry hits it)."""
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=16 * BS)
    ids = random_ids(20, 10)
    with pytest.raises(OutOfBlocks, match="generated tokens"):
        lm.generate(ids, max_new_tokens=100)
    lm.cache.check()
    assert lm.cache.pinned_blocks == 0 and lm.cache.leaks() == []
    lm.reset_stats()
    assert torch.equal(lm.generate(ids, max_new_tokens=5), plain(model, ids, max_new_tokens=5))
    assert lm.stats()["hit_tokens"] == 19


# --------------------------------------------------------------------- 4. admission failures
def test_out_of_blocks_message_counts_what_is_held(model):
    """A running request holds blocks; a generate that needs more than the rest raises OutOfBlocks
    whose message states free, freeable and held blocks; nothing leaks, the runner finishes."""
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=24 * BS)
    stream = lm.generate_batch([random_ids(40, 11)[0].tolist()], max_new_tokens=30, stream=True)
    next(stream)  # the stream's sequence now holds 11+ blocks
    with pytest.raises(OutOfBlocks, match="free") as info:
        lm.generate(random_ids(60, 12), max_new_tokens=4)
    assert "running" in str(info.value) or "held" in str(info.value)
    rest = list(stream)
    assert len(rest) == 29
    assert lm.cache.leaks() == []
    lm.cache.check()


# --------------------------------------------------------------------- 5. inputs users pass
def test_bool_and_float_masks_are_accepted(model):
    """Tokenizers and users pass bool or float masks; the result equals an int mask's."""
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=1024)
    ids = random_ids(12, 13, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    ids[1, :3] = 0
    want = plain(model, ids, mask, max_new_tokens=4)
    for m in (mask.bool(), mask.float()):
        assert torch.equal(lm.generate(ids, attention_mask=m, max_new_tokens=4, do_sample=False), want)


def test_a_batch_encoding_is_accepted_as_input_ids(model):
    """apply_chat_template returns a BatchEncoding: take its input_ids and attention_mask."""
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=1024)
    ids = random_ids(12, 14)
    enc = BatchEncoding({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    assert torch.equal(lm.generate(enc, max_new_tokens=4, do_sample=False),
                       plain(model, ids, max_new_tokens=4))
    assert torch.equal(lm.generate({"input_ids": ids[0].tolist()}, max_new_tokens=4, do_sample=False),
                       plain(model, ids, max_new_tokens=4))
    with pytest.raises(TypeError, match="input_ids"):
        lm.generate({"ids": ids}, max_new_tokens=2)


@pytest.mark.parametrize("bad, kwargs, error, match", [
    ([], {}, ValueError, "empty prompt"),
    ([[]], {}, ValueError, "empty prompt"),
    (torch.zeros((1, 0), dtype=torch.long), {}, ValueError, "empty prompt"),
    ([[1, 2, 3]], dict(max_new_tokens="3"), TypeError, "max_new_tokens"),
    ([[1, 2, 3]], dict(max_new_tokens=0), ValueError, "max_new_tokens"),
    ([[1, 2, 3]], dict(max_new_tokens=True), TypeError, "max_new_tokens"),
    ([[1, 2, 3]], dict(max_length=2.5), TypeError, "max_length"),
    ([[1.0, 2.0]], {}, TypeError, "integer"),
    ([[1, 2, 3]], dict(attention_mask=[[0.5, 1, 1]]), ValueError, "0s and 1s"),
])
def test_bad_input_is_named_and_changes_no_statistic(model, bad, kwargs, error, match):
    """Each bad input gets an exception naming the problem; no block and no counter changes
    (not even the fallback count)."""
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=512)
    lm.generate(random_ids(20, 15), max_new_tokens=3)
    before = (lm.stats(), [lm.manager.allocator.refcount(b) for b in range(lm.manager.allocator.num_blocks)])
    with pytest.raises(error, match=match):
        lm.generate(bad, **kwargs)
    assert (lm.stats(), [lm.manager.allocator.refcount(b)
                         for b in range(lm.manager.allocator.num_blocks)]) == before


def test_a_cache_of_the_callers_own_is_served_by_plain_generate(model):
    """A DynamicCache the caller passes is theirs: plain generate serves it (one fallback)."""
    from transformers import DynamicCache

    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=512)
    ids = random_ids(12, 16)
    mine = DynamicCache(config=model.config)
    got = lm.generate(ids, past_key_values=mine, max_new_tokens=3, do_sample=False)
    assert torch.equal(got, plain(model, ids, max_new_tokens=3))
    assert mine.get_seq_length() == 14 and lm.stats()["fallback_reasons"] == {"caller passed its own cache": 1}
