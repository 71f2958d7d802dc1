"""The wrap-time self-test: a short prompt through each entry point's own path vs the plain model.

``generate``'s path: ``lm.generate`` machinery (``generate_paged``) twice, first on a prefix (so a
whole block and a partial tail get cached), then on the whole prompt with two new tokens (a cached
prefix, a copied tail, a prefill and a decode step), its logits against the model's own forwards.
The engine's path: the model runner on a ``StepPlan``, a prefill chunk, the rest of the prompt,
then one decode step, against the same forwards. Any error or disagreement disables that entry
point's paged path (it falls back to plain transformers) with the reason.

Both run on a ``Probe``: a throwaway manager over a pool of ``PROBE_BLOCKS`` blocks of the
wrapper's geometry and dtypes, with the wrapper's model, runner and backend. So the wrapper's own
pool is allocated only once a path has passed (none for a model no path can serve), and its tree,
statistics and fp8 scales start untouched: the first real K/V calibrates them.
"""

from __future__ import annotations

import torch

from radixcache.attention.plan import Segment, StepPlan
from radixcache.integrations.hf.attention import UnsupportedAttention
from radixcache.integrations.hf.generate import generate_paged, validated_generation_config
from radixcache.lifecycle.manager import CacheManager

NAMESPACE = ("radixcache self-test",)
PROBE_BLOCKS = 10  # generate's probe (3 blocks, a copied tail) and the engine's (3) side by side


class Probe:
    """What the self-test runs on: the wrapper's ``model``, ``runner``, ``backend``,
    ``block_size``, ``vocab_size`` and ``device``, with a ``pool`` and ``manager`` of its own
    (the attributes ``generate_paged`` reads), dropped after the test."""

    def __init__(self, lm, pool):
        self.model, self.runner, self.backend = lm.model, lm.runner, lm.backend
        self.block_size, self.vocab_size, self.device = lm.block_size, lm.vocab_size, lm.device
        self.pool = pool
        self.manager = CacheManager(pool.num_blocks, lm.block_size, pool=pool)


def tolerance(pool) -> float:
    """Relative logit error the paged path may show for the pool's storage dtype."""
    if pool.storage_dtype == torch.float32:
        return 1e-3
    return 0.25 if pool.quantized else 3e-2  # fp8: rounding alone moves tiny models by ~0.1


def _disagreement(want: torch.Tensor, got: torch.Tensor, pool) -> str | None:
    err = float((want - got).abs().max() / want.abs().max().clamp(min=1e-6))
    if not err <= tolerance(pool):
        return f"disagrees with the model's own forward (relative logit error {err:.2e})"
    return None


def run_self_tests(lm, make_pool) -> tuple[str | None, str | None]:
    """(reason generate cannot use the paged path, reason the engine cannot), None when it can.
    ``lm`` gives the model, runner, backend, block size, vocabulary size and device;
    ``make_pool(num_blocks)`` builds a pool of the wrapper's geometry to probe on."""
    n = 2 * lm.block_size + 3
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, lm.vocab_size, (1, n), generator=gen).to(lm.device)
    try:
        with torch.no_grad():
            want = lm.model(input_ids=ids).logits[0, -1].float()
            nxt = want.argmax().view(1, 1)
            want_next = lm.model(input_ids=torch.cat([ids, nxt], dim=1)).logits[0, -1].float()
    except Exception as e:  # noqa: BLE001 - the model itself fails: nothing to compare against
        return (f"the model's own forward failed ({type(e).__name__}: {e})",) * 2
    probe = Probe(lm, make_pool(PROBE_BLOCKS))
    generate = _outcome(lambda: _generate_path(probe, ids, want, want_next), "generate")
    engine = _outcome(lambda: _engine_path(probe, ids[0].tolist(), want, want_next), "engine")
    return generate, engine


def _outcome(test, path: str) -> str | None:
    try:
        problem = test()
    except UnsupportedAttention as e:
        return f"the paged KV path cannot serve this model: {e}"
    except Exception as e:  # noqa: BLE001 - any failure of the paged path means: do not use it
        return f"the paged KV path ({path}) failed its self-test ({type(e).__name__}: {e})"
    return None if problem is None else f"the paged KV path ({path}) failed its self-test: {problem}"


def _generate_path(lm, ids, want, want_next) -> str | None:
    bs = lm.block_size
    for prompt, new in ((ids[:, :bs + 2], 1), (ids, 2)):
        kwargs = dict(max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0,
                      return_dict_in_generate=True, output_logits=True)
        config = validated_generation_config(lm.model, kwargs)
        out = generate_paged(lm, prompt, torch.ones_like(prompt), config, kwargs, NAMESPACE)
    return _disagreement(want, out.logits[0][0].float(), lm.pool) or \
        _disagreement(want_next, out.logits[1][0].float(), lm.pool)


def _engine_path(lm, tokens: list, want, want_next) -> str | None:
    manager, pool = lm.manager, lm.pool
    bs = lm.block_size
    namespace = NAMESPACE + ("engine",)
    lease = manager.admit(tokens, namespace, count=False)
    try:
        n = len(tokens)
        manager.grow(lease, n + 1)
        blocks = tuple(lease.blocks)

        if lease.computed:
            return "found its probe cached before it ran"

        def forward(start, end, rows=1):  # the logits of the last ``rows`` positions; the last's
            plan = StepPlan(pool, [Segment(0, end - start, end, blocks)], lm.backend)
            return lm.runner.forward(tokens[start:end], list(range(start, end)), plan,
                                     list(range(end - start - rows, end - start)))[-1]

        forward(0, bs)
        got = forward(bs, n, rows=2)  # two rows: a compiled runner meets every shape class here
        tokens = tokens + [int(want.argmax())]
        got_next = forward(n, n + 1)
        manager.commit(lease, tokens, n + 1)
    finally:
        manager.release(lease)
    return _disagreement(want, got, pool) or _disagreement(want_next, got_next, pool)
