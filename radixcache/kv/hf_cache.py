"""A transformers ``Cache`` whose layers read and write the paged ``KVPool``.

``PagedCache`` serves one batch of sequences inside ``model(...)`` or ``model.generate(...)``.
Column ``c`` of batch row ``r`` lives at pool K row ``k_rows[r, c]`` (padding columns point at the
null block). Each layer keeps its own fill length; ``update`` writes the new K/V into the pool and
returns the K/V of every filled column, so the model's own attention (sdpa, eager, ...) and its own
masks (aligned to the end of the KV through ``get_mask_sizes``) run unchanged.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from radixcache.errors import CacheError
from radixcache.kv.pool import KVPool


class PagedLayer(CacheLayerMixin):
    """One model layer's view of the pool for a batch (see module docstring)."""

    is_sliding = False
    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, pool: KVPool, layer_idx: int, k_rows: torch.Tensor, length: int):
        super().__init__()
        self.pool = pool
        self.layer_idx = layer_idx
        self.k_rows = k_rows
        self.length = length
        self.is_initialized = True
        self.device = pool.device

    def lazy_initialization(self, key_states, value_states) -> None:  # storage exists already
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write ``[B, kv_heads, n, head_dim]`` new K/V after the filled columns; return all of them."""
        batch, heads, n, dim = key_states.shape
        pool = self.pool
        if heads != pool.num_kv_heads or dim != pool.head_dim:
            raise CacheError(f"layer {self.layer_idx} produced K/V with {heads} heads of {dim}, the pool "
                             f"holds {pool.num_kv_heads} heads of {pool.head_dim}")
        end = self.length + n
        if end > self.k_rows.shape[1]:
            raise CacheError(f"sequence grew to {end} tokens, beyond the {self.k_rows.shape[1]} reserved")
        new_rows = self.k_rows[:, self.length:end].reshape(-1)
        pool.write(self.layer_idx, new_rows,
                   key_states.transpose(1, 2).reshape(-1, heads, dim),
                   value_states.transpose(1, 2).reshape(-1, heads, dim))
        self.length = end
        keys, values = pool.read(self.layer_idx, self.k_rows[:, :end].reshape(-1))
        keys = keys.view(batch, end, heads, dim).transpose(1, 2)
        values = values.view(batch, end, heads, dim).transpose(1, 2)
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """KV length the next forward sees (filled + new) and its offset (always 0: nothing slides)."""
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        """Columns already filled."""
        return self.length

    def get_max_length(self) -> int:
        """Columns reserved for this batch."""
        return self.k_rows.shape[1]

    def reset(self) -> None:
        """Forget the fill length (the pool keeps its contents; the tree owns them)."""
        self.length = 0

    def reorder_cache(self, beam_idx) -> None:
        """Not supported: beam search falls back to plain ``generate``."""
        raise CacheError("paged KV cache does not support beam reordering")

    def crop(self, tokens_to_remove: int) -> None:
        """Not supported: assisted decoding falls back to plain ``generate``."""
        raise CacheError("paged KV cache does not support cropping")

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Not supported: ``num_return_sequences > 1`` falls back to plain ``generate``."""
        raise CacheError("paged KV cache does not support expanding the batch")

    def batch_select_indices(self, indices) -> None:
        """Not supported (contrastive search)."""
        raise CacheError("paged KV cache does not support selecting batch rows")


class PagedCache(Cache):
    """A ``Cache`` over ``pool`` for a batch whose column c of row r lives at ``k_rows[r, c]``;
    the first ``length`` columns are already filled."""

    def __init__(self, pool: KVPool, k_rows: torch.Tensor, length: int):
        if k_rows.dim() != 2:
            raise ValueError("k_rows must be [batch, columns]")
        layers = [PagedLayer(pool, i, k_rows, length) for i in range(pool.num_layers)]
        super().__init__(layers=layers)
        self.pool = pool
        self.k_rows = k_rows
