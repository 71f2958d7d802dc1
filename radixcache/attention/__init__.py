"""Paged attention over the KV pool: the step plan and its backends.

A ``StepPlan`` describes one forward (which new tokens belong to which sequence, where their K/V
go, which blocks each attends to); a backend (``torch`` reference, ``flashinfer`` on CUDA) attends
over the block tables. Nothing here imports transformers: the adapter that routes a model's
attention layers here lives in ``radixcache.integrations.hf``.
"""

from radixcache.attention.plan import Segment, StepPlan
from radixcache.attention.select import resolve_backend

__all__ = ["Segment", "StepPlan", "resolve_backend"]
