"""The transformers adapter: ``wrap(model)`` -> ``CachedLM``, a drop-in ``generate`` and a batching
``generate_batch`` over the radix cache."""

from radixcache.integrations.hf.identity import kv_geometry, model_identity
from radixcache.integrations.hf.lm import CachedLM, wrap

__all__ = ["CachedLM", "kv_geometry", "model_identity", "wrap"]
