"""Next-token choice for a whole step at once: greedy or sampled rows of ``[B, V]`` logits.

Rows follow transformers' order: the repetition penalty (greedy rows too, as a logits processor),
then for sampled rows temperature, top-k, top-p and min-p, each as one batched tensor operation
over the rows that use it. Every sample keeps its own
``torch.Generator``: it draws exactly one uniform number per token, and the token is the inverse
CDF of the row's distribution at that number, so a sample's tokens depend only on its seed and its
logits, never on the other rows of the batch. One host read per step returns every token.

No row can produce an id outside the vocabulary, and no row can harm another: a row whose logits
hold NaN or +inf (a model that overflowed), or that a grammar left without any allowed token, is
reported as an error of that row alone (``StepChoice.errors``) and chosen over zeros, so nothing
non-finite reaches the batched operations of the other rows. The extremes of every parameter are
``SamplingParams``' to define (a tiny temperature is greedy); this module only never overflows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from radixcache.attention.plan import device_tensor
from radixcache.engine.request import SamplingParams, TokenLogprobs

FLOAT32 = torch.finfo(torch.float32)
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


class StepChoice(NamedTuple):
    """A step's choice, one entry per row: ``tokens`` (ids in ``0..vocab_size-1``; 0 where the row
    failed), ``logprobs`` (``TokenLogprobs`` or None) and ``errors`` (None, or why the row has no
    token: its logits hold NaN or +inf, or every token is forbidden)."""

    tokens: list
    logprobs: list
    errors: list


ROW_OK, ROW_NOT_FINITE, ROW_NOTHING_ALLOWED = 0, 1, 2
ROW_ERRORS = {ROW_NOT_FINITE: "the model's logits hold NaN or +inf",
              ROW_NOTHING_ALLOWED: "no token is allowed: every logit is -inf after the grammar's mask"}


def choose_step(logits: torch.Tensor, rows: list[Row], masks, vocab_size: int | None = None) -> StepChoice:
    """A step's tokens (``choose``) after ``masks`` (a ``GrammarMasks``) masked the constrained
    rows of ``logits`` in place, and per row its ``TokenLogprobs`` (None unless its params ask),
    read from the logits before any of that. Columns from ``vocab_size`` on (a padded output
    layer) are never chosen. A row whose raw logits hold NaN or +inf, or that has no finite logit
    left after the mask, gets an error instead of a token; the other rows are chosen exactly as
    without it. One host read for the whole step."""
    if vocab_size is not None and logits.shape[-1] > vocab_size:
        logits = logits[:, :vocab_size]
    asking = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    raw = torch.log_softmax(logits[device_tensor(asking, logits.device)].float(), dim=-1) if asking else None
    top = logits.amax(dim=-1)
    faults = torch.where(torch.isnan(top) | torch.isposinf(top), ROW_NOT_FINITE, ROW_OK)
    constrained = [i for i, r in enumerate(rows) if r.matcher is not None]
    if constrained:
        masks.mask_rows(logits, constrained, [rows[i].matcher for i in constrained])
        top = logits.amax(dim=-1)
    faults = torch.where((faults == ROW_OK) & torch.isneginf(top), ROW_NOTHING_ALLOWED, faults)
    tokens, faults = torch.stack([_choose(logits.float(), rows, faults == ROW_OK), faults]).tolist()
    logprobs = [None] * len(rows)
    if asking:
        found = token_logprobs(raw, [tokens[i] for i in asking], [rows[i].params.logprobs for i in asking])
        for i, entry in zip(asking, found):
            logprobs[i] = entry
    errors = [ROW_ERRORS.get(f) for f in faults]
    return StepChoice([t if e is None else 0 for t, e in zip(tokens, errors)], logprobs, errors)


def choose(logits: torch.Tensor, rows: list[Row]) -> list[int]:
    """Token ids for ``logits [len(rows), V]`` (any float dtype, any device, finite or -inf), one
    per row, each in ``0..V-1``."""
    return _choose(logits.float(), rows).tolist()


def _choose(scores: torch.Tensor, rows: list[Row], ok: torch.Tensor | None = None) -> torch.Tensor:
    """``choose`` on the device; ``ok`` (bool per row, None: all) marks the rows worth choosing:
    the others are sampled over zeros (the token is never used), so no NaN of theirs reaches a
    batched operation, and greedy ones are taken as they come (an argmax is always in range)."""
    penalised = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1]
    if penalised:
        scores = _repetition_penalty(scores, [rows[i] for i in penalised], penalised)
    sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
    if not sampled:
        return scores.argmax(dim=-1)
    if len(sampled) == len(rows):
        return _sample(scores, rows, ok)
    tokens = scores.argmax(dim=-1)
    index = device_tensor(sampled, tokens.device)
    tokens[index] = _sample(scores[index], [rows[i] for i in sampled], None if ok is None else ok[index])
    return tokens


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
        penalty.extend([min(max(row.params.repetition_penalty, FLOAT32.tiny), FLOAT32.max)] * len(ids))
    if not flat_cols:
        return scores
    device = scores.device
    r, c = device_tensor(flat_rows, device), device_tensor(flat_cols, device)
    p = device_tensor(penalty, device, torch.float32)  # clamped above: float32 holds it
    picked = scores[r, c]
    scores = scores.clone()
    # a penalty near 0 or huge keeps a finite logit finite
    scores[r, c] = torch.where(picked > 0, picked / p, picked * p).clamp(-FLOAT32.max, FLOAT32.max)
    return scores


def _sample(scores: torch.Tensor, rows: list[Row], ok: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row by inverse-CDF sampling of its filtered, tempered distribution (rows not
    ``ok`` over zeros)."""
    device = scores.device
    if ok is not None:
        scores = torch.where(ok[:, None], scores, 0.0)
    temps = device_tensor([r.params.temperature for r in rows], device, torch.float32)
    # shifted to a maximum of 0 first: a small temperature then sends logits to -inf, never to
    # +inf (inf - inf would be NaN); the distribution is the same
    logits = (scores - scores.amax(dim=-1, keepdim=True)) / temps[:, None]
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
        before = probs.cumsum(dim=-1) - probs  # mass strictly above each token
        cut = before >= p[:, None]
        cut[:, 0] = False  # the most likely token stays, however small p is (0 in float32)
        probs = probs.masked_fill(cut, 0.0)
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
    # clamped: rounding in the cumulative sum can leave the target at its end
    return torch.searchsorted(cdf, target, right=True)[:, 0].clamp_(max=probs.shape[-1] - 1)
