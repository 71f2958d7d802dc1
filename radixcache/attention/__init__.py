"""Paged attention over the KV pool for the batching engine.

``install(model)`` switches the model to an attention function that, when a forward carries a
``radixcache_plan`` keyword, writes the new K/V into the pool and attends over each sequence's
block table through a backend (``torch`` reference, ``flashinfer`` on CUDA); without a plan it calls
the model's original attention, so the rest of the model's users see no change.
"""

from radixcache.attention.plan import Segment, StepPlan
from radixcache.attention.install import install, resolve_backend

__all__ = ["Segment", "StepPlan", "install", "resolve_backend"]
