"""Checks of ``wrap()``'s and ``lm.generate``'s inputs, before anything changes (no block, no statistic)."""

from __future__ import annotations

import copy
from collections.abc import Mapping

import torch

LENGTH_ARGUMENTS = ("max_new_tokens", "max_length", "min_new_tokens", "min_length")


def check_wrap_arguments(model, block_size, max_cache_tokens, attention, model_id) -> None:
    """``TypeError``/``ValueError`` naming the first bad argument of ``wrap()``, before any work."""
    if not hasattr(model, "generate") or not hasattr(model, "config"):
        raise TypeError("wrap() takes a transformers PreTrainedModel with a generate() method")
    if attention not in ("auto", "torch", "flashinfer"):
        raise ValueError(f"attention must be 'auto', 'torch' or 'flashinfer', got {attention!r}")
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if model_id is not None and (not isinstance(model_id, str) or not model_id):
        raise TypeError(f"model_id must be a non-empty str or None, got {model_id!r}")
    if max_cache_tokens is not None and (not isinstance(max_cache_tokens, int)
                                         or isinstance(max_cache_tokens, bool)
                                         or max_cache_tokens < block_size):
        raise ValueError(f"max_cache_tokens must be an int >= block_size ({block_size}), "
                         f"got {max_cache_tokens!r}")


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


def checked_generation_config(model, kwargs: dict):
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


def checked_keep(keep_s) -> float | None:
    """``keep_s`` as float seconds (>= 0, finite) or None; ``TypeError``/``ValueError`` otherwise."""
    if keep_s is None:
        return None
    if isinstance(keep_s, bool) or not isinstance(keep_s, (int, float)):
        raise TypeError(f"keep_s must be a number of seconds or None, got {keep_s!r}")
    if not 0 <= keep_s < float("inf"):
        raise ValueError(f"keep_s must be finite and >= 0, got {keep_s!r}")
    return float(keep_s)
