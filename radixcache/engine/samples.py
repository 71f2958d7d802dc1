"""The samples of a request: the ``Sequence`` objects the engine runs, each ready to generate.

``new_leader`` builds sample 0 when a request is added (it carries the fork count of the
request); ``fork_samples`` builds samples 1..n-1 right after the leader's prompt was computed.
Both give every sample its own sampling state (``start_sampling``): a generator when the request
samples, the seen ids for a repetition penalty, a grammar matcher for a constrained request.
"""

from __future__ import annotations

from array import array

from radixcache.engine import grammar
from radixcache.engine.sampling import sample_generator
from radixcache.engine.sequence import Live, Sequence


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
