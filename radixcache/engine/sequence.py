"""One sample being generated, and the per-request bookkeeping the engine keeps (internal types).

``Live`` is a request the engine still serves; ``Sequence`` one of its samples. ``new_leader``
builds sample 0 when a request is added (it carries the fork count of the request);
``fork_samples`` builds samples 1..n-1 right after the leader's prompt was computed. Both give every
sample its own sampling state (``start_sampling``): a generator when the request samples, the seen
ids for a repetition penalty, a grammar matcher for a constrained request.
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass, field

import torch

from radixcache.engine import grammar
from radixcache.engine.request import Request
from radixcache.engine.sampling import sample_generator


PREFILL_ONLY_PRIORITY = math.inf  # behind every normal request until promoted


@dataclass(eq=False)
class Live:
    """A request the engine still serves: its samples, which of them finished, its cache hit."""

    request: Request
    namespace: tuple
    seed: int
    cached_tokens: int = 0
    admitted: bool = False
    finished: set = field(default_factory=set)  # sample indices that got their final event
    boost: float = math.inf  # promoted priority of a prefill-only request (lower runs first)

    @property
    def priority(self) -> float:
        """Effective priority: the request's own, a prefill-only one's boost (``inf`` unless a
        normal request waits on it)."""
        if self.request.prefill_only:
            return min(self.boost, PREFILL_ONLY_PRIORITY)
        return self.request.priority


@dataclass(eq=False)
class Sequence:
    """One sample: ``tokens`` = prompt + generated so far (an ``array('I')``, only ever appended
    to); ``lease`` its hold on the cache while it runs (None while waiting). ``fork`` samples are
    forked from its first-token logits."""

    live: Live
    sample: int
    tokens: array
    prompt_len: int
    arrival: int
    generator: torch.Generator | None = None
    seen: set | None = None  # ids for the repetition penalty (prompt and generated)
    matcher: object = None  # the grammar matcher of a constrained request (radixcache.engine.grammar)
    fork: int = 1
    lease: object = None
    admitted: int = -1
    passed_over: int = 0
    resumed: bool = False  # preempted (or forked without a block) and waiting to come back
    peeked: tuple = (-1, -1, -1, 0, b"")  # (epoch peeked at, epoch carried to, token count,
    #                                      cached prefix, packed tokens of the first missing block)
    hashes: list = field(default_factory=list)  # chained hashes of the whole blocks of tokens

    @property
    def request(self) -> Request:
        """The request this sample belongs to."""
        return self.live.request

    @property
    def computed(self) -> int:
        """Leading tokens whose K/V are in the lease's blocks (0 while waiting)."""
        return self.lease.computed if self.lease is not None else 0

    @property
    def generated(self) -> list:
        """Tokens generated so far (the prompt not repeated)."""
        return self.tokens[self.prompt_len:]

    @property
    def in_prompt(self) -> bool:
        """True while part of the prompt still has to be computed."""
        return self.computed < self.prompt_len

    def block_hashes(self, n: int, block_size: int) -> list:
        """Chained hashes of the namespace and the first ``n`` whole blocks of ``tokens`` (``n`` at
        most as many as ``tokens`` has): entry k stands for blocks 0..k together. Computed once per
        block (tokens only ever grow, so earlier entries stay right)."""
        hashes, tokens = self.hashes, self.tokens
        h = hashes[-1] if hashes else hash(self.live.namespace)
        for k in range(len(hashes), n):
            h = hash((h, tokens[k * block_size:(k + 1) * block_size].tobytes()))
            hashes.append(h)
        return hashes


def start_sampling(seq: Sequence) -> None:
    """Give ``seq`` the sampling state its request's parameters and constraint call for."""
    params = seq.request.params
    if params.do_sample:
        seq.generator = sample_generator(seq.live.seed, seq.sample)
    if params.repetition_penalty != 1:
        seq.seen = set(seq.tokens)
    if seq.request.constraint is not None:
        seq.matcher = grammar.new_matcher(seq.request.constraint)


def new_leader(live: Live, tokens: array, arrival: int) -> Sequence:
    """Sample 0 of ``live``'s request over prompt ``tokens`` (``arrival`` orders admission); it
    forks the request's other samples once its prompt is computed."""
    leader = Sequence(live, 0, tokens, len(tokens), arrival, fork=live.request.num_samples)
    start_sampling(leader)
    return leader


def fork_samples(leader: Sequence) -> list[Sequence]:
    """Samples 1..``leader.fork``-1 of ``leader``'s request, each with a copy of its tokens (the
    prompt), skipping those aborted before they existed; ``leader`` itself is left unchanged."""
    children = []
    for i in range(1, leader.fork):
        if i in leader.live.finished:
            continue  # aborted before it existed
        child = Sequence(leader.live, i, leader.tokens[:], leader.prompt_len, leader.arrival)
        start_sampling(child)
        children.append(child)
    return children
