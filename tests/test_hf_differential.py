"""Differential tests: the wrapper's generate equals plain model.generate for every supported family."""

import threading

import pytest
import torch

import radixcache
from radixcache.app.kv_size import from_config
from tiny_models import FAMILIES, random_ids, tiny_model

BS = 4


def plain(model, ids, mask=None, **kw):
    mask = torch.ones_like(ids) if mask is None else mask
    return model.generate(ids, attention_mask=mask, do_sample=False, **kw)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    return request.param, tiny_model(request.param)


def test_multi_turn_greedy_identical(family):
    """Three turns of a conversation: tokens identical to model.generate, later turns hit the cache."""
    _, model = family
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=4096)
    assert lm.unsupported is None
    ids = random_ids(29, 1)
    for turn in range(3):
        want = plain(model, ids, max_new_tokens=8)
        got = lm.generate(ids, max_new_tokens=8, do_sample=False)
        assert torch.equal(want, got), f"turn {turn} differs"
        ids = torch.cat([want, random_ids(7, 10 + turn)], dim=1)
    stats = lm.stats()
    assert stats["fallbacks"] == 0
    # turn 2 reuses 36 tokens (29 prompt + 7 fed generated: 9 whole blocks), turn 3 all 51 of
    # turn 2's computed tokens (12 whole blocks and the 3-token partial tail)
    assert stats["hit_tokens"] == 36 + 51
    lm.cache.check()


def test_cached_suffix_logits_match_full_forward(family):
    """First-step logits of a cached-suffix forward are within 1e-4 of the plain full forward."""
    _, model = family
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=4096)
    prefix = random_ids(40, 2)
    lm.generate(prefix, max_new_tokens=1, do_sample=False)
    ids = torch.cat([prefix, random_ids(9, 3)], dim=1)
    out = lm.generate(ids, max_new_tokens=1, do_sample=False, return_dict_in_generate=True,
                      output_logits=True)
    assert lm.stats()["hit_tokens"] == 40
    with torch.no_grad():
        want = model(ids).logits[0, -1]
    assert (out.logits[0][0] - want).abs().max().item() < 1e-4


def test_fully_cached_prompt(family):
    """The same prompt twice: the second call computes only the last token, same output."""
    _, model = family
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=4096)
    ids = random_ids(33, 4)
    first = lm.generate(ids, max_new_tokens=5, do_sample=False)
    second = lm.generate(ids, max_new_tokens=5, do_sample=False)
    assert torch.equal(first, second)
    assert torch.equal(first, plain(model, ids, max_new_tokens=5))
    assert lm.stats()["hit_tokens"] == 32  # every whole block of the 32 tokens before the last


def test_match_ending_mid_block_and_branches(family):
    """Two conversations sharing a system prompt diverge mid-block; a retried turn branches."""
    _, model = family
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=4096)
    system = random_ids(22, 5)  # 5 whole blocks + 2 tokens
    a = torch.cat([system, random_ids(6, 6)], dim=1)
    b = torch.cat([system, random_ids(9, 7)], dim=1)
    for ids in (a, b, a, b):
        assert torch.equal(lm.generate(ids, max_new_tokens=6, do_sample=False),
                           plain(model, ids, max_new_tokens=6))
    # b shares exactly the 20 block-aligned system tokens with a
    assert lm.cache.match(b[0].tolist(), lm.namespace()).length >= 20
    turn = plain(model, a, max_new_tokens=6)
    for retry in range(2):  # same history, different next user text
        ids = torch.cat([turn, random_ids(5, 20 + retry)], dim=1)
        assert torch.equal(lm.generate(ids, max_new_tokens=6, do_sample=False),
                           plain(model, ids, max_new_tokens=6))
    lm.cache.check()


def test_batch_of_three_rows_with_padding(family):
    """A left-padded batch of 3 rows of different lengths, some rows sharing cached prefixes."""
    _, model = family
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=4096)
    shared = random_ids(16, 8)[0].tolist()
    rows = [shared + random_ids(5, 9)[0].tolist(), random_ids(11, 10)[0].tolist(),
            shared + random_ids(13, 11)[0].tolist()]
    lm.generate(torch.tensor([shared + [3, 4, 5]]), max_new_tokens=2, do_sample=False)
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    want = plain(model, ids, mask, max_new_tokens=7)
    got = lm.generate(ids, attention_mask=mask, max_new_tokens=7, do_sample=False)
    assert torch.equal(want, got)
    assert lm.stats()["hit_tokens"] >= 2 * 16
    # and each row continues correctly on its own afterwards (what was inserted is sound)
    for r in range(3):
        row = got[r, mask[r].argmax():][None]
        assert torch.equal(lm.generate(row, max_new_tokens=3, do_sample=False),
                           plain(model, row, max_new_tokens=3))


def test_eviction_under_tiny_budget(family):
    """A pool of 64 tokens serves a long conversation correctly by evicting LRU prefixes."""
    _, model = family
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=64)
    for seed in range(4):
        ids = random_ids(30, 30 + seed)
        assert torch.equal(lm.generate(ids, max_new_tokens=6, do_sample=False),
                           plain(model, ids, max_new_tokens=6))
        lm.cache.check()
    assert lm.stats()["evicted_tokens"] > 0


def test_two_threads_share_one_wrapper(family):
    """Two threads calling generate on one wrapper get the same tokens as sequential plain generate."""
    _, model = family
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=4096)
    system = random_ids(20, 12)
    prompts = [torch.cat([system, random_ids(5 + i, 40 + i)], dim=1) for i in range(6)]
    want = [plain(model, p, max_new_tokens=5) for p in prompts]
    got = [None] * len(prompts)
    errors = []

    def worker(indices):
        try:
            for i in indices:
                got[i] = lm.generate(prompts[i], max_new_tokens=5, do_sample=False)
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(range(k, 6, 2),)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for w, g in zip(want, got):
        assert torch.equal(w, g)
    lm.cache.check()


def test_pool_bytes_per_token_is_what_kv_size_says(family):
    """The pool's bytes per token (K and V of their own head dims: MLA's expanded per-head K and V)
    equal what ``radixcache kv-size`` computes from the same config."""
    _, model = family
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=256)
    assert lm.stats()["kv_bytes_per_token"] == from_config(model.config).bytes_per_token("fp32")
