"""What transformers sees of a radixcache cache besides the cache itself: the per-layer views its
``Cache`` API expects (``CacheLayer``) and the marked KV offset reported to its mask builders
(``PagedOffset``). All K/V state lives in the owning cache (``radixcache.integrations.hf.cache``)."""

from __future__ import annotations

from transformers.cache_utils import Cache, CacheLayerMixin

from radixcache.errors import CacheError

__all__ = ["PAGED_OFFSET", "CacheLayer", "PagedOffset"]


class PagedOffset(int):
    """The KV offset (always 0) a ``PlannedCache`` reports to transformers' mask builders; the
    registered mask function sees it and builds no mask, since radixcache's backends read none."""


PAGED_OFFSET = PagedOffset(0)


class CacheLayer(CacheLayerMixin):
    """Per-layer view transformers expects of ``owner`` (a ``PlannedCache``); all state lives in
    the owning cache, and every operation a radixcache cache does not support (beam reordering,
    cropping, batch expansion, row selection, reset) raises ``CacheError`` (their modes fall back
    to plain generate)."""

    is_sliding = False
    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, owner: Cache):
        super().__init__()
        self.owner = owner
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:  # the pool exists already
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        raise CacheError("a radixcache cache is updated through the cache, not its layers")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.get_seq_length() + query_length, PAGED_OFFSET

    def get_seq_length(self) -> int:
        return self.owner.get_seq_length()

    def get_max_length(self) -> int:
        return -1  # grows lazily, bounded only by the pool

    def reset(self) -> None:
        raise CacheError("a radixcache cache cannot be reset")

    def reorder_cache(self, beam_idx) -> None:
        raise CacheError("a radixcache cache does not support beam reordering")

    def crop(self, tokens_to_remove: int) -> None:
        raise CacheError("a radixcache cache does not support cropping")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise CacheError("a radixcache cache does not support expanding the batch")

    def batch_select_indices(self, indices) -> None:
        raise CacheError("a radixcache cache does not support selecting batch rows")
