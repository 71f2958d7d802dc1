"""The one bytes-per-token formula of radixcache: the KV pool sizes itself with it, ``kv-size``
prints it, the benchmarks quote it. Pure Python (no torch)."""

from __future__ import annotations


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim_k: int, head_dim_v: int,
                       element_bytes: int) -> int:
    """The bytes-per-token formula: layers x kv_heads x (head_dim_k + head_dim_v) x bytes per
    element (K and V of every layer). Every byte count in radixcache (the pool, the sizing table,
    benchmarks) comes from here."""
    return layers * kv_heads * (head_dim_k + head_dim_v) * element_bytes
