"""Argument checks of the kv-size calculator: ints with a minimum, and the consistency of a
``radixcache.app.kv_size.KVShape``'s fields (its sliding window, its MLA dims, its head counts).

Each check raises ``TypeError`` / ``ValueError`` naming the field (and the shape) at fault and
returns nothing otherwise (``check_int`` returns the value). Pure Python, no imports of the rest.
"""

from __future__ import annotations


def check_int(value, what: str, minimum: int) -> int:
    """``value`` when it is an int >= ``minimum``; TypeError/ValueError naming ``what`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {value}")
    return value


def check_window(shape) -> None:
    """``shape.sliding_layers`` is an int >= 0; without a ``sliding_window`` it is 0, with one
    (an int >= 1) it is 1..``shape.layers``."""
    check_int(shape.sliding_layers, "sliding_layers", 0)
    if shape.sliding_window is None:
        if shape.sliding_layers:
            raise ValueError(f"{shape.name}: sliding_layers without a sliding_window")
        return
    check_int(shape.sliding_window, "sliding_window", 1)
    if not 1 <= shape.sliding_layers <= shape.layers:
        raise ValueError(f"{shape.name}: a sliding window needs 1..{shape.layers} sliding_layers, "
                         f"got {shape.sliding_layers}")


def check_mla(shape) -> None:
    """An MLA shape has a latent (``latent_dim`` >= 1), keys wider than their rope part
    (``head_dim`` > ``rope_dim``) and no more KV heads than query heads (when those are given)."""
    if shape.latent_dim < 1:
        raise ValueError(f"{shape.name}: MLA needs latent_dim >= 1")
    if shape.head_dim <= shape.rope_dim:
        raise ValueError(f"{shape.name}: MLA keys are qk_nope + qk_rope ({shape.rope_dim}) wide, "
                         f"got head_dim {shape.head_dim}")
    if shape.query_heads is not None and shape.kv_heads > shape.query_heads:
        raise ValueError(f"{shape.name}: kv_heads ({shape.kv_heads}) exceeds "
                         f"query_heads ({shape.query_heads})")


def check_heads(shape) -> None:
    """A non-MLA shape has no latent or rope dims, one head dim for K and V, one KV head for
    MQA, and, when ``query_heads`` is given, head counts its ``attention`` kind means (MHA: as many
    KV heads as query heads; GQA: more than one and fewer than the query heads)."""
    if shape.latent_dim or shape.rope_dim:
        raise ValueError(f"{shape.name}: latent_dim/rope_dim apply only to MLA, not {shape.attention}")
    if shape.head_dim_v != shape.head_dim:
        raise ValueError(f"{shape.name}: K and V of different head dims ({shape.head_dim}, "
                         f"{shape.head_dim_v}) apply only to MLA, not {shape.attention}")
    if shape.attention == "MQA" and shape.kv_heads != 1:
        raise ValueError(f"{shape.name}: MQA means one KV head, got kv_heads={shape.kv_heads}")
    if shape.query_heads is None:
        return
    if shape.kv_heads > shape.query_heads:
        raise ValueError(f"{shape.name}: kv_heads ({shape.kv_heads}) exceeds "
                         f"query_heads ({shape.query_heads})")
    if shape.attention == "MHA" and shape.kv_heads != shape.query_heads:
        raise ValueError(f"{shape.name}: MHA means kv_heads == query_heads, "
                         f"got {shape.kv_heads} != {shape.query_heads}")
    if shape.attention == "GQA" and not 1 < shape.kv_heads < shape.query_heads:
        raise ValueError(f"{shape.name}: GQA means 1 < kv_heads < query_heads, "
                         f"got {shape.kv_heads} of {shape.query_heads}")
