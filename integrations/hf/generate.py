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
"""

from __future__ import annotations

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from radixcache.integrations.hf.cache import GenerateRow, PagedCache
from radixcache.integrations.hf.inputs import eos_ids


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
    generated = sum(min(len(row.tokens), row.keep or len(row.tokens)) - row.prompt_len
                    for row in rows)
    manager.record_generated(generated)
    if not isinstance(out, torch.Tensor):
        out.cached_tokens = cached  # per row: prompt tokens served from the cache
    return out
