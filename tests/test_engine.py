"""The batching engine: exact greedy outputs, shared blocks, preemption, streaming, failure safety."""

import pytest
import torch

import radixcache
from radixcache import OutOfBlocks
from radixcache.engine import Engine
from tiny_models import FAMILIES, random_ids, tiny_model

BS = 4


def plain_continuation(model, prompt, max_new):
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                         do_sample=False)
    return out[0, len(prompt):].tolist()


def mixed_prompts(seed=0):
    system = random_ids(22, seed + 1)[0].tolist()
    other = random_ids(13, seed + 2)[0].tolist()
    return [system + random_ids(3 + i, seed + 10 + i)[0].tolist() for i in range(4)] + [
        other + [7, 8, 9], random_ids(2, seed + 30)[0].tolist(), other[:9],
        random_ids(41, seed + 31)[0].tolist()]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_model(request):
    return tiny_model(request.param)


def test_batch_equals_one_by_one_generate(family_model):
    """Every prompt of a mixed batch (shared prefixes, none, different lengths) gets exactly the
    tokens of one-by-one greedy model.generate; the shared system prompt is computed once."""
    lm = radixcache.wrap(family_model, block_size=BS, max_cache_tokens=4096)
    prompts = mixed_prompts()
    want = [plain_continuation(family_model, p, 7) for p in prompts]
    got = lm.generate_batch(prompts, max_new_tokens=7)
    assert [g[0] for g in got] == want
    run = lm._engine.last_run
    assert run.hit_tokens >= 3 * 20  # three prompts reuse the 5 whole blocks of the system prompt
    assert run.generated_tokens == 7 * len(prompts)
    lm.cache.check()
    # a second batch hits what the first one left in the tree
    again = lm.generate_batch(prompts[:2], max_new_tokens=7)
    assert [g[0] for g in again] == want[:2]
    assert lm._engine.last_run.hit_rate > 0.7


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def test_eos_stops_a_sample_and_is_included(model):
    """A sample ends at EOS (included, like model.generate); others run to max_new_tokens."""
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=2048)
    prompt = random_ids(10, 3)[0].tolist()
    free_run = plain_continuation(model, prompt, 6)
    eos = free_run[2]
    got = lm.generate_batch([prompt, random_ids(12, 4)[0].tolist()], max_new_tokens=6,
                            eos_token_id=eos)
    assert got[0][0] == free_run[:free_run.index(eos) + 1]


def test_parallel_samples_share_prompt_blocks(model):
    """n=4: after the prompt, all samples hold the prompt's full blocks (refcount = tree + 4) and the
    partially filled last block is copied per sample; peak memory counts the prompt once."""
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=2048)
    prompt = random_ids(26, 5)[0].tolist()  # 6 full blocks + 2 tokens
    stream = lm.generate_batch([prompt], max_new_tokens=5, n=4, do_sample=True, seed=1, stream=True)
    first = [next(stream) for _ in range(4)]
    assert sorted(s for _, s, _ in first) == [0, 1, 2, 3]
    shared = lm.cache.match(prompt[:24], (lm.fingerprint, None)).blocks
    assert len(shared) == 6
    assert all(lm.allocator.refcount(b) == 1 + 4 for b in shared)
    rest = list(stream)
    assert len(first) + len(rest) == 4 * 5
    run = lm._engine.last_run
    # prompt (7 blocks) once + per sample at most 2 more blocks (the copied tail + growth)
    assert run.peak_blocks <= 7 + 4 * 2
    lm.cache.check()


def test_sampling_is_reproducible_with_seed(model):
    """Each sample has its own RNG: the same seed gives the same samples, whatever else runs."""
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=2048)
    prompt = random_ids(15, 6)[0].tolist()
    a = lm.generate_batch([prompt], max_new_tokens=6, n=3, do_sample=True, temperature=0.8,
                          top_p=0.9, seed=42)
    b = lm.generate_batch([random_ids(9, 7)[0].tolist(), prompt], max_new_tokens=6, n=3,
                          do_sample=True, temperature=0.8, top_p=0.9, seed=42)
    assert len(a[0]) == 3 and all(len(s) == 6 for s in a[0])
    c = lm.generate_batch([prompt], max_new_tokens=6, n=3, do_sample=True, temperature=0.8,
                          top_p=0.9, seed=42)
    assert a == c
    assert b[1] != [] and len(b[1]) == 3


def test_preemption_under_a_tiny_budget_keeps_outputs_exact(model):
    """With room for barely one long sequence, requests are preempted and resumed; every output is
    still complete and equal to plain generate."""
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=28 * BS)
    prompts = [random_ids(30, 40 + i)[0].tolist() for i in range(5)]
    want = [plain_continuation(model, p, 24) for p in prompts]
    got = lm.generate_batch(prompts, max_new_tokens=24)
    assert [g[0] for g in got] == want
    assert lm._engine.last_run.preemptions > 0
    lm.cache.check()


def test_closing_a_stream_early_releases_everything(model):
    """Abandoning a streaming iterator releases every block and lock the run held."""
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=2048)
    stream = lm.generate_batch(mixed_prompts(1), max_new_tokens=8, stream=True)
    for _ in range(5):
        next(stream)
    stream.close()
    assert lm.cache.pinned_blocks == 0 and lm.cache.leaks() == []


def test_model_error_mid_forward_leaves_cache_consistent(model, monkeypatch):
    """A forward that raises half way: the error propagates; nothing pinned or leaked; the tree only
    holds sound prefixes (a later run still gives exact outputs)."""
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=2048)
    lm.generate_batch([random_ids(5, 8)[0].tolist()], max_new_tokens=2)  # creates the engine
    calls = {"n": 0}
    original = type(model).forward

    def flaky(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("device fell over")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(type(model), "forward", flaky)
    prompts = mixed_prompts(2)
    with pytest.raises(RuntimeError, match="fell over"):
        lm.generate_batch(prompts, max_new_tokens=6)
    monkeypatch.setattr(type(model), "forward", original)
    assert lm.cache.pinned_blocks == 0 and lm.cache.leaks() == []
    lm.cache.check()
    got = lm.generate_batch(prompts, max_new_tokens=6)
    assert [g[0] for g in got] == [plain_continuation(model, p, 6) for p in prompts]


@pytest.mark.parametrize("prompts, kwargs, error", [
    ([], {}, ValueError),
    ([[]], {}, ValueError),
    ([[1, 2]], dict(max_new_tokens=0), ValueError),
    ([[1, 2]], dict(n=0), ValueError),
    ([[1, 2.5]], {}, TypeError),
    ([[1, 10**6]], {}, ValueError),
    ([[1, -3]], {}, ValueError),
    ([[1, 2]], dict(do_sample=True, temperature=0.0), ValueError),
    ([[1, 2]], dict(top_p=0.0), ValueError),
    ([[1, 2]], dict(cache_salt=3), TypeError),
    ([[1] * 500], {}, OutOfBlocks),
])
def test_bad_arguments_raise_before_any_change(model, prompts, kwargs, error):
    """Bad prompts and settings raise a clear error and leave the cache untouched."""
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=256)
    lm.generate_batch([random_ids(9, 9)[0].tolist()], max_new_tokens=2)
    before = (lm.cache.cached_blocks, lm.allocator.num_free, lm.stats()["requests"])
    with pytest.raises(error):
        lm.generate_batch(prompts, **kwargs)
    assert (lm.cache.cached_blocks, lm.allocator.num_free, lm.stats()["requests"]) == before


def test_longest_prefix_first_beats_fcfs_when_memory_is_tight(model):
    """With two system prompts interleaved and room for one, LPM scheduling hits more than FCFS."""
    rates = {}
    for schedule in ("fcfs", "lpm"):
        lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=16 * BS)
        engine = Engine(lm, schedule=schedule, max_running=2)
        systems = [random_ids(40, 60)[0].tolist(), random_ids(40, 61)[0].tolist()]
        prompts = [systems[i % 2] + random_ids(3, 70 + i)[0].tolist() for i in range(8)]
        out = engine.generate(prompts, max_new_tokens=2)
        assert [o[0] for o in out] == [plain_continuation(model, p, 2) for p in prompts]
        rates[schedule] = engine.last_run.hit_rate
    assert rates["lpm"] > rates["fcfs"]


def test_chunked_prefill_of_a_long_prompt(model):
    """A prompt longer than max_step_tokens is prefilled in chunks with the same result."""
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=2048)
    engine = Engine(lm, max_step_tokens=16)
    prompt = random_ids(70, 10)[0].tolist()
    assert engine.generate([prompt], max_new_tokens=5)[0][0] == plain_continuation(model, prompt, 5)
    assert engine.last_run.steps >= 5 + 4


def test_fp8_kv_halves_bytes_and_stays_close(model):
    """kv_dtype='fp8' stores a byte per element (half of bf16) and keeps logits close to fp32 KV."""
    full = radixcache.wrap(model, block_size=BS, max_cache_tokens=1024)
    fp8 = radixcache.wrap(model, block_size=BS, max_cache_tokens=1024, kv_dtype="fp8")
    bf16 = radixcache.wrap(model, block_size=BS, max_cache_tokens=1024, kv_dtype="bf16")
    assert fp8.pool.bytes_per_token * 2 == bf16.pool.bytes_per_token
    ids = random_ids(30, 11)
    fp8.generate(ids[:, :20], max_new_tokens=1, do_sample=False)  # cache a prefix in fp8
    a = full.generate(ids, max_new_tokens=1, do_sample=False, return_dict_in_generate=True,
                      output_logits=True).logits[0]
    b = fp8.generate(ids, max_new_tokens=1, do_sample=False, return_dict_in_generate=True,
                     output_logits=True).logits[0]
    assert fp8.stats()["hit_tokens"] == 20
    err = (a - b).abs().max() / a.abs().max()
    assert 0 < err < 0.1
    out = fp8.generate_batch([ids[0].tolist()], max_new_tokens=4)
    assert len(out[0][0]) == 4


def test_preempted_sequences_are_not_counted_twice_in_hit_stats(model):
    """A resumed sequence re-matches its prompt, but the hit statistics count each prompt once."""
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=28 * BS)
    prompts = [random_ids(30, 40 + i)[0].tolist() for i in range(5)]
    lm.generate_batch(prompts, max_new_tokens=24)
    run = lm._engine.last_run
    assert run.preemptions > 0
    assert run.prompt_tokens == sum(map(len, prompts))
    assert run.hit_tokens <= run.prompt_tokens
