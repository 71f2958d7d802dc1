"""The transformers adapter: ``wrap(model)`` -> ``CachedLM``, a drop-in ``generate`` over the radix cache."""

from radixcache.integrations.hf.lm import CachedLM, kv_geometry, model_fingerprint, wrap

__all__ = ["CachedLM", "kv_geometry", "model_fingerprint", "wrap"]
