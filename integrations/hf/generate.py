"""``lm.generate`` over the cache manager: transformers' own ``generate`` on a ``PagedCache``.

One call, per batch row: ``manager.admit`` (match all but the last token, pin, hold; a cached
partial last block is copied), then transformers' ``generate`` runs with a ``PagedCache`` that
claims the columns every row has cached, so a single cached prompt costs one forward over its
uncached suffix and sampling, streamers, processors and stopping are transformers' own. Blocks grow
as tokens arrive (layer 0 of each forward), whole blocks are committed as they complete, and on
every way out (return, exception, ``OutOfBlocks``) what was computed (up to each row's first EOS)
is committed, including the partial last block, and every lease is released.

When even eviction cannot supply the next block mid-generation, the call raises ``OutOfBlocks``
(no half answer is returned as if complete): what was computed is committed first, so the cache is
exact and a retry or a continuation of the same prompt reuses it.

Its inputs are read here too (``prompt_tensors``, ``split_mapping``, the caller's cache in
``passed_caches``, the call's ``validated_generation_config``), before anything changes (no
block, no statistic). What the paged path cannot serve runs as plain transformers
(``plain_generate``): ``passed_cache_reason`` decides whether the caches a call passed keep it on
the paged path (only a ``PagedCache`` of the same wrapper does); the fallback runs
``model.generate`` without prefix caching, records the reason in the manager's ledger
(``fallbacks`` in ``stats()``) and warns once per reason on the ``radixcache`` logger.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from radixcache.integrations.hf.cache import PagedCache, GenerateRow


LENGTH_ARGUMENTS = ("max_new_tokens", "max_length", "min_new_tokens", "min_length")


def split_mapping(input_ids, attention_mask):
    """``input_ids`` may be a mapping such as a ``BatchEncoding`` (what ``tokenizer(...)`` and
    ``apply_chat_template(...)`` return): take its ``input_ids`` and, unless ``attention_mask`` was
    passed on its own, its ``attention_mask``."""
    if not isinstance(input_ids, Mapping):
        return input_ids, attention_mask
    if "input_ids" not in input_ids:
        raise TypeError("a mapping passed as input_ids needs an 'input_ids' entry (a tokenizer's "
                        f"BatchEncoding); it has {sorted(map(str, input_ids))}")
    if attention_mask is None:
        attention_mask = input_ids.get("attention_mask")
    return input_ids["input_ids"], attention_mask


def _as_tensor(x, name: str) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x
    try:
        return torch.as_tensor(x)
    except (TypeError, ValueError, RuntimeError) as e:
        raise TypeError(f"{name} must be a tensor or a nested list of ints ({e})") from None


def prompt_tensors(input_ids, attention_mask, vocab_size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``[batch, length]`` int64 ids and 0/1 mask on ``device``, or ``TypeError``/``ValueError``
    naming the problem. The mask may be int, bool or float (of 0s and 1s)."""
    ids = _as_tensor(input_ids, "input_ids")
    if ids.numel() == 0:
        raise ValueError(f"empty prompt: input_ids has shape {tuple(ids.shape)}")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise TypeError(f"input_ids must hold integer token ids, got dtype {ids.dtype}")
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, length], got shape {tuple(ids.shape)}")
    ids = ids.long()
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ValueError(f"token id {bad} is outside the vocabulary 0..{vocab_size - 1}")
    if attention_mask is None:
        mask = torch.ones_like(ids)
    else:
        mask = _as_tensor(attention_mask, "attention_mask")
        if mask.dtype.is_complex:
            raise TypeError(f"attention_mask must hold 0s and 1s, got dtype {mask.dtype}")
        if mask.dim() == 1:
            mask = mask[None]
        if tuple(mask.shape) != tuple(ids.shape):
            raise ValueError(f"attention_mask shape {tuple(mask.shape)} does not match "
                             f"input_ids shape {tuple(ids.shape)}")
        if ((mask != 0) & (mask != 1)).any():
            raise ValueError("attention_mask must hold only 0s and 1s")
        mask = mask.long()
        if (mask.sum(dim=1) == 0).any():
            raise ValueError("empty prompt: a row of attention_mask has no 1")
    return ids.to(device), mask.to(device)


CACHE_ARGUMENTS = ("cache", "past_key_values", "cache_params")  # transformers' name, then its old ones


def passed_caches(kwargs: dict) -> list:
    """Take the caller's cache out of ``kwargs`` (a list: empty, or the one cache passed), under
    transformers' name ``cache`` or its deprecated ``past_key_values`` / ``cache_params``, which
    are accepted alike and never reach transformers (so neither warns). ``None`` means no cache.
    ``ValueError`` when two names carry different caches."""
    given = [kwargs.pop(name) for name in CACHE_ARGUMENTS if name in kwargs]
    given = [cache for cache in given if cache is not None]
    if any(cache is not given[0] for cache in given[1:]):
        raise ValueError("pass one cache: cache= and past_key_values= name different objects")
    return given[:1]


def validated_generation_config(model, kwargs: dict):
    """A copy of the call's generation config (``generation_config=`` or the model's) updated with
    the call's keyword arguments and validated by transformers' own ``GenerationConfig.update``
    (e.g. ``max_new_tokens <= 0`` raises ``ValueError``). Length arguments that are not ints raise
    ``TypeError`` naming the argument. Nothing of the caller's is modified."""
    for name in LENGTH_ARGUMENTS:
        value = kwargs.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    config = copy.deepcopy(kwargs.get("generation_config") or model.generation_config)
    config.update(**{k: v for k, v in kwargs.items() if k != "generation_config"})
    return config


def eos_ids(config) -> set:
    """The EOS token ids a generation config stops at (empty when EOS is off)."""
    eos = config.eos_token_id
    if eos is None:
        return set()
    if isinstance(eos, torch.Tensor):
        eos = eos.tolist()
    return {int(e) for e in eos} if isinstance(eos, (list, tuple, set)) else {int(eos)}


logger = logging.getLogger("radixcache")


def passed_cache_reason(passed: list, owner) -> str | None:
    """Why the caches in ``passed`` (from ``passed_caches``) send the call to plain generate, or
    None when there are none or each is a ``PagedCache`` of ``owner`` (released when its call
    returned: the tree holds its prefix). ``ValueError`` for a ``PagedCache`` of another wrapper."""
    for cache in passed:
        if isinstance(cache, PagedCache):
            if cache.owner is not owner:
                raise ValueError("this PagedCache belongs to another radixcache wrapper; "
                                 "pass it to the lm.generate that returned it")
            continue  # ours, released when its call returned: the tree holds its prefix
        return "caller passed its own cache"
    return None


def plain_generate(model, manager, reason: str, kwargs: dict, passed: list, warned: set):
    """``model.generate(**kwargs)`` under ``torch.no_grad()``, with the caller's own cache (the
    first of ``passed`` that is not a ``PagedCache``) as ``cache=``. Records ``reason`` with
    ``manager.record_fallback``; warns when ``reason`` is not in ``warned`` yet (and adds it)."""
    manager.record_fallback(reason)
    if reason not in warned:
        warned.add(reason)
        logger.warning("radixcache: %s; using plain model.generate (no prefix caching)", reason)
    own = [c for c in passed if not isinstance(c, PagedCache)]
    if own:
        kwargs["cache"] = own[0]  # transformers' name (past_key_values is deprecated)
    with torch.no_grad():
        return model.generate(**kwargs)


class TokensSeen(StoppingCriteria):
    """Never stops anything: keeps transformers' ``input_ids`` after each step (``latest``), from
    which the ``PagedCache`` learns the token ids it computes."""

    def __init__(self):
        self.latest = None

    def __call__(self, input_ids, scores, **kwargs):
        self.latest = input_ids
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def unsupported_call(config, mask, kwargs) -> str | None:
    """Why this call needs plain ``model.generate`` (given its validated generation config)."""
    if (config.num_beams or 1) > 1:
        return "beam search"
    if (config.num_return_sequences or 1) > 1:
        return "num_return_sequences > 1"
    if kwargs.get("assistant_model") is not None or config.prompt_lookup_num_tokens:
        return "assisted decoding"
    if config.penalty_alpha:
        return "contrastive search"
    if config.use_cache is False:
        return "use_cache=False"
    if kwargs.get("inputs_embeds") is not None:
        return "inputs_embeds"
    if config.cache_implementation:
        return "cache_implementation set"
    if config.return_dict_in_generate and (config.output_attentions or config.output_hidden_states):
        # a cached prefix is never recomputed, so its attentions and hidden states do not exist
        return "output_attentions / output_hidden_states"
    if (mask[:, 1:] < mask[:, :-1]).any():
        return "attention_mask is not left-padded"
    return None


def generate_paged(lm, ids: torch.Tensor, mask: torch.Tensor, config, kwargs: dict, namespace,
                   keep_s: float | None = None):
    """Run one ``generate`` call through the paged path (see the module docstring)."""
    manager = lm.manager
    pads = (mask.shape[1] - mask.sum(dim=1)).tolist()
    prompts = [ids[r, pad:].tolist() for r, pad in enumerate(pads)]
    seen = TokensSeen()  # built before any admission: nothing below may fail holding leases
    stopping = StoppingCriteriaList(list(kwargs.get("stopping_criteria") or []) + [seen])
    kwargs = {k: v for k, v in kwargs.items() if k != "stopping_criteria"}  # the caller's stays whole
    eos = eos_ids(config)
    for tokens in prompts:  # a shared store's blocks after the local match (the network, no lock)
        manager.prefetch(tokens, namespace)
    rows = []
    with manager.mutex:
        try:
            for tokens, pad in zip(prompts, pads):
                rows.append(GenerateRow(tokens, pad, manager.admit(tokens, namespace)))
            cache = PagedCache(lm, manager, lm.pool, lm.backend, rows,
                               min(row.pad + row.lease.computed for row in rows), seen, eos, keep_s)
        except BaseException:
            for row in rows:
                manager.release(row.lease)
            raise
    cached = [row.lease.cached_tokens for row in rows]
    out = None
    try:
        with torch.no_grad():
            out = lm.model.generate(input_ids=ids, attention_mask=mask, cache=cache,
                                    stopping_criteria=stopping, **kwargs)
    finally:
        sequences = None if out is None else out if isinstance(out, torch.Tensor) else out.sequences
        cache.finish(sequences)
    generated = sum(min(len(row.tokens), row.eos_end or len(row.tokens)) - row.prompt_len
                    for row in rows)
    manager.record_generated(generated)
    if not isinstance(out, torch.Tensor):
        out.cached_tokens = cached  # per row: prompt tokens served from the cache
    return out
