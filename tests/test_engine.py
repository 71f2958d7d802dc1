"""generate_batch over the engine: exact greedy outputs, shared blocks, preemption, streaming, seeds,
failure safety, scheduling policies.

The plain fallback honours EOS, stop ids and seeds too, so a test here could pass on it without
the engine ever running: the autouse ``engine_serves`` guard fails any test in which a wrapper
falls back (at the fallback itself) or ends with ``engine_unsupported`` set."""

import gc

import pytest
import torch

import radixcache
from radixcache import OutOfBlocks
from radixcache.integrations.hf.lm import CachedLM
from radixcache.lifecycle.manager import CacheManager
from tiny_models import FAMILIES, random_ids, tiny_model

BS = 4


@pytest.fixture(autouse=True)
def engine_serves(monkeypatch):
    """Every wrapper made in the test must serve through radixcache: a fallback raises where it
    happens, and each wrapper ends with ``engine_unsupported is None`` and no fallback counted."""
    made = []
    init = CachedLM.__init__

    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    def refuse(self, reason):
        raise AssertionError(f"unexpected fallback to plain generate: {reason}")

    monkeypatch.setattr(CachedLM, "__init__", recording_init)
    monkeypatch.setattr(CacheManager, "record_fallback", refuse)
    yield
    for lm in made:
        assert lm.engine_unsupported is None, f"{lm!r}: {lm.engine_unsupported}"
        assert lm.stats()["fallbacks"] == 0, lm.stats()["fallback_reasons"]


def test_the_guard_fails_a_test_whose_wrapper_falls_back(model):
    """The guard above at work: any fallback raises at once."""
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=256)
    with pytest.raises(AssertionError, match="unexpected fallback"):
        lm.manager.record_fallback("forced")
    with pytest.raises(AssertionError, match="unexpected fallback"):
        lm.generate(random_ids(5, 1), max_new_tokens=2, num_beams=2, do_sample=False)


def plain_continuation(model, prompt, max_new, **kw):
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                         do_sample=False, **kw)
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
    assert lm.engine_unsupported is None
    prompts = mixed_prompts()
    want = [plain_continuation(family_model, p, 7) for p in prompts]
    got = lm.generate_batch(prompts, max_new_tokens=7)
    assert [g[0] for g in got] == want
    stats = lm.stats()
    # the system prompt (22 tokens) is computed once: the 3 prompts behind it hit at least 20 each
    assert sum(got.cached_tokens[:4]) >= 3 * 20
    assert stats["generated_tokens"] == 7 * len(prompts)
    assert stats["requests"] == len(prompts) and stats["fallbacks"] == 0
    lm.cache.check()
    lm.reset_stats()
    again = lm.generate_batch(prompts[:2], max_new_tokens=7)
    assert [g[0] for g in again] == want[:2]
    assert lm.stats()["hit_rate"] > 0.7


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def test_eos_stops_a_sample_and_is_included(model):
    """A sample ends at EOS (included, like model.generate) with reason "stop"; others run to
    max_new_tokens with reason "length"."""
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=2048)
    prompt = random_ids(10, 3)[0].tolist()
    free_run = plain_continuation(model, prompt, 6)
    eos = free_run[2]
    got = lm.generate_batch([prompt, random_ids(12, 4)[0].tolist()], max_new_tokens=6,
                            eos_token_id=eos)
    assert got[0][0] == free_run[:free_run.index(eos) + 1]
    assert got.finish_reasons[0] == ["stop"]
    if eos not in got[1][0]:
        assert got.finish_reasons[1] == ["length"] and len(got[1][0]) == 6


def test_eos_none_turns_eos_off_and_stop_ids_add_more(model):
    """eos_token_id=None disables the model's EOS (as in model.generate); stop_token_ids end too."""
    prompt = random_ids(10, 3)[0].tolist()
    free_run = plain_continuation(model, prompt, 6)
    model.generation_config.eos_token_id = free_run[1]
    try:
        lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=2048)
        assert lm.generate_batch([prompt], max_new_tokens=6)[0][0] == free_run[:2]
        assert lm.generate_batch([prompt], max_new_tokens=6, eos_token_id=None)[0][0] == free_run
        stopped = lm.generate_batch([prompt], max_new_tokens=6, eos_token_id=None,
                                    stop_token_ids=[free_run[3]])
        assert stopped[0][0] == free_run[:4] and stopped.finish_reasons == [["stop"]]
    finally:
        model.generation_config.eos_token_id = None


def test_parallel_samples_share_prompt_blocks(model):
    """n=4: after the prompt, all samples hold the prompt's full blocks (refcount = tree + 4) and
    each copies the partially filled last block; peak memory counts the prompt once."""
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=2048)
    engine = lm.new_engine()
    prompt = random_ids(26, 5)[0].tolist()  # 6 full blocks + 2 tokens
    stream = lm.generate_batch([prompt], max_new_tokens=5, n=4, do_sample=True, seed=1,
                               stream=True, engine=engine)
    first = [next(stream) for _ in range(4)]
    assert sorted(s for _, s, _ in first) == [0, 1, 2, 3]
    shared = lm.cache.match(prompt[:24], lm.namespace()).blocks
    assert len(shared) == 6
    assert all(lm.manager.allocator.refcount(b) == 1 + 4 for b in shared)
    rest = list(stream)
    assert len(first) + len(rest) == 4 * 5
    # the prompt (7 blocks) once + per sample at most 2 more (the copied tail and growth)
    assert engine.metrics.peak_used_blocks <= 7 + 4 * 2
    lm.cache.check()


def test_seed_gives_the_same_samples_wherever_the_request_sits(model):
    """Each sample has its own RNG seeded from (seed, sample): a prompt's samples are the same
    alone, behind another prompt, and ahead of one; different seeds differ."""
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=2048)
    prompt = random_ids(15, 6)[0].tolist()
    other = random_ids(9, 7)[0].tolist()
    kw = dict(max_new_tokens=6, n=3, do_sample=True, temperature=0.8, top_p=0.9, top_k=0)
    alone = lm.generate_batch([prompt], seed=42, **kw)
    behind = lm.generate_batch([other, prompt], seed=42, **kw)
    ahead = lm.generate_batch([prompt, other, other], seed=42, **kw)
    assert len(alone[0]) == 3 and all(len(s) == 6 for s in alone[0])
    assert behind[1] == alone[0] and ahead[0] == alone[0]
    assert len({tuple(s) for s in alone[0]}) > 1  # the three samples are not one copy
    assert lm.generate_batch([prompt], seed=43, **kw)[0] != alone[0]


def test_preemption_under_a_tiny_budget_keeps_outputs_exact(model):
    """With room for barely one long sequence, requests are preempted and resumed; every output is
    complete and equal to plain generate, and each prompt counts once in the hit statistics."""
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=28 * BS)
    prompts = [random_ids(30, 40 + i)[0].tolist() for i in range(5)]
    want = [plain_continuation(model, p, 24) for p in prompts]
    got = lm.generate_batch(prompts, max_new_tokens=24)
    assert [g[0] for g in got] == want
    stats = lm.stats()
    assert stats["preemptions"] > 0
    assert stats["queried_tokens"] == sum(map(len, prompts))
    assert stats["hit_tokens"] <= stats["queried_tokens"]
    lm.cache.check()


def test_a_sequence_longer_than_the_pool_ends_with_length(model):
    """A sample that would outgrow the whole pool stops there ("length") instead of looping."""
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=12 * BS)
    prompt = random_ids(30, 9)[0].tolist()
    got = lm.generate_batch([prompt], max_new_tokens=100)
    assert got.finish_reasons == [["length"]]
    assert len(prompt) + len(got[0][0]) <= 12 * BS + 1
    assert got[0][0] == plain_continuation(model, prompt, len(got[0][0]))


def test_stream_is_a_context_manager_that_releases_on_exit(model):
    """Leaving the with block aborts what still runs: nothing pinned, nothing leaked."""
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=2048)
    with lm.generate_batch(mixed_prompts(1), max_new_tokens=8, stream=True) as stream:
        for _ in range(5):
            next(stream)
        assert lm.cache.pinned_blocks > 0
    assert lm.cache.pinned_blocks == 0 and lm.cache.leaks() == []
    stream.close()  # idempotent


def test_abandoned_stream_releases_when_dropped(model):
    """Breaking out of a for loop over a stream and dropping it releases its blocks."""
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=2048)
    for _ in lm.generate_batch(mixed_prompts(1), max_new_tokens=8, stream=True):
        break
    gc.collect()
    assert lm.cache.pinned_blocks == 0 and lm.cache.leaks() == []
    it = lm.generate_batch(mixed_prompts(2), max_new_tokens=8, stream=True)
    next(it)
    assert lm.cache.pinned_blocks > 0
    it.close()  # still referenced: close() releases
    assert lm.cache.pinned_blocks == 0 and lm.cache.leaks() == []
    with pytest.raises(StopIteration):
        next(it)


def test_model_error_mid_forward_leaves_cache_consistent(model, monkeypatch):
    """A forward that raises once, half way: the engine runs the step again in halves, so every
    output is still exact. One that keeps raising: the error propagates; nothing pinned or leaked;
    the tree only holds sound prefixes (a later run still gives exact outputs)."""
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=2048)
    calls = {"n": 0, "broken": False}
    original = type(model).forward

    def flaky(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3 or calls["broken"]:
            raise RuntimeError("device fell over")
        return original(self, *args, **kwargs)

    prompts = mixed_prompts(2)
    want = [plain_continuation(model, p, 6) for p in prompts]
    monkeypatch.setattr(type(model), "forward", flaky)
    assert [g[0] for g in lm.generate_batch(prompts, max_new_tokens=6)] == want
    assert calls["n"] > 3 and lm.cache.leaks() == []
    lm.clear()
    calls["broken"] = True
    with pytest.raises(RuntimeError, match="fell over"):
        lm.generate_batch(prompts, max_new_tokens=6)
    monkeypatch.setattr(type(model), "forward", original)
    assert lm.cache.pinned_blocks == 0 and lm.cache.leaks() == []
    lm.cache.check()
    got = lm.generate_batch(prompts, max_new_tokens=6)
    assert [g[0] for g in got] == want


@pytest.mark.parametrize("prompts, kwargs, error", [
    ([], {}, ValueError),
    ([[]], {}, ValueError),
    ("abc", {}, ValueError),
    ([[1, 2]], dict(max_new_tokens=0), ValueError),
    ([[1, 2]], dict(max_new_tokens="3"), TypeError),
    ([[1, 2]], dict(n=0), ValueError),
    ([[1, 2]], dict(n=2), ValueError),  # greedy samples would all be the same
    ([[1, 2.5]], {}, TypeError),
    ([[1, 10**6]], {}, ValueError),
    ([[1, -3]], {}, ValueError),
    ([[1, 2]], dict(do_sample=True, temperature=0.0), ValueError),
    ([[1, 2]], dict(do_sample=True, top_p=0.0), ValueError),
    ([[1, 2]], dict(do_sample=True, min_p=1.5), ValueError),
    ([[1, 2]], dict(do_sample=True, top_k=-1), ValueError),
    ([[1, 2]], dict(repetition_penalty=0.0), ValueError),
    ([[1, 2]], dict(stop_token_ids=["x"]), TypeError),
    ([[1, 2]], dict(cache_salt=3), TypeError),
    ([[1, 2]], dict(priority=1.5), TypeError),
    ([[1] * 500], {}, OutOfBlocks),
])
def test_bad_arguments_raise_before_any_change(model, prompts, kwargs, error):
    """Bad prompts and settings raise a clear error and change no block and no statistic."""
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=256)
    lm.generate_batch([random_ids(9, 9)[0].tolist()], max_new_tokens=2)
    before = (lm.cache.cached_blocks, lm.manager.allocator.num_free, lm.stats())
    with pytest.raises(error):
        lm.generate_batch(prompts, **kwargs)
    assert (lm.cache.cached_blocks, lm.manager.allocator.num_free, lm.stats()) == before


def test_a_prompt_that_fits_the_pool_is_served(model):
    """Issue 17 item 5: 3 blocks of 16 hold a 38-token prompt and its 4 new tokens (41 need K/V):
    generate_batch serves it, as lm.generate does (before: refused, asking a block to spare)."""
    lm = radixcache.wrap(model, block_size=16, max_cache_tokens=48)
    prompt = random_ids(38, 14)[0].tolist()
    want = plain_continuation(model, prompt, 4)
    assert lm.generate_batch([prompt], max_new_tokens=4)[0][0] == want
    out = lm.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False)
    assert out[0, 38:].tolist() == want
    with pytest.raises(OutOfBlocks, match="does not fit a pool of 3 blocks"):
        lm.generate_batch([random_ids(49, 15)[0].tolist()], max_new_tokens=4)


def test_stop_ids_outside_the_vocabulary_are_refused_by_name(model):
    """Issue 17 item 7: a stop id (or an explicit EOS id) outside the vocabulary is a ValueError
    naming it, in generate_batch and in engine.add, before anything changes."""
    from radixcache.engine import Request, SamplingParams

    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=256)
    prompt = random_ids(9, 16)[0].tolist()
    for kwargs in (dict(stop_token_ids=[3, 10**9]), dict(eos_token_id=10**9)):
        with pytest.raises(ValueError, match=r"stop token ids \[1000000000\] are outside the vocabulary"):
            lm.generate_batch([prompt], max_new_tokens=2, **kwargs)
    engine = lm.new_engine()
    with pytest.raises(ValueError, match=r"stop token ids \[256\] are outside the vocabulary 0..255"):
        engine.add(Request("x", prompt, SamplingParams(stop_token_ids={256})))
    assert lm.stats()["requests"] == 0 and not engine.has_work


def test_a_2d_tensor_is_not_a_prompt_list(model):
    """Issue 17 item 7: a 2-D tensor as the prompt list is refused (it cannot say which ids are
    padding); its rows passed as a list are a batch, each row a whole prompt."""
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=512)
    ids = random_ids(7, 17, batch=2)
    with pytest.raises(TypeError, match="pass list"):
        lm.generate_batch(ids, max_new_tokens=2)
    with pytest.raises(TypeError, match="1-D"):
        lm.generate_batch([ids], max_new_tokens=2)
    got = lm.generate_batch(list(ids), max_new_tokens=2)
    assert [g[0] for g in got] == [plain_continuation(model, row.tolist(), 2) for row in ids]


def test_temperature_without_do_sample_is_greedy(model):
    """transformers' rule: sampling settings without do_sample are ignored (greedy)."""
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=1024)
    prompt = random_ids(11, 12)[0].tolist()
    got = lm.generate_batch([prompt], max_new_tokens=5, temperature=0.3)
    assert got[0][0] == plain_continuation(model, prompt, 5)


def test_defaults_come_from_the_generation_config(model):
    """Without max_new_tokens, 20 tokens as in transformers; a generation config's max_new_tokens
    and sampling settings are used when the call sets none."""
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=1024)
    prompt = random_ids(11, 13)[0].tolist()
    assert lm.generate_batch([prompt])[0][0] == plain_continuation(model, prompt, 20)
    model.generation_config.max_new_tokens = 4
    try:
        assert len(lm.generate_batch([prompt])[0][0]) == 4
    finally:
        model.generation_config.max_new_tokens = None


def test_repetition_penalty_matches_plain_greedy(model):
    """repetition_penalty applies to greedy rows exactly as transformers' logits processor."""
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=2048)
    prompts = [random_ids(14, 20)[0].tolist(), random_ids(9, 21)[0].tolist()]
    got = lm.generate_batch(prompts, max_new_tokens=8, repetition_penalty=1.7)
    for p, g in zip(prompts, got):
        assert g[0] == plain_continuation(model, p, 8, repetition_penalty=1.7)


def test_progress_bar_counts_samples(model, capsys):
    """progress=True draws a tqdm bar over the samples (to stderr) and changes no output."""
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=1024)
    prompts = [random_ids(7, 22)[0].tolist(), random_ids(8, 23)[0].tolist()]
    assert lm.generate_batch(prompts, max_new_tokens=3, progress=True) == \
        [[plain_continuation(model, p, 3)] for p in prompts]
    assert "2/2" in capsys.readouterr().err


def test_longest_prefix_first_beats_fcfs_when_memory_is_tight(model):
    """With two system prompts interleaved and room for one, LPM scheduling hits more than FCFS."""
    rates = {}
    for schedule in ("fcfs", "lpm"):
        lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=16 * BS)
        systems = [random_ids(40, 60)[0].tolist(), random_ids(40, 61)[0].tolist()]
        prompts = [systems[i % 2] + random_ids(3, 70 + i)[0].tolist() for i in range(8)]
        out = lm.generate_batch(prompts, max_new_tokens=2,
                                engine=lm.new_engine(schedule=schedule, max_running=2))
        assert [o[0] for o in out] == [plain_continuation(model, p, 2) for p in prompts]
        rates[schedule] = lm.stats()["hit_rate"]
    assert rates["lpm"] > rates["fcfs"]


def test_chunked_prefill_of_a_long_prompt(model):
    """A prompt longer than max_step_tokens is prefilled in chunks with the same result."""
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=2048)
    engine = lm.new_engine(max_step_tokens=16)
    prompt = random_ids(70, 10)[0].tolist()
    out = lm.generate_batch([prompt], max_new_tokens=5, engine=engine)
    assert out[0][0] == plain_continuation(model, prompt, 5)
    assert engine.metrics.steps >= 5 + 4


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
