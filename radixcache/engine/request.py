"""The engine's public request and event types (what a front end such as the server builds on).

A front end creates a ``Request`` (prompt token ids, ``SamplingParams``, a cache salt, a priority,
optionally ``prefill_only``), hands it to ``Engine.add`` and calls ``Engine.step`` in a loop; each
step returns the ``Event`` objects it produced, at most one per running sample, in no particular
order across requests. Every sample of a request ends with exactly one event whose ``finished`` is
True; its ``finish_reason`` says why:

- ``"stop"``: the sample produced one of ``SamplingParams.stop_token_ids`` (the token is included),
  or a constrained request's grammar ended (``Request.constraint``; its stop token is included);
- ``"length"``: ``max_new_tokens`` were generated, or the sequence outgrew the whole KV pool;
- ``"abort"``: ``Engine.abort`` was called (the event carries no token);
- ``"prefilled"``: a ``prefill_only`` request has its prompt's K/V in the cache (no token);
- ``"error"``: this request's own failure, and nobody else's (``error`` says what; what earlier
  steps computed stays cached, nothing stays held; ``Engine.last_error`` is the exception): the
  model raised on a step even with this request alone in it, the sample's logits held NaN or +inf,
  no token was allowed (a grammar's mask left nothing), or a constrained sample's grammar refused
  the chosen token (the mask makes that impossible; the sample ends rather than go on off its
  grammar).

Types here are plain data: they import no model code and are safe to pass between threads.
"""

from __future__ import annotations

import math
import operator
from array import array
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import NamedTuple

from radixcache.errors import InvalidRequest, OutOfBlocks
from radixcache.tokens import token_array

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ABORT = "abort"
FINISH_PREFILLED = "prefilled"
FINISH_ERROR = "error"
FINISH_REASONS = (FINISH_STOP, FINISH_LENGTH, FINISH_ABORT, FINISH_PREFILLED, FINISH_ERROR)
MAX_TOP_LOGPROBS = 20
# Below this temperature sampling is greedy (vLLM's rule): the tempered distribution is one token
# up to float32 precision, and dividing logits by it would overflow.
MIN_TEMPERATURE = 1e-5


def _int(name: str, value, low: int) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}") from None
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return value


def _float(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


@dataclass(frozen=True)
class SamplingParams:
    """How the samples of one request are chosen; checked on construction.

    ``max_new_tokens`` (>= 1) bounds each sample. ``repetition_penalty`` (> 0; 1 is off) applies
    to every id of the prompt and of the sample, greedy or not, as in transformers.
    ``do_sample=False`` is greedy (the knobs below are then ignored); sampling applies, in
    transformers' order, ``temperature`` (> 0), ``top_k`` (0 is off), ``top_p`` (in (0, 1]) and
    ``min_p`` (in [0, 1); 0 is off). Every valid value gives a token of the vocabulary; at the
    extremes: a temperature below ``MIN_TEMPERATURE`` is greedy (``greedy``), ``top_k`` at or above
    the vocabulary is off, and the most likely token always survives ``top_p`` and ``min_p`` (a
    ``top_p`` near 0 or a ``min_p`` near 1 keeps it alone); a repetition penalty that would push a
    logit past float32's range stops at its largest finite value. ``stop_token_ids`` end a sample
    (EOS belongs here). ``n`` samples share the prompt's blocks. ``seed`` fixes each sample's own
    random stream: the same seed gives the same samples wherever the request sits in a batch
    (None: drawn from torch's global RNG when the request is added). ``logprobs`` (None: off; 0 to
    ``MAX_TOP_LOGPROBS``): every token's event carries its log-probability and that many most likely
    alternatives (``TokenLogprobs``), taken from the model's raw logits, before any processor.
    """

    max_new_tokens: int = 16
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: frozenset = field(default_factory=frozenset)
    n: int = 1
    seed: int | None = None
    logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        """Every token is the most likely one: ``do_sample`` is False or the temperature is below
        ``MIN_TEMPERATURE``."""
        return not self.do_sample or self.temperature < MIN_TEMPERATURE

    def __post_init__(self):
        set_ = object.__setattr__
        set_(self, "max_new_tokens", _int("max_new_tokens", self.max_new_tokens, 1))
        if not isinstance(self.do_sample, bool):
            raise TypeError(f"do_sample must be a bool, got {self.do_sample!r}")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
            set_(self, name, _float(name, getattr(self, name)))
        set_(self, "top_k", _int("top_k", self.top_k, 0))
        set_(self, "n", _int("n", self.n, 1))
        if self.seed is not None:
            set_(self, "seed", _int("seed", self.seed, 0))
        if self.logprobs is not None:
            set_(self, "logprobs", _int("logprobs", self.logprobs, 0))
            if self.logprobs > MAX_TOP_LOGPROBS:
                raise ValueError(f"logprobs must be at most {MAX_TOP_LOGPROBS}, got {self.logprobs}")
        if self.do_sample and not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 when sampling, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"min_p must be in [0, 1), got {self.min_p}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.n > 1 and not self.do_sample:
            raise ValueError(f"n={self.n} greedy samples would all be the same: use do_sample=True")
        stops = self.stop_token_ids
        if isinstance(stops, (str, bytes)) or not hasattr(stops, "__iter__"):
            raise TypeError(f"stop_token_ids must be a collection of ints, got {stops!r}")
        set_(self, "stop_token_ids", frozenset(_int("stop token id", t, 0) for t in stops))


@dataclass(frozen=True)
class Request:
    """One prompt for the engine.

    ``request_id`` (any hashable, unique among the engine's live requests) names it in events and
    in ``Engine.abort``. ``prompt``: the token ids (non-empty; a list, tuple, ``array`` or 1-D
    integer tensor), kept as an ``array('I')`` of its own: packed and checked once here, then
    carried through the engine and the cache as it is. ``cache_salt``: requests with
    different salts never share a block. ``priority``: lower runs first (ties: longest cached
    prefix first, then arrival). ``prefill_only``: compute the prompt's K/V into the cache and
    sample nothing (one ``"prefilled"`` event); it runs behind every normal request unless a normal
    request waits on the blocks it is computing, which promotes it to that request's priority.
    ``keep_s``: a hint that the conversation comes back within that many seconds (an agent
    waiting on a tool): when the request ends, what it computed is kept in preference to prefixes
    without a live hint (soft retention, see ``CacheManager.keep``); it never changes a token.
    ``constraint``: a compiled grammar (an ``xgrammar.CompiledGrammar`` built for this model's
    vocabulary) every sample must follow: each step masks the tokens it forbids, greedy or sampled,
    and the sample ends with ``"stop"`` when the grammar ends (its stop token included). What the
    cache holds is unchanged by it: the tokens generated and their K/V, as for any request.
    """

    request_id: Hashable
    prompt: array
    params: SamplingParams = field(default_factory=SamplingParams)
    cache_salt: str | None = None
    priority: int = 0
    prefill_only: bool = False
    keep_s: float | None = None
    constraint: object = None

    def __post_init__(self):
        try:
            hash(self.request_id)
        except TypeError:
            raise TypeError(f"request_id must be hashable, got {type(self.request_id).__name__}") from None
        prompt = self.prompt
        if isinstance(prompt, (str, bytes)) or not hasattr(prompt, "__len__"):
            raise TypeError(f"prompt must be a sequence of token ids, got {type(prompt).__name__}")
        if len(prompt) == 0:
            raise ValueError("empty prompt: a request needs at least one token")
        packed = token_array(prompt)
        object.__setattr__(self, "prompt", array("I", packed) if packed is prompt else packed)
        if not isinstance(self.params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(self.params).__name__}")
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise TypeError(f"cache_salt must be a str or None, got {type(self.cache_salt).__name__}")
        object.__setattr__(self, "priority", _int("priority", self.priority, -2**62))
        if not isinstance(self.prefill_only, bool):
            raise TypeError(f"prefill_only must be a bool, got {self.prefill_only!r}")
        if self.keep_s is not None:
            keep = _float("keep_s", self.keep_s)
            if keep < 0:
                raise ValueError(f"keep_s must be >= 0, got {keep}")
            object.__setattr__(self, "keep_s", keep)
        if self.constraint is not None and self.prefill_only:
            raise ValueError("a prefill_only request samples nothing: it takes no constraint")

    @property
    def num_samples(self) -> int:
        """How many samples end with a final event: 1 for a ``prefill_only`` request, else ``n``."""
        return 1 if self.prefill_only else self.params.n


class Event(NamedTuple):
    """What one step did for one sample of a request.

    ``token`` is the new token id (None for ``"abort"``, ``"prefilled"`` and ``"error"``);
    ``finished`` and ``finish_reason`` (one of ``FINISH_REASONS``, None while running) end the
    sample; ``cached_tokens`` is how many prompt tokens of the request were served from the cache
    at its first admission (``usage.prompt_tokens_details.cached_tokens``); ``error`` describes the
    failure of an ``"error"`` event, or why a ``"length"`` came before ``max_new_tokens`` (the
    sequence outgrew the pool); ``logprobs`` is the token's ``TokenLogprobs`` when the request
    asked for them (``SamplingParams.logprobs``), else None.
    """

    request_id: Hashable
    sample: int
    token: int | None
    finished: bool
    finish_reason: str | None
    cached_tokens: int
    error: str | None = None
    logprobs: "TokenLogprobs | None" = None


class TokenLogprobs(NamedTuple):
    """A generated token's natural-log probability under the model's raw logits (before the
    repetition penalty, temperature, top-k/p/min-p and any grammar mask) and the ``top`` most
    likely tokens there as ``(token id, logprob)`` pairs, most likely first."""

    logprob: float
    top: tuple = ()


class ValidRequest(NamedTuple):
    """A request ``engine``'s ``validate`` accepted, with its prompt as a new ``array('I')`` (the
    sequence the engine extends): ``Engine.add`` takes it without validating it again."""

    request: Request
    prompt: array
    engine: object


def request_namespace(model_id: str, cache_salt: str | None) -> tuple:
    """The tree namespace of a request: ``(model_id, cache_salt)``. The one rule: requests of other
    weights or another salt never share a block (the store's keys and the KV events derive from
    it too)."""
    return (model_id, cache_salt)


def validated_prompt(request: Request, vocab_size: int, num_blocks: int, block_size: int) -> array:
    """``request``'s prompt as a new ``array('I')`` (the sequence the engine extends), or
    ``TypeError`` (not a ``Request``), ``InvalidRequest`` (a ``ValueError``: a prompt or stop token
    id outside the vocabulary, each named, ``field`` the part at fault) or ``OutOfBlocks`` (a prompt whose K/V a pool of ``num_blocks`` blocks
    cannot hold even when empty; one that fits is served, and a sample that outgrows the pool
    ends with ``"length"``)."""
    if not isinstance(request, Request):
        raise TypeError(f"expected a radixcache.engine.Request, got {type(request).__name__}")
    tokens = array("I", request.prompt)
    validate_vocabulary(tokens, vocab_size, f"request {request.request_id!r}")
    stops = sorted(t for t in request.params.stop_token_ids if t >= vocab_size)
    if stops:
        raise InvalidRequest(f"request {request.request_id!r}: stop token ids {stops} are outside the "
                             f"vocabulary 0..{vocab_size - 1}", "stop_token_ids")
    if math.ceil(len(tokens) / block_size) > num_blocks:
        raise OutOfBlocks(f"request {request.request_id!r}: a prompt of {len(tokens)} tokens does not "
                          f"fit a pool of {num_blocks} blocks of {block_size}: raise max_cache_tokens")
    return tokens


def validate_vocabulary(tokens, vocab_size: int, what: str = "prompt") -> None:
    """``InvalidRequest`` (field "prompt") naming the first id of ``tokens`` (non-negative ints)
    outside the vocabulary ``0..vocab_size-1``, prefixed with ``what``; the one vocabulary check of
    a request's prompt."""
    if len(tokens) and max(tokens) >= vocab_size:
        bad = next(t for t in tokens if t >= vocab_size)
        raise InvalidRequest(f"{what}: token id {bad} is outside the vocabulary 0..{vocab_size - 1}", "prompt")
