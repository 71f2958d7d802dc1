"""``lm.generate_batch``: settings resolved like transformers, requests built, the engine run.

Unset sampling settings come from the model's ``generation_config`` and transformers' defaults,
resolved with transformers' own ``GenerationConfig.update`` on a copy (which validates them and
warns, as ``generate`` does, about sampling settings without ``do_sample``). A model whose engine
path failed the self-test is served one prompt at a time by plain ``model.generate`` with the same
settings instead.
"""

from __future__ import annotations

import copy
import itertools
from array import array

import numpy as np
import torch

from radixcache.engine import BatchOutput, BatchRun, Request, SamplingParams, StreamToken
from radixcache.integrations.hf.generate import eos_ids

TRANSFORMERS_DEFAULTS = dict(max_new_tokens=20, do_sample=False, temperature=1.0, top_k=50,
                             top_p=1.0, min_p=0.0, repetition_penalty=1.0)
_RUNS = itertools.count()


class FromModel:
    """Default of ``eos_token_id``: the model's ``generation_config.eos_token_id``."""

    def __repr__(self) -> str:
        return "<model.generation_config.eos_token_id>"


FROM_MODEL = FromModel()


def resolve_settings(model, explicit: dict, eos_token_id, stop_token_ids, vocab_size: int):
    """(settings for ``SamplingParams`` minus n/seed/stops, total length limit or None, stop ids)
    from the call's arguments. Without ``max_new_tokens`` anywhere, a ``max_length`` in the
    model's generation config is a total length (prompt included), as in transformers. Stop ids
    the caller gave (``stop_token_ids``, an explicit ``eos_token_id``) outside the vocabulary
    ``0..vocab_size-1`` are a ``ValueError`` naming them; the model's own EOS ids outside it (it
    can never produce them) are left out."""
    given = {k: v for k, v in explicit.items() if v is not None}
    if "max_new_tokens" in given and (isinstance(given["max_new_tokens"], bool)
                                      or not isinstance(given["max_new_tokens"], int)):
        raise TypeError(f"max_new_tokens must be an int, got {given['max_new_tokens']!r}")
    config = copy.deepcopy(model.generation_config)
    config.update(**given)  # transformers' validation (e.g. max_new_tokens <= 0 raises)
    settings = {}
    for name, default in TRANSFORMERS_DEFAULTS.items():
        value = getattr(config, name, None)
        settings[name] = default if value is None else value
    total = config.max_length if config.max_new_tokens is None and config.max_length else None
    given = set()
    if eos_token_id is FROM_MODEL:
        stops = {t for t in eos_ids(config) if t < vocab_size}
    else:
        holder = copy.deepcopy(config)
        holder.eos_token_id = eos_token_id
        stops = given = eos_ids(holder)
    if stop_token_ids is not None:
        if isinstance(stop_token_ids, int):
            stop_token_ids = [stop_token_ids]
        if isinstance(stop_token_ids, (str, bytes)) or not hasattr(stop_token_ids, "__iter__"):
            raise TypeError(f"stop_token_ids must be a collection of ints, got {stop_token_ids!r}")
        given = given | set(stop_token_ids)
        stops = stops | given
    bad = sorted(t for t in given if isinstance(t, int) and not isinstance(t, bool) and t >= vocab_size)
    if bad:
        raise ValueError(f"stop token ids {bad} are outside the vocabulary 0..{vocab_size - 1}")
    return settings, total, frozenset(stops)


def build_requests(lm, prompts, settings: dict, total, stops, n, seed, cache_salt,
                   priority, keep_s=None) -> list[Request]:
    """One checked ``Request`` per prompt (nothing is added anywhere yet); ``total``: a length
    limit including the prompt, or None."""
    if isinstance(prompts, (torch.Tensor, np.ndarray)):
        raise TypeError(f"prompts must be a list of prompts, got a {prompts.ndim}-D "
                        f"{type(prompts).__name__}: pass list(ids) for its rows (each row is then a "
                        "whole prompt, padding included) or a list of token-id lists")
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    run = next(_RUNS)
    params = SamplingParams(stop_token_ids=stops, n=n, seed=seed, **settings)
    requests = []
    for i, p in enumerate(prompts):
        if isinstance(p, torch.Tensor):
            if p.ndim != 1:
                raise TypeError(f"prompt {i} must be a 1-D list of token ids, got a {p.ndim}-D tensor")
            p = p.tolist()
        if isinstance(p, (str, bytes)) or not isinstance(p, (list, tuple, array)):
            raise TypeError(f"prompt {i} must be a list of token ids, got {type(p).__name__}")
        if not p:
            raise ValueError(f"prompt {i} is empty")
        if type(p) is not array and not all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            raise TypeError(f"prompt {i} must hold ints")
        if min(p) < 0 or max(p) >= lm.vocab_size:
            bad = next(t for t in p if not 0 <= t < lm.vocab_size)
            raise ValueError(f"prompt {i}: token id {bad} is outside the vocabulary "
                             f"0..{lm.vocab_size - 1}")
        own = params
        if total is not None:
            if total <= len(p):
                raise ValueError(f"prompt {i} has {len(p)} tokens but the generation config's "
                                 f"max_length (prompt included) is {total}: pass max_new_tokens")
            own = SamplingParams(**{**params.__dict__, "max_new_tokens": total - len(p)})
        requests.append(Request(("batch", run, i), p, own, cache_salt, priority,
                                keep_s=keep_s))
    return requests


def run_requests(engine, requests: list, fetched: list, stream: bool, progress: bool):
    """Run ``requests`` (``ValidRequest``s of ``engine``) with what the store gave each
    (``fetched``) on ``engine``: a ``BatchOutput``, or the ``BatchRun`` to iterate."""
    bar = None
    if progress:
        try:
            from tqdm.auto import tqdm
        except ImportError as e:
            raise ImportError("progress=True needs tqdm: pip install tqdm") from e
        bar = tqdm(total=sum(r.request.params.n for r in requests), unit="sample", desc="generate_batch")
    run = BatchRun(engine, requests, bar, fetched)
    return run if stream else run.result()


def plain_batch(lm, requests: list[Request], stream: bool):
    """The fallback: each prompt through plain ``model.generate`` with the same settings."""
    samples, reasons = [], []
    for r in requests:
        p = r.params
        kwargs = dict(max_new_tokens=p.max_new_tokens, do_sample=p.do_sample,
                      repetition_penalty=p.repetition_penalty, num_return_sequences=p.n,
                      eos_token_id=sorted(p.stop_token_ids) or None,
                      pad_token_id=lm.model.generation_config.pad_token_id or 0)
        if p.do_sample:
            kwargs.update(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                          min_p=p.min_p or None)
        if p.seed is not None:
            torch.manual_seed(p.seed)
        ids = torch.tensor([list(r.prompt)], device=lm.device)
        with torch.no_grad():
            out = lm.model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        rows = [_until_stop(row, p) for row in out[:, ids.shape[1]:].tolist()]
        samples.append([t for t, _ in rows])
        reasons.append([why for _, why in rows])
    result = BatchOutput(samples, [0] * len(requests), reasons)
    if not stream:
        return result
    return FinishedStream([StreamToken(i, j, t) for i, per in enumerate(result)
                           for j, s in enumerate(per) for t in s])


class FinishedStream:
    """The stream of a batch that already ran (the plain fallback): an iterator of its
    ``StreamToken``s that, like a ``BatchRun``, is a context manager with ``close()``."""

    def __init__(self, items: list):
        self._items = iter(items)

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._items)

    def close(self) -> None:
        """Drop what was not read (nothing holds a block: it all ran already)."""
        self._items = iter(())

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _until_stop(tokens: list, params: SamplingParams) -> tuple[list, str]:
    for i, t in enumerate(tokens):
        if t in params.stop_token_ids:
            return tokens[:i + 1], "stop"
    return tokens, "length"
