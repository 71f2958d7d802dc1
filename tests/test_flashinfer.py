"""The FlashInfer backend against the torch reference, on random pools and through the engine.

GPU only: the whole module is skipped without flashinfer-python or without CUDA. The first run
JIT-compiles one FlashInfer module per (dtype, head_dim, window/soft-cap) configuration (a minute or
two each); the window/soft-cap, fp8 and MLA (K 192 / V 128) variants add three more modules, so
they only run with
``RADIXCACHE_GPU_VARIANTS=1`` (scripts/gpu_check.sh runs them last).
"""

import os
import random

import pytest
import torch

pytestmark = pytest.mark.gpu
flashinfer = pytest.importorskip("flashinfer")
if not torch.cuda.is_available():
    pytest.skip("the FlashInfer backend needs a CUDA device", allow_module_level=True)

import transformers  # noqa: E402

import radixcache  # noqa: E402
from radixcache.attention import Segment, StepPlan  # noqa: E402
from radixcache.attention.flashinfer_backend import FlashInferBackend  # noqa: E402
from radixcache.attention.torch_backend import TorchBackend  # noqa: E402
from radixcache.kv.pool import KVPool  # noqa: E402

DEVICE = torch.device("cuda")
DTYPE = torch.bfloat16
BLOCK = 16
Q_HEADS, KV_HEADS = 8, 2  # GQA: 4 query heads per KV head
ATOL, RTOL = 1e-2, 5e-2
NUM_BLOCKS = 64
LAYERS = 3
variants = pytest.mark.skipif(os.environ.get("RADIXCACHE_GPU_VARIANTS") != "1",
                              reason="compiles two more FlashInfer modules: set RADIXCACHE_GPU_VARIANTS=1")


@pytest.fixture(scope="module")
def fi_backend():
    return FlashInferBackend(DEVICE)


def random_pool(head_dim: int, seed: int, kv_dtype=None, head_dim_v=None) -> KVPool:
    """A pool whose every block holds random K/V (written through ``KVPool.write``, so fp8 pools
    get their scales); the null block stays zero."""
    pool = KVPool(LAYERS, NUM_BLOCKS, BLOCK, KV_HEADS, head_dim, dtype=DTYPE, device=DEVICE,
                  kv_dtype=kv_dtype, head_dim_v=head_dim_v)
    gen = torch.Generator().manual_seed(seed)
    rows = pool.rows_for(list(range(NUM_BLOCKS)), 0, NUM_BLOCKS * BLOCK)
    for layer in range(LAYERS):
        k, v = (torch.randn(NUM_BLOCKS * BLOCK, KV_HEADS, dim, generator=gen).to(DEVICE, DTYPE)
                for dim in (pool.head_dim, pool.head_dim_v))
        pool.write(layer, rows, k, v)
    return pool


def build_segments(specs, seed: int) -> list[Segment]:
    """``specs``: (q_len, kv_len, shared) per sequence; ``shared`` leading blocks are the same
    block ids for every sequence that asks for them (a cached common prefix). Each sequence gets
    one spare block past what ``kv_len`` needs (the engine allocates ahead), block ids shuffled."""
    rng = random.Random(seed)
    ids = list(range(NUM_BLOCKS))
    rng.shuffle(ids)
    common = [ids.pop() for _ in range(max(s for _, _, s in specs))]
    segments, start = [], 0
    for q_len, kv_len, shared in specs:
        pages = -(-kv_len // BLOCK)
        blocks = common[:shared] + [ids.pop() for _ in range(pages - shared + 1)]
        segments.append(Segment(start, q_len, kv_len, tuple(blocks)))
        start += q_len
    return segments


# (q_len, kv_len, shared prefix blocks): fresh prefills, suffixes over a shared cached prefix,
# decodes over the same prefix, a full last page, a one-token sequence, a short chunk of a long one
MIXED = [(37, 37, 0), (20, 68, 3), (1, 53, 3), (16, 64, 3), (1, 1, 0), (1, 16, 0), (5, 130, 0)]
DECODES = [(1, 53, 3), (1, 48, 3), (1, 1, 0), (1, 16, 0), (1, 17, 0), (1, 130, 0), (1, 90, 3)]


def check_step(fi, pool, segments, *, scale, sliding_window=None, softcap=None, seed=0):
    """Every layer's FlashInfer output equals the torch reference's; one wrapper plan for the step."""
    fi_plan = StepPlan(pool, segments, fi)
    ref_plan = StepPlan(pool, segments, TorchBackend())
    tokens = sum(s.q_len for s in segments)
    gen = torch.Generator().manual_seed(seed)
    before = fi.plan_calls
    for layer in range(pool.num_layers):
        q = torch.randn(tokens, Q_HEADS, pool.head_dim, generator=gen).to(DEVICE, DTYPE)
        got = fi.attend(layer, q, fi_plan, scale, sliding_window=sliding_window, softcap=softcap)
        want = TorchBackend().attend(layer, q, ref_plan, scale, sliding_window=sliding_window,
                                     softcap=softcap)
        assert got.shape == (tokens, Q_HEADS, pool.head_dim_v) and got.dtype == q.dtype
        torch.testing.assert_close(got.float(), want.float(), atol=ATOL, rtol=RTOL)
    assert fi.plan_calls == before + 1, "the step must be planned once, not once per layer"
    return fi_plan


@pytest.mark.parametrize("head_dim", [64, 128])
def test_mixed_prefill_and_decode_step_matches_torch(fi_backend, head_dim):
    pool = random_pool(head_dim, seed=head_dim)
    plan = check_step(fi_backend, pool, build_segments(MIXED, seed=1), scale=0.7 * head_dim ** -0.5)
    assert not plan.backend_state.decode  # went through the prefill wrapper


@pytest.mark.parametrize("head_dim", [64, 128])
def test_pure_decode_step_matches_torch(fi_backend, head_dim):
    pool = random_pool(head_dim, seed=head_dim + 1)
    plan = check_step(fi_backend, pool, build_segments(DECODES, seed=2), scale=head_dim ** -0.5)
    assert plan.backend_state.decode  # went through the decode wrapper


@variants
@pytest.mark.parametrize("specs", [MIXED, DECODES], ids=["mixed", "decode"])
def test_mla_head_dims_match_torch(fi_backend, specs):
    """K of 192 and V of 128 per head (DeepSeek's qk_nope + qk_rope and v_head_dim): every step,
    decodes too, runs on the prefill wrapper with head_dim_vo."""
    pool = random_pool(192, seed=13, head_dim_v=128)
    plan = check_step(fi_backend, pool, build_segments(specs, seed=8), scale=192 ** -0.5)
    assert plan.backend_state.decode == (specs is DECODES)


def test_interleaved_steps_replan(fi_backend):
    """Two live steps on one backend: each attend runs on its own step's page table."""
    pool = random_pool(64, seed=7)
    steps = [build_segments(MIXED, seed=3), build_segments(MIXED[::-1], seed=4)]
    fi_plans = [StepPlan(pool, s, fi_backend) for s in steps]
    ref_plans = [StepPlan(pool, s, TorchBackend()) for s in steps]
    gen = torch.Generator().manual_seed(5)
    for i in [0, 1, 0, 1]:
        tokens = sum(s.q_len for s in steps[i])
        q = torch.randn(tokens, Q_HEADS, 64, generator=gen).to(DEVICE, DTYPE)
        got = fi_backend.attend(0, q, fi_plans[i], 0.125)
        want = TorchBackend().attend(0, q, ref_plans[i], 0.125)
        torch.testing.assert_close(got.float(), want.float(), atol=ATOL, rtol=RTOL)


@variants
@pytest.mark.parametrize("specs", [MIXED, DECODES], ids=["mixed", "decode"])
def test_sliding_window_and_softcap_match_torch(fi_backend, specs):
    pool = random_pool(64, seed=11)
    check_step(fi_backend, pool, build_segments(specs, seed=6), scale=0.125, sliding_window=24,
               softcap=5.0)


@variants
@pytest.mark.parametrize("specs", [MIXED, DECODES], ids=["mixed", "decode"])
def test_fp8_pool_matches_torch(fi_backend, specs):
    pool = random_pool(128, seed=12, kv_dtype="fp8")
    assert pool.quantized and float(pool.scales.min()) > 0
    check_step(fi_backend, pool, build_segments(specs, seed=8), scale=128 ** -0.5)


def tiny_llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=512, intermediate_size=1024,
                                      num_hidden_layers=2, num_attention_heads=Q_HEADS,
                                      num_key_value_heads=KV_HEADS, max_position_embeddings=1024,
                                      initializer_range=0.2)  # head_dim 64; peaked logits
    model = transformers.LlamaForCausalLM(config).to(DEVICE, DTYPE).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def greedy_agreement(ref, got) -> float:
    pairs = [(a, b) for r, g in zip(ref, got) for a, b in zip(r, g)]
    return sum(a == b for a, b in pairs) / len(pairs)


def test_engine_greedy_tokens_match_torch_backend():
    model = tiny_llama()
    rng = random.Random(0)
    prefix = [rng.randrange(1, 512) for _ in range(40)]
    prompts = [prefix + [rng.randrange(1, 512) for _ in range(n)] for n in (3, 10, 17, 30, 45, 60)]
    prompts += [[rng.randrange(1, 512) for _ in range(n)] for n in (1, 5, 21)]
    prompts.append(list(prompts[2]))  # a duplicate: fully cached but for its last token
    outputs = {}
    for attention in ("torch", "flashinfer"):
        lm = radixcache.wrap(model, attention=attention, max_cache_tokens=4096)
        assert lm.backend.name == attention and lm.engine_unsupported is None
        outputs[attention] = [o[0] for o in lm.generate_batch(prompts, max_new_tokens=8)]
        assert not lm.cache.leaks()
        lm.clear()
        assert lm.manager.allocator.num_free == lm.manager.allocator.num_blocks, "leaked blocks"
    ref, got = outputs["torch"], outputs["flashinfer"]
    assert all(len(o) == 8 for o in ref + got)
    agreement = greedy_agreement(ref, got)
    assert agreement >= 0.9, f"only {agreement:.0%} of greedy tokens agree"


def test_generate_through_flashinfer_matches_torch_backend_and_plain():
    """lm.generate reads the block tables through FlashInfer: a cold prompt, a cached turn (a
    prefix and a partial tail reused), and a left-padded batch, against the torch backend and
    plain model.generate (bf16: greedy agreement, not equality)."""
    model = tiny_llama()
    rng = random.Random(1)
    first = torch.tensor([[rng.randrange(1, 512) for _ in range(45)]], device=DEVICE)
    rows = [[rng.randrange(1, 512) for _ in range(n)] for n in (20, 33)]
    width = max(map(len, rows))
    batch = torch.tensor([[0] * (width - len(r)) + r for r in rows], device=DEVICE)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=DEVICE)
    results = {}
    for attention in ("torch", "flashinfer"):
        lm = radixcache.wrap(model, attention=attention, max_cache_tokens=4096)
        assert lm.backend.name == attention and lm.unsupported is None
        out = lm.generate(first, max_new_tokens=8, do_sample=False)
        turn = torch.cat([out, torch.tensor([[7, 8, 9, 10, 11]], device=DEVICE)], dim=1)
        again = lm.generate(turn, max_new_tokens=8, do_sample=False, return_dict_in_generate=True)
        assert again.cached_tokens == [out.shape[1] - 1]
        padded = lm.generate(batch, attention_mask=mask, max_new_tokens=6, do_sample=False)
        results[attention] = [out[0, 45:].tolist(), again.sequences[0, turn.shape[1]:].tolist(),
                              *[r[width:].tolist() for r in padded]]
        assert not lm.cache.leaks()
    with torch.no_grad():
        plain = [model.generate(first, attention_mask=torch.ones_like(first), max_new_tokens=8,
                                do_sample=False)[0, 45:].tolist()]
    assert greedy_agreement(results["torch"], results["flashinfer"]) >= 0.9
    assert greedy_agreement(plain, results["flashinfer"][:1]) >= 0.75


@variants
def test_generate_with_an_fp8_pool_stays_close():
    model = tiny_llama()
    lm = radixcache.wrap(model, attention="flashinfer", max_cache_tokens=4096, kv_dtype="fp8")
    ids = torch.tensor([list(range(1, 60))], device=DEVICE)
    out = lm.generate(ids, max_new_tokens=1, do_sample=False, return_dict_in_generate=True,
                      output_logits=True)
    with torch.no_grad():
        want = model(input_ids=ids).logits[0, -1].float()
    err = float((out.logits[0][0].float() - want).abs().max() / want.abs().max())
    assert err < 0.1 and lm.pool.calibrated_layers() == lm.pool.num_layers
