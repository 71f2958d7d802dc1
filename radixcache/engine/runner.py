"""What the engine needs from a model (``ModelRunner``) and what it measures about its steps."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from radixcache.attention.plan import StepPlan


class ModelRunner(ABC):
    """One model behind the engine: a forward over packed tokens that attends through a StepPlan.

    ``vocab_size`` bounds token ids; ``device`` is where the pool and logits live; ``model_id``
    names the weights (it roots every namespace, so K/V of other weights are never served; it may
    change between steps, e.g. after the weights changed). Integrations supply the implementation
    (``radixcache.integrations.hf`` for transformers); the engine imports none of them.
    """

    vocab_size: int
    device: torch.device
    model_id: str

    @abstractmethod
    def forward(self, tokens: list, positions: list, plan: StepPlan, logits_rows: list) -> torch.Tensor:
        """Run the model once over ``tokens`` (packed in the plan's segment order) at absolute
        ``positions``: every layer writes its new K/V through ``plan.write`` and attends through
        ``plan.attend``. Returns float logits ``[len(logits_rows), vocab_size]`` of the packed rows
        ``logits_rows``. May raise; the engine then backs out the step."""


@dataclass
class EngineMetrics:
    """Cumulative counters of one engine (benchmarks diff them): ``steps``, ``step_tokens`` (tokens
    computed by forwards), ``step_s`` (wall time of ``step`` calls that ran a forward),
    ``forward_s`` (wall time inside ``ModelRunner.forward``, including the logits' host read) and
    ``peak_used_blocks`` (the most blocks in use, cache and requests together, seen at a step)."""

    steps: int = 0
    step_tokens: int = 0
    step_s: float = 0.0
    forward_s: float = 0.0
    peak_used_blocks: int = 0
