"""The batched sampler: each row's token depends only on its logits and its own generator."""

import torch

from radixcache.engine.request import SamplingParams
from radixcache.engine.sampling import Row, choose, sample_generator

SAMPLE = SamplingParams(do_sample=True, temperature=1.0, top_k=0)


def rows(n, params=SAMPLE, seed=0):
    return [Row(params, sample_generator(seed, i)) for i in range(n)]


def test_frequencies_follow_the_softmax():
    """10,000 draws of one row match softmax(logits) within 2 points (a fixed seed: no flake)."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    gen = rows(1)
    counts = torch.zeros(4)
    for _ in range(10_000):
        counts[choose(logits, gen)[0]] += 1
    assert (counts / counts.sum() - torch.softmax(logits[0], 0)).abs().max() < 0.02


def test_zero_probability_tokens_are_never_drawn():
    """Masked (-inf) tokens and tokens cut by top-k/top-p/min-p never come out, even for uniform
    draws near 1."""
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(1))
    logits[:, 25:] = float("-inf")
    for params in (SAMPLE, SamplingParams(do_sample=True, top_k=3),
                   SamplingParams(do_sample=True, top_p=0.3), SamplingParams(do_sample=True, min_p=0.5)):
        gen = rows(8, params)
        top3 = logits.topk(3, dim=-1).indices
        for _ in range(300):
            tokens = choose(logits, gen)
            assert all(t < 25 for t in tokens)
            if params.top_k == 3:
                assert all(t in top3[i].tolist() for i, t in enumerate(tokens))


def test_a_row_does_not_depend_on_the_others():
    """The same generator seed gives the same tokens whatever rows surround it."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(5, 64, generator=g)
    params = SamplingParams(do_sample=True, temperature=0.7, top_p=0.9, top_k=20)
    alone = [choose(logits[2:3], [Row(params, sample_generator(9, 0))]) for _ in range(1)]
    mixed = choose(logits, [Row(params, sample_generator(s, 0)) for s in (1, 2, 9, 4, 5)])
    assert mixed[2] == alone[0][0]


def test_greedy_rows_and_degenerate_filters_are_the_argmax():
    """Greedy rows, top_k=1 and a tiny top_p all give the argmax, mixed in one batch."""
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(3))
    mixed = [Row(SamplingParams(), None), Row(SamplingParams(do_sample=True, top_k=1), sample_generator(0, 0)),
             Row(SamplingParams(do_sample=True, top_p=1e-6), sample_generator(0, 1)), Row(SamplingParams(), None)]
    assert choose(logits, mixed) == logits.argmax(dim=-1).tolist()


def test_repetition_penalty_lowers_seen_tokens_like_transformers():
    """A seen token's positive logit is divided by the penalty, a negative one multiplied."""
    from transformers import RepetitionPenaltyLogitsProcessor

    logits = torch.tensor([[3.0, -1.0, 2.9, 0.5]])
    seen = {0, 1}
    want = RepetitionPenaltyLogitsProcessor(1.5)(torch.tensor([[0, 1]]), logits.clone())
    got = choose(logits, [Row(SamplingParams(repetition_penalty=1.5), None, seen)])
    assert got == want.argmax(dim=-1).tolist() == [2]
