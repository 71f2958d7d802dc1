"""The engine's model runner for a transformers causal LM: one packed forward with a StepPlan."""

from __future__ import annotations

import torch

from radixcache.attention.plan import StepPlan, device_tensor
from radixcache.engine.runner import ModelRunner
from radixcache.integrations.hf.cache import StepCache, forget_pending


class HFModelRunner(ModelRunner):
    """Runs ``model`` (switched to radixcache's attention by ``install``) on a ``[1, T]`` packed
    step: token ids, positions and the logits rows go to the device in one copy, and a
    ``StepCache`` routes every layer's K/V and attention through the plan. ``model_id`` roots the
    namespaces of the engine's requests (the wrapper updates it on ``invalidate``)."""

    def __init__(self, model, vocab_size: int, device: torch.device, model_id: str):
        self.model = model
        self.vocab_size = vocab_size
        self.device = device
        self.model_id = model_id

    def forward(self, tokens: list, positions: list, plan: StepPlan, logits_rows: list) -> torch.Tensor:
        """See ``ModelRunner.forward``."""
        t = len(tokens)
        packed = device_tensor(tokens + positions + logits_rows, self.device)
        try:
            with torch.no_grad():
                out = self.model(input_ids=packed[:t][None], position_ids=packed[t:2 * t][None],
                                 cache=StepCache(plan), use_cache=True, logits_to_keep=packed[2 * t:])
        finally:
            forget_pending()
        return out.logits[0].float()
