"""Next-token choice for a whole step at once: greedy or sampled rows of ``[B, V]`` logits.

Rows follow transformers' order: the repetition penalty (greedy rows too, as a logits processor),
then for sampled rows temperature, top-k, top-p and min-p, each as one batched tensor operation
over the rows that use it. Every sample keeps its own
``torch.Generator``: it draws exactly one uniform number per token, and the token is the inverse
CDF of the row's distribution at that number, so a sample's tokens depend only on its seed and its
logits, never on the other rows of the batch. One host read per step returns every token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixcache.attention.plan import device_tensor
from radixcache.engine.request import SamplingParams, TokenLogprobs

SEED_MULTIPLIER = 6364136223846793005  # Knuth's MMIX LCG constants: spread (seed, sample) pairs
SEED_INCREMENT = 1442695040888963407


def sample_generator(seed: int, sample: int) -> torch.Generator:
    """The CPU generator of sample ``sample`` of a request seeded with ``seed``."""
    mixed = (seed * SEED_MULTIPLIER + (sample + 1) * SEED_INCREMENT) % 2**64
    return torch.Generator().manual_seed(mixed)


@dataclass
class Row:
    """One logits row to turn into a token: its settings, its generator, for a repetition
    penalty the ids it has seen (prompt and generated), and the grammar matcher of a constrained
    request (``radixcache.engine.grammar``)."""

    params: SamplingParams
    generator: torch.Generator | None
    seen: set | None = None
    matcher: object = None


def choose_step(logits: torch.Tensor, rows: list[Row], masks) -> tuple[list[int], list]:
    """A step's tokens (``choose``) after ``masks`` (a ``GrammarMasks``) masked the constrained
    rows of ``logits`` in place, and per row its ``TokenLogprobs`` (None unless its params ask),
    read from the logits before any of that."""
    asking = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    raw = torch.log_softmax(logits[device_tensor(asking, logits.device)].float(), dim=-1) if asking else None
    constrained = [i for i, r in enumerate(rows) if r.matcher is not None]
    if constrained:
        masks.mask_rows(logits, constrained, [rows[i].matcher for i in constrained])
    tokens = choose(logits, rows)
    logprobs = [None] * len(rows)
    if asking:
        found = token_logprobs(raw, [tokens[i] for i in asking], [rows[i].params.logprobs for i in asking])
        for i, entry in zip(asking, found):
            logprobs[i] = entry
    return tokens, logprobs


def choose(logits: torch.Tensor, rows: list[Row]) -> list[int]:
    """Token ids for ``logits [len(rows), V]`` (any float dtype, any device), one per row."""
    scores = logits.float()
    penalised = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1]
    if penalised:
        scores = _repetition_penalty(scores, [rows[i] for i in penalised], penalised)
    sampled = [i for i, r in enumerate(rows) if r.params.do_sample]
    if not sampled:
        return scores.argmax(dim=-1).tolist()
    if len(sampled) == len(rows):
        return _sample(scores, rows).tolist()
    tokens = scores.argmax(dim=-1)
    index = device_tensor(sampled, tokens.device)
    tokens[index] = _sample(scores[index], [rows[i] for i in sampled])
    return tokens.tolist()


def token_logprobs(logprobs: torch.Tensor, tokens: list[int], top: list[int]) -> list[TokenLogprobs]:
    """Per row of ``logprobs [R, V]`` (log-softmax of raw logits): the logprob of ``tokens[r]`` and
    the ``top[r]`` most likely ``(id, logprob)`` pairs, most likely first; one host read."""
    index = device_tensor(tokens, logprobs.device)[:, None]
    chosen = logprobs.gather(1, index)[:, 0]
    k = max(top)
    if k:
        values, ids = logprobs.topk(k, dim=-1)
        values, ids = values.tolist(), ids.tolist()
    chosen = chosen.tolist()
    return [TokenLogprobs(chosen[r], tuple(zip(ids[r][:top[r]], values[r][:top[r]])) if k else ())
            for r in range(len(tokens))]


def _repetition_penalty(scores: torch.Tensor, rows: list[Row], indices: list[int]) -> torch.Tensor:
    """transformers' rule on every id a row has seen: positive logits / p, negative ones * p."""
    flat_rows, flat_cols, penalty = [], [], []
    for i, row in zip(indices, rows):
        ids = list(row.seen or ())  # distinct ids: the scatter below needs no order
        flat_rows.extend([i] * len(ids))
        flat_cols.extend(ids)
        penalty.extend([row.params.repetition_penalty] * len(ids))
    if not flat_cols:
        return scores
    device = scores.device
    r, c = device_tensor(flat_rows, device), device_tensor(flat_cols, device)
    p = device_tensor(penalty, device, torch.float32)
    picked = scores[r, c]
    scores = scores.clone()
    scores[r, c] = torch.where(picked > 0, picked / p, picked * p)
    return scores


def _sample(scores: torch.Tensor, rows: list[Row]) -> torch.Tensor:
    """One token per row by inverse-CDF sampling of its filtered, tempered distribution."""
    device = scores.device
    temps = device_tensor([r.params.temperature for r in rows], device, torch.float32)
    logits = scores / temps[:, None]
    top_k = [r.params.top_k for r in rows]
    top_p = [r.params.top_p for r in rows]
    min_p = [r.params.min_p for r in rows]
    uniform = device_tensor([float(torch.rand((), generator=r.generator)) for r in rows], device,
                            torch.float32)
    if not any(top_k) and all(p == 1 for p in top_p) and not any(min_p):
        probs = torch.softmax(logits, dim=-1)
        return _inverse_cdf(probs, uniform)
    logits, order = logits.sort(dim=-1, descending=True)
    if any(top_k):
        k = device_tensor([k or logits.shape[-1] for k in top_k], device)
        ranks = torch.arange(logits.shape[-1], device=device)
        logits = logits.masked_fill(ranks[None, :] >= k[:, None], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if any(p < 1 for p in top_p):
        p = device_tensor(top_p, device, torch.float32)
        before = probs.cumsum(dim=-1) - probs  # mass strictly above each token: keeps the first
        probs = probs.masked_fill(before >= p[:, None], 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    if any(min_p):
        m = device_tensor(min_p, device, torch.float32)
        probs = probs.masked_fill(probs < m[:, None] * probs[:, :1], 0.0)
    return order.gather(1, _inverse_cdf(probs, uniform)[:, None])[:, 0]


def _inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Index of the first entry whose cumulative (unnormalised) mass exceeds ``uniform * total``."""
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    # strictly below the total (u * total can round up to it), so the first entry whose cumulative
    # mass exceeds it has mass of its own: a zero-probability entry repeats its predecessor's sum
    target = torch.minimum(uniform[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True)[:, 0]
