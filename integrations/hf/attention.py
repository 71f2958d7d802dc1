"""Route a model's attention through radixcache's backends for forwards that carry a radixcache cache.

``install(model)`` registers, under ``radixcache_paged_<original>``, an attention function and a
mask function and switches the model to them (idempotent). For a forward whose cache is a
``PlannedCache`` (``lm.generate`` and the engine) the mask function builds nothing and the attention
function writes the new K/V it is handed into the pool and attends over the block tables through
the step's backend. Every other forward (plain ``model.generate``, another cache, no cache) gets the
model's original attention and masks.

A compiled step (``HFModelRunner`` with ``compile=True``) cannot run Python per layer inside the
graph: there the hook calls ``radixcache::paged_attention``, a custom op opaque to the compiler
that writes the layer's K/V and attends through the ``StepCache`` of ``compiled_step``.

Attention arguments radixcache's backends do not implement (attention sinks ``s_aux``, an additive
``position_bias``, an attention mask the model built itself, dropout while training, any other
tensor argument) raise ``UnsupportedAttention``: the entry points fall back to plain transformers
instead of computing something else.
"""

from __future__ import annotations

import sys
import threading
from contextlib import contextmanager

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from radixcache.errors import CacheError
from radixcache.integrations.hf.cache import (PREFIX, PagedOffset, compiled_cache, in_compiled_step,
                                              take_planned)

# keyword arguments the backends implement or that carry nothing attention needs
HANDLED = {"scaling", "sliding_window", "softcap", "dropout", "is_causal", "position_ids",
           "cache_position", "output_attentions", "use_cache", "position_embeddings"}


_RECORDING = threading.local()


@contextmanager
def recording_kv_shapes():
    """Within it, every call of this thread to an installed attention hook (planned or not) appends
    ``(kv heads, K head dim, V head dim)`` of the key and value it is handed to the yielded list:
    what a paged pool must hold for that layer, whatever the model caches before it."""
    shapes: list = []
    _RECORDING.shapes = shapes
    try:
        yield shapes
    finally:
        _RECORDING.shapes = None


class UnsupportedAttention(CacheError):
    """A planned forward asked for attention radixcache's backends do not compute."""


def install(model) -> None:
    """Make every attention layer of ``model`` serve radixcache's planned forwards (idempotent)."""
    original = model.config._attn_implementation
    if original.startswith(PREFIX):
        return
    name = PREFIX + original
    if name not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(name, _make_attention(original))
        mask = ALL_MASK_ATTENTION_FUNCTIONS[original] if original in ALL_MASK_ATTENTION_FUNCTIONS \
            else ALL_MASK_ATTENTION_FUNCTIONS["eager"]
        AttentionMaskInterface.register(name, _make_mask(mask))
    model.set_attn_implementation(name)


def unsupported_arguments(module, attention_mask, kwargs) -> str | None:
    """Why a planned forward with these attention arguments cannot be served, or None."""
    if kwargs.get("s_aux") is not None:
        return "attention sinks (s_aux)"
    if kwargs.get("position_bias") is not None:
        return "an additive attention bias (position_bias)"
    if kwargs.get("dropout"):
        return "attention dropout (the model is in training mode)"
    if attention_mask is not None:
        return "an attention mask built by the model itself"
    for name, value in kwargs.items():
        if name not in HANDLED and isinstance(value, torch.Tensor):
            return f"the attention argument {name!r}"
    return None


@torch.library.custom_op("radixcache::paged_attention", mutates_args=())
def paged_attention_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int,
                       scale: float, sliding_window: int, softcap: float) -> torch.Tensor:
    """Write ``key`` / ``value`` (``[1, kv_heads, T, d]``) of ``layer`` into the pool and attend
    ``query`` (``[1, heads, T, d]``) through the step of ``compiled_step`` -> ``[1, T, heads, dv]``.
    ``sliding_window`` 0 and ``softcap`` 0.0 mean none. Raises ``CacheError`` outside a step."""
    cache = compiled_cache()
    if cache is None:
        raise CacheError("radixcache::paged_attention ran outside compiled_step()")
    cache.write(layer, key, value)
    return cache.attend(layer, query, scale, sliding_window or None, softcap or None)


@paged_attention_op.register_fake
def _paged_attention_shape(query, key, value, layer, scale, sliding_window, softcap):
    return query.new_empty(query.shape[0], query.shape[2], query.shape[1], value.shape[-1])


def _make_attention(original: str):
    def paged_attention(module, query, key, value, attention_mask, **kwargs):
        if in_compiled_step():  # traced into a compiled engine step: planned before the graph
            reason = unsupported_arguments(module, attention_mask, kwargs)
            if reason:
                raise UnsupportedAttention(f"{type(module).__name__} needs {reason}")
            scale = kwargs.get("scaling") or query.shape[-1] ** -0.5
            out = paged_attention_op(query, key, value, module.layer_idx, scale,
                                     kwargs.get("sliding_window") or 0, kwargs.get("softcap") or 0.0)
            return out, None
        recording = getattr(_RECORDING, "shapes", None)
        if recording is not None:
            recording.append((key.shape[1], key.shape[-1], value.shape[-1]))
        planned = take_planned(query, key)
        if planned is None:
            return _original_function(original, module)(module, query, key, value, attention_mask,
                                                        **kwargs)
        cache, layer = planned
        reason = unsupported_arguments(module, attention_mask, kwargs)
        if reason:
            raise UnsupportedAttention(f"{type(module).__name__} needs {reason}")
        scale = kwargs.get("scaling")
        if scale is None:
            scale = query.shape[-1] ** -0.5
        cache.write(layer, key, value)
        out = cache.attend(layer, query, scale, kwargs.get("sliding_window"), kwargs.get("softcap"))
        return out, None

    return paged_attention


def _make_mask(original):
    def paged_mask(*args, **kwargs):
        if isinstance(kwargs.get("kv_offset"), PagedOffset):
            return None  # a planned forward: the backends read the block tables, not a mask
        return original(*args, **kwargs)

    return paged_mask


def _original_function(original: str, module):
    if original != "eager" and original in ALL_ATTENTION_FUNCTIONS:
        return ALL_ATTENTION_FUNCTIONS[original]
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if eager is None:
        raise CacheError(f"cannot find the original '{original}' attention of {type(module).__name__}")
    return eager
